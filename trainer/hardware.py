"""Accelerator facts in one table keyed by device name: peak dense bf16 FLOP/s, memory, links.

MFU (trainer metrics), the planner and the config reviewer all read peaks from here, so a figure
is corrected in one place. Peaks are dense (no 2:4 sparsity) from NVIDIA's datasheets:
- A100 SXM 80GB: 312 TFLOP/s bf16, 80 GB HBM2e, NVLink 600 GB/s (A100 datasheet, 2021);
- H100 SXM: 989 TFLOP/s bf16, 80 GB HBM3, NVLink 900 GB/s (H100 datasheet, 2023);
- H200 SXM: same compute die as H100, 141 GB HBM3e, NVLink 900 GB/s (H200 datasheet, 2024).
Torch-free; the trainer matches `torch.cuda.get_device_name()` against `match`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    match: str  # substring of torch.cuda.get_device_name() that identifies it
    peak_bf16_flops: float  # dense, FLOP/s
    memory_bytes: int
    nvlink_bytes_per_s: float  # per-GPU bidirectional NVLink bandwidth within a node
    gpus_per_node: int = 8


GB = 10**9

ACCELERATORS: dict[str, Accelerator] = {
    "a100-80g": Accelerator("a100-80g", "A100", 312e12, 80 * GB, 600 * GB),
    "h100": Accelerator("h100", "H100", 989e12, 80 * GB, 900 * GB),
    "h200": Accelerator("h200", "H200", 989e12, 141 * GB, 900 * GB),
}


def accelerator(name: str) -> Accelerator:
    key = name.lower()
    if key not in ACCELERATORS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(ACCELERATORS))}")
    return ACCELERATORS[key]


def from_device_name(device_name: str) -> Accelerator | None:
    """The table entry for a CUDA device name such as 'NVIDIA H200', or None if unknown."""
    for acc in ACCELERATORS.values():
        if acc.match.lower() in device_name.lower():
            return acc
    return None
