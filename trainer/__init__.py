"""Crucible's data plane: everything a person or a workload pod runs (`crucible ...`).

Subpackages by concept (corpus, tokenizer, plan, and the training modules). This package must
stay importable without torch (`crucible --help` works where torch is not installed), so torch is
imported only inside the modules that train. The operator never imports it: the planes meet only
in `crucible.api` (tests/api/test_boundaries.py).
"""

__version__ = "0.1.0"
