"""Policies by registry name, created with keyword parameters."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from policies.contiguous_schedulers import OrcaScheduler, StaticScheduler
from policies.scheduler import Scheduler
from policies.vllm_scheduler import VllmScheduler


def _vllm(num_blocks: int, block_size: int = 16, **kw: Any) -> Scheduler:
    known = set(inspect.signature(VllmScheduler).parameters) - {"num_gpu_blocks", "block_size"}
    for k in kw:
        if k not in known:
            raise ValueError(f"unknown parameter {k!r} for policy 'vllm'; known: {', '.join(sorted(known))}")
    return VllmScheduler(num_gpu_blocks=num_blocks, block_size=block_size, **kw)


def _orca(variant: str) -> Callable[..., Scheduler]:
    def make(num_blocks: int, block_size: int = 16, **kw: Any) -> Scheduler:
        # the contiguous baselines place chunks at token granularity; the cache is the same size
        return OrcaScheduler(num_slots=num_blocks * block_size, variant=variant,
                             block_size=kw.pop("alloc_unit", 1), **_only(kw, "orca"))
    return make


def _static(num_blocks: int, block_size: int = 16, **kw: Any) -> Scheduler:
    return StaticScheduler(num_slots=num_blocks * block_size, block_size=kw.pop("alloc_unit", 1),
                           **_only(kw, "static"))


# Options of the paged 'vllm' policy only, at their off / default values (the values the
# contiguous baselines accept, and what a study sets when it runs a baseline beside vllm).
PAGED_ONLY_DEFAULTS: dict[str, Any] = {"preemption": "recompute", "chunked_prefill": False, "prefix_caching": False,
                                       "num_cpu_blocks": 0, "watermark": 0.01}


def _only(kw: dict[str, Any], name: str) -> dict[str, Any]:
    """Contiguous baselines take the budgets only; paged-only options must be off."""
    allowed = {"max_num_seqs", "max_num_batched_tokens"}
    for k, v in kw.items():
        if k in PAGED_ONLY_DEFAULTS:
            if v is not None and v != PAGED_ONLY_DEFAULTS[k]:
                raise ValueError(f"{k}={v!r} applies to the paged 'vllm' policy only, not {name!r}")
        elif k not in allowed:
            raise ValueError(f"unknown parameter {k!r} for policy {name!r}")
    return {k: v for k, v in kw.items() if k in allowed}


POLICIES: dict[str, Callable[..., Scheduler]] = {
    "vllm": _vllm,
    "orca-max": _orca("max"),
    "orca-pow2": _orca("pow2"),
    "orca-oracle": _orca("oracle"),
    "static": _static,
}


def scheduler_options(policy: str, max_num_seqs: int, max_num_batched_tokens: int, preemption: str = "recompute",
                      chunked_prefill: bool = False, prefix_caching: bool = False,
                      num_cpu_blocks: int = 0) -> dict[str, Any]:
    """The keyword set `make_scheduler` takes for `policy`, from the options a run offers (the
    simulator's and the live engine's). Paged-only options set for a contiguous policy raise;
    the swap space (a capacity, not a choice) is simply not passed to one."""
    kw: dict[str, Any] = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                          "preemption": preemption, "chunked_prefill": chunked_prefill,
                          "prefix_caching": prefix_caching}
    if policy == "vllm":
        kw["num_cpu_blocks"] = num_cpu_blocks
    else:
        _only(kw, policy)  # raises on a paged-only option that is on
    return kw


def make_scheduler(name: str, num_blocks: int, block_size: int = 16, **kw: Any) -> Scheduler:
    """Create a policy by name over a KV cache of `num_blocks` blocks of `block_size` tokens."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return POLICIES[name](num_blocks, block_size, **kw)
