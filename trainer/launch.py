"""The launch contract: environment every launcher of `crucible train` under torchrun must set.

Torch-free, so the operator (which renders the pods' env) and the trainer share one definition.

torch's elastic agent shares one TCP store across rendezvous rounds by default, and two of its
behaviours break restarts (both reproduced by tests/trainer/test_checkpoint_chaos.py):
- process-group keys (each rank's listening address) are not namespaced per round, so a
  restarted rank can read the address of a rank that died and fail with "connection refused";
- a rank-0 agent does not re-announce the shared store in later rounds, so a node that joins
  after a scale-down times out waiting for MASTER_ADDR.
With sharing off, rank 0 of each round hosts a fresh store on a fresh port.
"""

TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
