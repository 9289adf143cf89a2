"""What each training precision keeps, in bytes per parameter: the parameters, their sharded
gradients, AdamW's two moments, an fp32 master copy, and the dtype FSDP reduces gradients in.

Owns the table and nothing else; `memory` turns it into bytes per GPU and `parallelism` into
traffic. Which precision a job or a foreign config asks for is `configs`' to read. Sources:
- Mixed precision (Micikevicius et al. 2018, "Mixed Precision Training", §3.1; the split
  ZeRO uses, Rajbhandari et al. 2020 §3.1): bf16 parameters and gradients, 2 + 2 bytes, and
  K = 12 bytes of optimizer state: the fp32 master (4) and Adam's m and v (4 + 4). 16 in all.
  FSDP2 as PyTorch runs it keeps the fp32 parameters as the shards and casts a bf16 copy to
  compute (`MixedPrecisionPolicy(param_dtype=bf16)`), so its shards hold 4 + 4 + 8: the same
  16 bytes, split differently.
- Pure bf16 (torchtitan's `training.dtype = "bfloat16"`, torchtitan/config/configs.py: "all
  parameters, gradients, and optimizer states in bfloat16, without an extra copy of fp32
  weights"): 2 + 2 + 2 + 2 = 8 bytes.
- bf16 with stochastic rounding (Crucible's `training.optimizer.bf16StochasticRounding`;
  trainer/stochastic_rounding.py; Gupta et al. 2015 §3, Zamirai et al. 2020 §4): bf16
  parameters with no master, AdamW's m and v in fp32, each update rounded stochastically into
  the bf16 parameter. FSDP stores the reduce-scattered gradient shards in the parameters'
  dtype, bf16: 2 + 2 + 8 = 12 bytes.
- fp32: 4 + 4 + 8, no master (the parameters are the master).
- The reduce dtype (FSDP2's `MixedPrecisionPolicy.reduce_dtype`; torchtitan's
  `training.mixed_precision_reduce`, whose only accepted value is "float32"; Crucible's
  trainer/parallel.py reduces in fp32 too): the dtype of a module's whole gradient while it
  waits for its reduce-scatter, of gradients accumulated unsynchronised across micro-batches
  (FSDP2 keeps those in the reduce dtype when it differs from the parameters'), and of the
  reduce-scatter on the wire. It does not change the sharded gradients kept after the reduce,
  which take the parameters' dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Bytes a value of each reduce dtype takes; the names are torchtitan's and PyTorch's.
REDUCE_DTYPES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2}


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of what training keeps, under AdamW."""

    name: str
    param_bytes: float   # the stored parameters, and the gathered copy FSDP computes with
    grad_bytes: float    # sharded gradients after the reduce (the parameters' dtype)
    moment_bytes: float  # AdamW's m and v together
    master_bytes: float  # an fp32 copy of bf16 parameters; 0 when there is none
    activation_bytes: int  # bytes per activation value; Korthikanti's formulas assume 2
    reduce_bytes: float = 4.0  # FSDP's reduce dtype (module docstring)

    @property
    def optimizer_bytes(self) -> float:
        """K in the ZeRO paper: everything the optimizer step alone needs."""
        return self.moment_bytes + self.master_bytes

    @property
    def state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def checkpoint_bytes(self) -> float:
        """What a checkpoint holds a parameter: its most precise copy and both moments."""
        return (self.master_bytes or self.param_bytes) + self.moment_bytes


PRECISIONS = {
    # Mixed precision (Micikevicius et al. 2018; ZeRO §3.1): 2 + 2 + (4 + 8) = 16 bytes.
    "bf16": Precision("bf16", 2, 2, 8, 4, 2),
    # fp32 parameters are their own master: 4 + 4 + 8 = 16 bytes.
    "fp32": Precision("fp32", 4, 4, 8, 0, 4),
    # Everything bf16 (torchtitan's training.dtype = "bfloat16"): 2 + 2 + 4 = 8 bytes. FSDP
    # still reduce-scatters in fp32 (torchtitan accepts no other mixed_precision_reduce).
    "bf16-pure": Precision("bf16-pure", 2, 2, 4, 0, 2),
    # bf16 parameters rounded stochastically, fp32 moments: 2 + 2 + 8 = 12 bytes.
    "bf16-sr": Precision("bf16-sr", 2, 2, 8, 0, 2),
}


def with_reduce_dtype(precision: Precision, dtype: str) -> Precision:
    """`precision` with FSDP reducing in `dtype` ("float32" or "bfloat16"); the name says so
    when it is not fp32, the default everywhere."""
    if dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce dtype must be one of {sorted(REDUCE_DTYPES)}, got {dtype!r}")
    size = REDUCE_DTYPES[dtype]
    if size == precision.reduce_bytes:
        return precision
    return dataclasses.replace(precision, name=f"{precision.name}, {dtype} reduce",
                               reduce_bytes=size)
