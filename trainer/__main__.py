"""`python -m crucible.trainer ...` is the `crucible` command (torchrun uses this form)."""

import sys

from crucible.trainer.cli import main

sys.exit(main())
