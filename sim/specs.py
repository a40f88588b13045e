"""Hardware and model specifications now live in the bottom-layer package `specs` (shared with the
backend); this module re-exports them for the simulator's existing importers."""

from specs import (  # noqa: F401
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    HARDWARE,
    MODELS,
    GiB,
    HardwareSpec,
    MiB,
    ModelSpec,
    estimate_activation_reserve,
    get_hardware,
    get_model,
    kv_capacity_blocks,
    kv_capacity_tokens,
    load_hardware,
    load_model,
)
