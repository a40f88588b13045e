"""Policies by registry name, created with keyword parameters.

A policy is named by a registry name (`vllm`, `priority`, `sjf`, `srpt`, `vtc`, `edf`, the
contiguous baselines), by an import path `package.module:Class`, or by the name of a
`pagesim.policies` entry point. A class that subclasses `QueuePolicy` runs on the paged scheduler
(`VllmScheduler`, with its skip-ahead); a `Scheduler` subclass runs as it is. Its own keyword
options come as `policy_options` (`--policy-arg key=value`), checked against its signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from policies.contiguous_schedulers import OrcaScheduler, StaticScheduler
from policies.plugins import check_option_types, load_plugin
from policies.queue_policy import BUILTIN, QueuePolicy
from policies.scheduler import Scheduler
from policies.vllm_scheduler import VllmScheduler


def _check_options(target: Callable[..., Any], kw: dict[str, Any], label: str, skip: set[str] = frozenset()) -> None:
    params = inspect.signature(target).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    known = set(params) - set(skip)
    for k in kw:
        if k not in known:
            raise ValueError(f"unknown parameter {k!r} for policy {label}; known: {', '.join(sorted(known)) or 'none'}")


def _paged(policy_cls: type[QueuePolicy] | None, label: str) -> Callable[..., Scheduler]:
    def make(num_blocks: int, block_size: int = 16, policy_options: dict[str, Any] | None = None,
             **kw: Any) -> Scheduler:
        _check_options(VllmScheduler, kw, label, {"num_gpu_blocks", "block_size", "policy"})
        policy = None
        if policy_cls is not None:
            _check_options(policy_cls, policy_options or {}, label)
            check_option_types(policy_cls, policy_options or {}, f"policy {label}")
            policy = policy_cls(**(policy_options or {}))
        elif policy_options:
            raise ValueError(f"policy {label} takes no policy options; got {', '.join(policy_options)}")
        return VllmScheduler(num_gpu_blocks=num_blocks, block_size=block_size, policy=policy, **kw)
    make.policy_class = policy_cls  # what make_scheduler asks about its options (see _takes_slo_ttft)
    return make


def _vllm(num_blocks: int, block_size: int = 16, **kw: Any) -> Scheduler:
    return _paged(None, "'vllm'")(num_blocks, block_size, **kw)


def _orca(variant: str) -> Callable[..., Scheduler]:
    def make(num_blocks: int, block_size: int = 16, policy_options: dict[str, Any] | None = None,
             **kw: Any) -> Scheduler:
        _no_options(policy_options, f"orca-{variant}")
        # the contiguous baselines place chunks at token granularity; the cache is the same size
        return OrcaScheduler(num_slots=num_blocks * block_size, variant=variant,
                             block_size=kw.pop("alloc_unit", 1), **_only(kw, "orca"))
    return make


def _static(num_blocks: int, block_size: int = 16, policy_options: dict[str, Any] | None = None,
            **kw: Any) -> Scheduler:
    _no_options(policy_options, "static")
    return StaticScheduler(num_slots=num_blocks * block_size, block_size=kw.pop("alloc_unit", 1),
                           **_only(kw, "static"))


# Options of the paged 'vllm' policy only, at their off / default values (the values the
# contiguous baselines accept, and what a study sets when it runs a baseline beside vllm).
PAGED_ONLY_DEFAULTS: dict[str, Any] = {"preemption": "recompute", "chunked_prefill": False, "prefix_caching": False,
                                       "num_cpu_blocks": 0, "watermark": 0.01}


def _no_options(options: dict[str, Any] | None, name: str) -> None:
    if options:
        raise ValueError(f"policy {name!r} takes no policy options; got {', '.join(options)}")


def _only(kw: dict[str, Any], name: str) -> dict[str, Any]:
    """Contiguous baselines take the budgets and context length only; paged-only options must be off."""
    allowed = {"max_num_seqs", "max_num_batched_tokens", "max_model_len"}
    for k, v in kw.items():
        if k in PAGED_ONLY_DEFAULTS:
            if v is not None and v != PAGED_ONLY_DEFAULTS[k]:
                raise ValueError(f"{k}={v!r} applies to the paged 'vllm' policy only, not {name!r}")
        elif k not in allowed:
            raise ValueError(f"unknown parameter {k!r} for policy {name!r}")
    return {k: v for k, v in kw.items() if k in allowed}


POLICIES: dict[str, Callable[..., Scheduler]] = {
    "vllm": _vllm,
    **{name: _paged(cls, repr(name)) for name, cls in BUILTIN.items() if name != "fcfs"},
    "orca-max": _orca("max"),
    "orca-pow2": _orca("pow2"),
    "orca-oracle": _orca("oracle"),
    "static": _static,
}


# Other names a policy is known by: first come, first served is vLLM's default order
ALIASES: dict[str, str] = {"fcfs": "vllm"}


def resolve_policy(name: str) -> Callable[..., Scheduler]:
    """The factory for a registry name (or an alias of one), an import path `module:Class`, or a
    `pagesim.policies` entry point; a clear ValueError naming what did not resolve, before any
    simulation starts."""
    name = ALIASES.get(name, name)
    if name in POLICIES:
        return POLICIES[name]
    target = load_plugin(name, "pagesim.policies", "policy", POLICIES)
    if inspect.isclass(target) and issubclass(target, QueuePolicy):
        return _paged(target, repr(name))
    if inspect.isclass(target) and issubclass(target, Scheduler) and not inspect.isabstract(target):
        def make(num_blocks: int, block_size: int = 16, policy_options: dict[str, Any] | None = None,
                 **kw: Any) -> Scheduler:
            options = {**kw, **(policy_options or {})}
            max_model_len = options.pop("max_model_len", None)
            if _takes(target, "max_model_len"):
                options["max_model_len"] = max_model_len
            # a run's option at its default that the constructor has no parameter for is not its concern
            options = {k: v for k, v in options.items()
                       if _takes(target, k) or k not in PAGED_ONLY_DEFAULTS or v != PAGED_ONLY_DEFAULTS[k]}
            _check_options(target, options, repr(name), {"num_gpu_blocks", "block_size"})
            sched = target(num_gpu_blocks=num_blocks, block_size=block_size, **options)
            if max_model_len is not None and "max_model_len" not in options:  # the base Scheduler's field
                sched.max_model_len = max_model_len
            return sched
        return make
    raise ValueError(f"policy {name!r}: {target!r} implements neither the QueuePolicy interface "
                     "(policies.queue_policy) nor a concrete Scheduler")


def is_paged(name: str) -> bool:
    """Whether the policy runs on the paged block manager (takes the paged-only options)."""
    return name not in ("orca-max", "orca-pow2", "orca-oracle", "static")


def make_scheduler(name: str, num_blocks: int, block_size: int = 16, slo_ttft: float | None = None,
                   **kw: Any) -> Scheduler:
    """Create a policy by name (see resolve_policy) over a KV cache of `num_blocks` blocks of
    `block_size` tokens; `policy_options` in kw go to the policy class. `slo_ttft`: the run's TTFT
    SLO (`--slo-ttft`), which a policy class taking a `slo_ttft` option of its own (edf) schedules
    by when that option is not given, so that it aims at the deadline the run is judged by."""
    factory = resolve_policy(name)
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    options = kw.get("policy_options") or {}
    if slo_ttft is not None and "slo_ttft" not in options and _takes_slo_ttft(factory):
        kw["policy_options"] = {**options, "slo_ttft": slo_ttft}
    return factory(num_blocks, block_size, **kw)


def _takes_slo_ttft(factory: Callable[..., Scheduler]) -> bool:
    """Whether the factory's queue policy class (a paged policy's; none for the others) has a
    `slo_ttft` option."""
    cls = getattr(factory, "policy_class", None)
    return cls is not None and "slo_ttft" in inspect.signature(cls).parameters


def _takes(target: Callable[..., Any], option: str) -> bool:
    """Whether `target` takes the keyword `option` (by name, or through **kwargs)."""
    params = inspect.signature(target).parameters
    return option in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def parse_policy_args(items: list[str] | None, flag: str = "--policy-arg") -> dict[str, Any]:
    """`key=value` strings (`--policy-arg`, `--router-arg`: `flag` names it in errors) as keyword
    options; values read as int, float, true/false or none where they parse so, else kept as text."""
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"{flag} {item!r}: expected key=value with a Python identifier as key")
        options[key] = _parse_value(text.strip())
    return options


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
