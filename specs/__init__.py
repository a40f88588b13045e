"""Model and hardware specifications: pure data, no torch, no SimPy (the bottom layer; sim/ and
backend/ both read it)."""

from specs.capacity import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    GiB,
    estimate_activation_reserve,
    kv_capacity_blocks,
    kv_capacity_tokens,
)
from specs.catalogue import MODELS, find_config, get_model, load_model, read_config, resolve_model_name
from specs.hardware import HARDWARE, HardwareSpec, MiB, get_hardware, load_hardware, read_hardware
from specs.model import ModelSpec

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS", "DEFAULT_MAX_NUM_SEQS", "HARDWARE", "MODELS", "GiB", "HardwareSpec", "MiB",
    "ModelSpec", "estimate_activation_reserve", "find_config", "get_hardware", "get_model", "kv_capacity_blocks",
    "kv_capacity_tokens", "load_hardware", "load_model", "read_config", "read_hardware", "resolve_model_name",
]
