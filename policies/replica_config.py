"""One replica's configuration, and the one place a replica's scheduler is built from it.

A replica is a scheduler (a policy over a KV cache) stepped with an executor (policies/step.py
`ReplicaStep`): the simulator wraps it in a SimPy process (sim.engine.Replica), the live engines in
a wall-clock loop (backend.replay.serve, backend.async_engine.AsyncEngine). Every layer that
makes replicas describes them with a `ReplicaConfig` and builds them with `build_replica`, so an
option of the scheduler is added here once (a field, and where `build_scheduler` passes it) and
reaches the simulation, the live replay and the server alike.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

from policies.iteration_log import IterationLog
from policies.registry import PAGED_ONLY_DEFAULTS, is_paged, make_scheduler
from policies.scheduler import Scheduler
from policies.step import Executor, ReplicaStep
from policies.vllm_scheduler import PREEMPTION_MODES


@dataclass(frozen=True)
class ReplicaConfig:
    """What one replica's scheduler is: its policy, KV cache and budgets (pure data).

    Construction checks every value once (ValueError naming the field and the `pagesim` flag that
    sets it): sizes are >= 1 (CPU blocks >= 0), the token budget holds a block, swap preemption has
    swap space, SLOs are finite and > 0, and a contiguous policy (orca-*, static) leaves the paged
    policy's own options at their defaults. `alloc_unit`: the tokens a contiguous policy places its
    chunks in (1 in simulation; a live cache's block size, as its chunks must map onto blocks).
    `max_model_len`: the context length beyond which a request is refused (None: no limit)."""

    num_gpu_blocks: int
    block_size: int = 16
    policy: str = "vllm"                     # a registry name, package.module:Class, or an entry point
    policy_options: dict[str, Any] = field(default_factory=dict)  # the policy class's keyword options
    num_cpu_blocks: int = 0                  # the swap space (paged policies)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    preemption: str = "recompute"
    chunked_prefill: bool = False
    prefix_caching: bool = False
    watermark: float = 0.01
    max_model_len: int | None = None
    slo_ttft: float | None = None            # the run's TTFT SLO: an SLO-aware policy (edf) aims at it
    slo_tpot: float | None = None
    alloc_unit: int = 1

    def __post_init__(self) -> None:
        for name, flag, low in (("num_gpu_blocks", "--num-gpu-blocks", 1), ("block_size", "--block-size", 1),
                                ("num_cpu_blocks", "--num-cpu-blocks", 0), ("max_num_seqs", "--max-num-seqs", 1),
                                ("alloc_unit", None, 1)):
            value = getattr(self, name)
            if not isinstance(value, Integral) or value < low:
                raise ValueError(_says(name, flag, f"must be an integer >= {low}, got {value!r}"))
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(_says("max_num_batched_tokens", "--max-num-batched-tokens",
                                   f"must be >= block_size ({self.block_size}), got {self.max_num_batched_tokens}"))
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(_says("max_model_len", None, f"must be >= 1, got {self.max_model_len}"))
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(_says("preemption", "--preemption", f"must be one of {', '.join(PREEMPTION_MODES)}; "
                                                                 f"got {self.preemption!r}"))
        if not 0 <= self.watermark < 1:
            raise ValueError(_says("watermark", None, f"must be in [0, 1), got {self.watermark}"))
        for name in ("slo_ttft", "slo_tpot"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(_says(name, f"--{name.replace('_', '-')}",
                                       f"must be a finite number of seconds > 0, got {value!r}"))
        if is_paged(self.policy):
            if self.preemption == "swap" and self.num_cpu_blocks < 1:
                raise ValueError("preemption='swap' (--preemption) needs num_cpu_blocks >= 1 (the CPU swap space, "
                                 "--num-cpu-blocks)")
            return
        for name, default in PAGED_ONLY_DEFAULTS.items():
            value = getattr(self, name)
            if name != "num_cpu_blocks" and value != default:  # the swap space is a capacity, not a choice
                raise ValueError(f"{name}={value!r} applies to the paged 'vllm' policy only, not {self.policy!r} "
                                 f"(--{name.replace('_', '-')})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _says(name: str, flag: str | None, what: str) -> str:
    return f"{name} {what}" + (f" ({flag})" if flag else "")


def build_scheduler(config: ReplicaConfig) -> Scheduler:
    """The replica's scheduler: `config.policy` over its cache, with its budgets and options (a
    contiguous policy takes the budgets and `alloc_unit` only; ReplicaConfig checked the rest off)."""
    kw: dict[str, Any] = {"max_num_seqs": config.max_num_seqs,
                          "max_num_batched_tokens": config.max_num_batched_tokens,
                          "max_model_len": config.max_model_len}
    if is_paged(config.policy):
        kw.update(num_cpu_blocks=config.num_cpu_blocks, preemption=config.preemption,
                  chunked_prefill=config.chunked_prefill, prefix_caching=config.prefix_caching,
                  watermark=config.watermark)
    else:
        kw["alloc_unit"] = config.alloc_unit
    return make_scheduler(config.policy, config.num_gpu_blocks, config.block_size,
                          policy_options=dict(config.policy_options), slo_ttft=config.slo_ttft, **kw)


def build_replica(config: ReplicaConfig, executor: Executor, log: IterationLog | None = None,
                  routed: bool = False, counts_only: bool = False) -> ReplicaStep:
    """One replica: the configured scheduler stepped with `executor` (which holds no scheduler:
    each plan hands it the sequences it runs). `log`, `routed`, `counts_only`: see ReplicaStep."""
    return ReplicaStep(build_scheduler(config), executor, log, routed=routed, counts_only=counts_only)
