"""Crucible's data plane: everything a person or a workload pod runs (`crucible ...`).

Subpackages by concept (corpus, tokenizer, plan, and the training modules). This package must stay
importable without torch: the operator imports `plan` and the spec models from here, and its image
has no torch, so torch is imported only inside the modules that train.
"""

__version__ = "0.1.0"
