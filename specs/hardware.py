"""Accelerator specifications: `HardwareSpec` and the shipped devices."""

from __future__ import annotations

from dataclasses import dataclass

from specs.names import normalize

MiB = 1024**2
_TERA = 1e12
_GIGA = 1e9


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator's peak numbers (per device).

    peak_flops: dense fp16/bf16 tensor-core FLOP/s (no sparsity).
    mem_bandwidth: HBM bandwidth, B/s.
    memory_bytes: device memory as CUDA reports it (nvidia-smi "Total"); vLLM's
        `gpu_memory_utilization` is a fraction of this.
    interconnect_bandwidth: GPU<->GPU bandwidth per direction (NVLink), B/s, used for the
        tensor-parallel all-reduce.
    pcie_bandwidth: host<->device bandwidth per direction, B/s, used for KV swap.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: int
    interconnect_bandwidth: float
    pcie_bandwidth: float


# --- shipped hardware -----------------------------------------------------------------------------
# Sources: NVIDIA A100 datasheet (312 TFLOPS bf16 dense; 1,555 GB/s for 40GB, 2,039 GB/s for 80GB
# SXM4; NVLink 3 600 GB/s total = 300 GB/s per direction; PCIe Gen4 x16 64 GB/s total = 32 GB/s per
# direction). NVIDIA H100 datasheet, SXM5 (989 TFLOPS bf16 dense, 1,979 with sparsity; 3.35 TB/s;
# NVLink 4 900 GB/s total = 450 per direction; PCIe Gen5 x16 128 GB/s total = 64 per direction).
# NVIDIA H200 datasheet, SXM (same compute as H100; 4.8 TB/s; "141 GB"; NVLink 900 GB/s; PCIe Gen5).
# Memory sizes are nvidia-smi totals: A100 40GB 40960 MiB, A100 80GB 81920 MiB, H100 80GB HBM3
# 81559 MiB, H200 143771 MiB (the "141 GB" of the datasheet).

HARDWARE: dict[str, HardwareSpec] = {
    "a100-40gb": HardwareSpec("a100-40gb", 312 * _TERA, 1555 * _GIGA, 40960 * MiB, 300 * _GIGA, 32 * _GIGA),
    "a100-80gb": HardwareSpec("a100-80gb", 312 * _TERA, 2039 * _GIGA, 81920 * MiB, 300 * _GIGA, 32 * _GIGA),
    "h100-sxm": HardwareSpec("h100-sxm", 989 * _TERA, 3350 * _GIGA, 81559 * MiB, 450 * _GIGA, 64 * _GIGA),
    "h200": HardwareSpec("h200", 989 * _TERA, 4800 * _GIGA, 143771 * MiB, 450 * _GIGA, 64 * _GIGA),
}

_HARDWARE_ALIASES = {
    "a100": "a100-40gb", "a100-sxm4-40gb": "a100-40gb", "a100-40g": "a100-40gb",
    "a100-sxm4-80gb": "a100-80gb", "a100-80g": "a100-80gb",
    "h100": "h100-sxm", "h100-80gb": "h100-sxm", "h100-sxm5": "h100-sxm", "h100-80gb-hbm3": "h100-sxm",
    "h200-sxm": "h200", "h200-141gb": "h200",
}

def get_hardware(name: str) -> HardwareSpec:
    """Look up a shipped hardware spec by name or alias, case-insensitively."""
    key = normalize(name)
    key = _HARDWARE_ALIASES.get(key, key)
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE))}")
    return HARDWARE[key]
