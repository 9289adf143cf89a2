"""Accelerator facts in one table keyed by device name: peak dense bf16 FLOP/s, memory, links.

MFU (trainer metrics), the planner and the config reviewer all read peaks from here, so a figure
is corrected in one place. Peaks are dense (no 2:4 sparsity) from NVIDIA's datasheets:
- A100 SXM 80GB: 312 TFLOP/s bf16, 80 GB HBM2e, NVLink 600 GB/s (A100 datasheet, 2021);
- H100 SXM: 989 TFLOP/s bf16, 80 GB HBM3, NVLink 900 GB/s (H100 datasheet, 2023);
- H200 SXM: same compute die as H100, 141 GB HBM3e, NVLink 900 GB/s (H200 datasheet, 2024);
- B200 (HGX B200): 2.25 PFLOP/s bf16 dense (4.5 with sparsity), 180 GB HBM3e, NVLink 1.8 TB/s
  (HGX B200 datasheet: 36 PFLOP/s sparse and 1.4 TB for 8 GPUs);
- GB200 (NVL72): 2.5 PFLOP/s bf16 dense (5 with sparsity), 186 GB HBM3e, NVLink 1.8 TB/s (GB200
  NVL72 datasheet: 360 PFLOP/s sparse and 13.4 TB for 72 GPUs). A node here is a compute tray,
  the Kubernetes node, of 4 GPUs; the trays of a rack share one NVLink domain, which the planner
  does not model: it prices traffic between trays at the network's rate, which errs towards
  recommending less parallelism across nodes, never more;
- AMD Instinct MI300X: 1,307 TFLOP/s bf16 dense, 192 GB HBM3, Infinity Fabric 896 GB/s peer to
  peer (7 links of 128 GB/s; MI300X datasheet); MI325X: the same compute and links, 256 GB
  HBM3E (MI325X datasheet). The links are a full mesh without a switch: a pair of GPUs has one
  128 GB/s link, where the planner gives a tensor-parallel group the aggregate, so on these it
  leans towards more tensor parallelism than the hardware repays (not modelled). Their device
  plugin advertises `amd.com/gpu`.
Inter-node bandwidth is per GPU, one direction, for the reference 8-GPU servers: DGX A100 has one
200 Gb/s HDR InfiniBand port per GPU (25 GB/s), DGX H100/H200/B200 and GB200 trays one 400 Gb/s
ConnectX-7 port per GPU (50 GB/s) (DGX A100, DGX H100 and DGX B200 datasheets); MI300X/MI325X
platforms are assumed to have the same one 400 Gb/s NIC per GPU. NVLink and Infinity Fabric
figures above are bidirectional; one direction is half. Prices are NOT vendor figures: they are
a stated assumption (typical 2025 on-demand cloud list prices per GPU-hour, order of magnitude
only) for `crucible plan`'s cost line; pass `--price` for your own.
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
    internode_bytes_per_s: float = 0.0  # per-GPU network bandwidth, one direction (see docstring)
    usd_per_gpu_hour: float = 0.0  # assumption, not a quote (see docstring)
    resource: str = "nvidia.com/gpu"  # the extended resource its device plugin advertises
    nvlink_domain: int = 0  # GPUs one NVLink domain spans (0: the node's)

    @property
    def link_domain(self) -> int:
        """GPUs tensor parallelism may span without going over the network."""
        return self.nvlink_domain or self.gpus_per_node

    @property
    def nvlink_one_way_bytes_per_s(self) -> float:
        return self.nvlink_bytes_per_s / 2


GB = 10**9

ACCELERATORS: dict[str, Accelerator] = {
    "a100-80g": Accelerator("a100-80g", "A100", 312e12, 80 * GB, 600 * GB,
                            internode_bytes_per_s=25 * GB, usd_per_gpu_hour=1.8),
    "h100": Accelerator("h100", "H100", 989e12, 80 * GB, 900 * GB,
                        internode_bytes_per_s=50 * GB, usd_per_gpu_hour=2.5),
    "h200": Accelerator("h200", "H200", 989e12, 141 * GB, 900 * GB,
                        internode_bytes_per_s=50 * GB, usd_per_gpu_hour=3.5),
    # GB200 before B200: `from_device_name` takes the first entry whose `match` the name holds.
    "gb200": Accelerator("gb200", "GB200", 2.5e15, 186 * GB, 1800 * GB, gpus_per_node=4,
                         internode_bytes_per_s=50 * GB, usd_per_gpu_hour=6.0, nvlink_domain=72),
    "b200": Accelerator("b200", "B200", 2.25e15, 180 * GB, 1800 * GB,
                        internode_bytes_per_s=50 * GB, usd_per_gpu_hour=5.0),
    "mi300x": Accelerator("mi300x", "MI300X", 1307.4e12, 192 * GB, 896 * GB,
                          internode_bytes_per_s=50 * GB, usd_per_gpu_hour=2.5,
                          resource="amd.com/gpu"),
    "mi325x": Accelerator("mi325x", "MI325X", 1307.4e12, 256 * GB, 896 * GB,
                          internode_bytes_per_s=50 * GB, usd_per_gpu_hour=3.0,
                          resource="amd.com/gpu"),
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
