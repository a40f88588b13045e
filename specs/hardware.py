"""Accelerator specifications: `HardwareSpec`, read from JSON files (the shipped ones in
specs/hardware/*.json, or any file of the same fields).

File fields and units (all per device, dense figures, no structured sparsity):
  name                      str   the catalogue name (default: the file's stem)
  aliases                   list  other names it answers to (optional)
  peak_bf16_tflops          TFLOP/s of dense bf16/fp16 tensor-core math
  peak_fp8_tflops           TFLOP/s of dense fp8 tensor-core math (0: the device has no fp8 units)
  hbm_bandwidth_gb_s        device memory bandwidth, GB/s (10^9 B/s)
  memory_mib                device memory as the runtime reports it (nvidia-smi "Total"), MiB; vLLM's
                            gpu_memory_utilization is a fraction of this
  interconnect_gb_s         GPU<->GPU bandwidth per direction (NVLink, Infinity Fabric; PCIe where there
                            is none), GB/s, for the tensor-parallel all-reduce and KV transfers
  interconnect_latency_us   small-message latency of that link, us (an estimate: datasheets do not give it)
  pcie_gb_s                 host<->device bandwidth per direction, GB/s, for KV swap
  source                    which datasheet the figures come from
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specs.json_file import read_json
from specs.names import normalize

MiB = 1024**2
_TERA = 1e12
_GIGA = 1e9
_MICRO = 1e-6
CATALOGUE_DIR = Path(__file__).parent / "hardware"

# file field -> (HardwareSpec field, unit in SI); a file must carry every one of these
_FIELDS = {
    "peak_bf16_tflops": ("peak_flops", _TERA),
    "peak_fp8_tflops": ("peak_fp8_flops", _TERA),
    "hbm_bandwidth_gb_s": ("mem_bandwidth", _GIGA),
    "memory_mib": ("memory_bytes", MiB),
    "interconnect_gb_s": ("interconnect_bandwidth", _GIGA),
    "interconnect_latency_us": ("interconnect_latency_s", _MICRO),
    "pcie_gb_s": ("pcie_bandwidth", _GIGA),
}


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator's peak numbers (per device), in SI units.

    peak_flops: dense fp16/bf16 tensor-core FLOP/s (no sparsity).
    mem_bandwidth: HBM bandwidth, B/s.
    memory_bytes: device memory as CUDA reports it (nvidia-smi "Total"); vLLM's
        `gpu_memory_utilization` is a fraction of this.
    interconnect_bandwidth: GPU<->GPU bandwidth per direction (NVLink), B/s, used for the
        tensor-parallel all-reduce.
    pcie_bandwidth: host<->device bandwidth per direction, B/s, used for KV swap.
    peak_fp8_flops: dense fp8 tensor-core FLOP/s (0 where the device has none).
    interconnect_latency_s: small-message latency of the GPU<->GPU link, s.
    source: where the figures come from (not part of equality).
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: int
    interconnect_bandwidth: float
    pcie_bandwidth: float
    peak_fp8_flops: float = 0.0
    interconnect_latency_s: float = 0.0
    source: str = field(default="", compare=False)


def read_hardware(path: str | Path) -> tuple[HardwareSpec, list[str]]:
    """(spec, aliases) from one hardware JSON file; a missing or non-positive field raises
    ValueError naming the file and the field."""
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    values: dict[str, Any] = {}
    for key, (attr, unit) in _FIELDS.items():
        v = data.get(key)
        if v is None:
            raise ValueError(f"{path}: {key}: missing (fields: {', '.join(_FIELDS)}, source)")
        least_ok = 0 if key in ("peak_fp8_tflops", "interconnect_latency_us") else None
        # json reads NaN and Infinity: NaN passed both comparisons and priced every step as NaN
        if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                or (v < 0 if least_ok == 0 else v <= 0)):
            raise ValueError(f"{path}: {key}: must be a number {'>= 0' if least_ok == 0 else '> 0'}, got {v!r}")
        values[attr] = v * unit
    if not isinstance(data.get("source"), str) or not data["source"].strip():
        raise ValueError(f"{path}: source: missing (say which datasheet the figures come from)")
    if values["memory_bytes"] >= 2**63:  # was: OverflowError from int(inf), or one from numpy later
        raise ValueError(f"{path}: memory_mib: {data['memory_mib']!r} MiB is beyond 2**63 bytes")
    values["memory_bytes"] = int(values["memory_bytes"])
    spec = HardwareSpec(name=str(data.get("name") or path.stem), source=data["source"], **values)
    aliases = data.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ValueError(f"{path}: aliases: must be a list of names, got {aliases!r}")
    if not isinstance(data.get("name", ""), str):
        raise ValueError(f"{path}: name: must be a string, got {data['name']!r}")
    return spec, aliases


def _catalogue() -> tuple[dict[str, HardwareSpec], dict[str, str]]:
    specs, aliases = {}, {}
    for p in sorted(CATALOGUE_DIR.glob("*.json")):
        spec, names = read_hardware(p)
        specs[spec.name] = spec
        aliases.update({normalize(a): spec.name for a in names})
    return specs, aliases


HARDWARE, _HARDWARE_ALIASES = _catalogue()


def load_hardware(name_or_path: str) -> HardwareSpec:
    """A shipped hardware spec by name or alias, case-insensitively, or a hardware JSON file."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"{path}: no such hardware file")
        return read_hardware(path)[0]
    key = normalize(name_or_path)
    key = _HARDWARE_ALIASES.get(key, key)
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name_or_path!r}; known: {', '.join(sorted(HARDWARE))} "
                         "(or a hardware JSON file)")
    return HARDWARE[key]


def get_hardware(name_or_path: str) -> HardwareSpec:
    """Alias of `load_hardware` (the simulator's historic name)."""
    return load_hardware(name_or_path)
