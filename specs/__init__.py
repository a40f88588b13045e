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
from specs.hardware import HARDWARE, HardwareSpec, MiB, get_hardware
from specs.model import MODELS, ModelSpec, get_model

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS", "DEFAULT_MAX_NUM_SEQS", "HARDWARE", "MODELS", "GiB", "HardwareSpec", "MiB",
    "ModelSpec", "estimate_activation_reserve", "get_hardware", "get_model", "kv_capacity_blocks",
    "kv_capacity_tokens",
]
