"""Wiring for one simulation: a trace, a policy and a cost model in; request and iteration tables
and a summary out."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import simpy

from policies.metrics import request_frame, summarize
from policies.registry import make_scheduler, scheduler_options
from policies.request import Request, SamplingParams
from policies.scheduler import Scheduler
from sim.cost_model import CostModel, RooflineCostModel
from sim.engine import ArrivalFeed, Replica, arrival_process, engine_process
from sim.executor import SimulatedExecutor, load_beam_picks
from sim.specs import get_hardware, get_model, kv_capacity_blocks
from traces.trace import Trace


@dataclass
class SimConfig:
    model: str = "opt-13b"
    hardware: str = "a100-40gb"
    tp: int = 1
    policy: str = "vllm"
    block_size: int = 16
    preemption: str = "recompute"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    chunked_prefill: bool = False
    prefix_caching: bool = False
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None      # override the derived KV capacity
    swap_space_gib: float = 4.0            # CPU swap space, as vLLM's default
    num_cpu_blocks: int | None = None      # override the swap space (blocks)
    cost_model: str = "roofline"           # or "profiled" (then `profile` names the profile file)
    profile: str | None = None
    n: int | None = None                   # override the trace's parallel samples
    beam_width: int | None = None          # override the trace's beam width
    beam_rank_decay: float = 0.5           # the simulated beam rule's q (sim/executor.py)
    beam_picks: str | None = None          # a measured pick table (`pagesim beams --out`) instead of the rule
    seed: int = 0
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    fast_forward: bool = True
    debug: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class SimResult:
    requests: pd.DataFrame
    iterations: pd.DataFrame
    summary: dict[str, Any]
    config: SimConfig
    extra: dict[str, Any] = field(default_factory=dict)


def requests_from_trace(trace: Trace, max_model_len: int, n: int | None = None,
                        beam_width: int | None = None) -> list[Request]:
    """Trace rows as requests that decode exactly the trace's output length (ignore EOS).
    max_tokens is what the context leaves after the prompt (what Orca-Max reserves)."""
    prompts, outputs = trace.prompt_len.tolist(), trace.output_len.tolist()
    arrivals = trace.arrival.astype(float).tolist()
    ns = [n] * len(trace) if n is not None else trace.n.tolist()
    beams = [beam_width] * len(trace) if beam_width is not None else trace.beam_width.tolist()
    hashes = trace.prefix_hashes
    ids = trace.prompt_token_ids
    hbs = trace.hash_block_size or 16
    params: dict[tuple[int, int, int], SamplingParams] = {}  # frozen, so equal ones are shared
    reqs = []
    for i, (p, out, arrival, ni, bi) in enumerate(zip(prompts, outputs, arrivals, ns, beams)):
        key = (max(max_model_len - p, out, 1), ni, bi)
        sp = params.get(key)
        if sp is None:
            sp = params[key] = SamplingParams(max_tokens=key[0], ignore_eos=True, n=ni, beam_width=bi)
        reqs.append(Request(i, arrival, p, sp, out, None if ids is None or ids[i] is None else list(ids[i]),
                            None if hashes is None or hashes[i] is None else tuple(hashes[i]), hbs))
    return reqs


def build_cost_model(cfg: SimConfig) -> CostModel:
    """The roofline model of cfg.model on cfg.hardware, or the profiled model in cfg.profile (which
    must have been measured on cfg.model, at tensor-parallel degree 1, and needs an explicit
    num_gpu_blocks: a profile does not say how large the measured machine's cache was)."""
    kind = cfg.cost_model.strip().lower()
    if kind == "roofline":
        return RooflineCostModel(get_model(cfg.model), get_hardware(cfg.hardware), tp=cfg.tp)
    if kind != "profiled":
        raise ValueError(f"cost_model: unknown {cfg.cost_model!r}; known: roofline, profiled")
    from sim.profiled import ProfiledCostModel, load_profile
    if not cfg.profile:
        raise ValueError("cost_model 'profiled' needs a profile (a profile file, or a shipped profile's name)")
    profile = load_profile(cfg.profile)
    measured_on = str(profile["model"].get("name", "?"))
    if _spec_name(cfg.model) != _spec_name(measured_on):
        raise ValueError(f"profile {profile['source']} was measured on model {measured_on!r}, not {cfg.model!r}")
    if cfg.tp != 1:
        raise ValueError(f"tp: profiles are measured on one device; got tp={cfg.tp}")
    if cfg.num_gpu_blocks is None:  # the hardware spec's capacity would not be the profiled machine's
        raise ValueError("num_gpu_blocks: a profiled simulation needs the KV cache size in blocks (--num-gpu-blocks; "
                         "`pagesim live` uses 512 unless told otherwise)")
    return ProfiledCostModel.from_profile(profile)


def _spec_name(model: str) -> str:
    try:
        return get_model(model).name
    except ValueError:
        return model


def num_blocks_for(cfg: SimConfig) -> tuple[int, int]:
    """(GPU KV blocks, CPU swap blocks) for the configuration."""
    model, hw = get_model(cfg.model), get_hardware(cfg.hardware)
    gpu = cfg.num_gpu_blocks or kv_capacity_blocks(model, hw, block_size=cfg.block_size, tp=cfg.tp,
                                                   gpu_memory_utilization=cfg.gpu_memory_utilization)
    # swap_space_gib is per GPU, as vLLM's swap_space; each of the tp GPUs holds 1/tp of a block
    cpu = cfg.num_cpu_blocks
    if cpu is None:
        cpu = int(cfg.swap_space_gib * 2**30 * cfg.tp / (model.kv_bytes_per_token * cfg.block_size))
    return gpu, cpu


def run_simulation(cfg: SimConfig, trace: Trace, cost_model: CostModel | None = None,
                   progress: bool = False,
                   observer: Callable[[float, float, Scheduler], None] | None = None,
                   beam_picks: dict | None = None) -> SimResult:
    """Simulate the trace under the configuration; every request appears in the result.
    `observer(start, duration, scheduler)` is called after every iteration (which turns skipping
    ahead off: each iteration is stepped so that it can be seen). `beam_picks` (pick tables by
    width, sim.executor.BeamPicks) overrides the file named by cfg.beam_picks."""
    t0 = time.perf_counter()
    model = get_model(cfg.model)
    gpu_blocks, cpu_blocks = num_blocks_for(cfg)
    kw = scheduler_options(cfg.policy, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.preemption,
                           cfg.chunked_prefill, cfg.prefix_caching, cpu_blocks)
    sched = make_scheduler(cfg.policy, gpu_blocks, cfg.block_size, **kw)
    sched.max_model_len = model.max_position
    cost = cost_model or build_cost_model(cfg)
    picks = beam_picks if beam_picks is not None else (load_beam_picks(cfg.beam_picks) if cfg.beam_picks else None)
    executor = SimulatedExecutor(sched, cost, seed=cfg.seed, beam_rank_decay=cfg.beam_rank_decay, beam_picks=picks)
    env = simpy.Environment()
    with _gc_paused():
        feed = ArrivalFeed(requests_from_trace(trace, model.max_position, cfg.n, cfg.beam_width))
        bar = _progress_bar(len(feed.requests)) if progress else None
        replica = Replica(env, sched, executor, cfg.fast_forward, cfg.debug,
                          on_progress=(lambda now, done: _tick(bar, now, done)) if bar else None,
                          observer=observer)
        env.process(arrival_process(env, feed, replica))
        env.process(engine_process(env, replica, feed))
        env.run()
        if bar is not None:
            bar.close()
        _final_checks(sched, len(feed.requests))
        requests = request_frame(sched.done)
        iterations = replica.log.frame()
        summary = summarize(requests, iterations, cfg.slo_ttft, cfg.slo_tpot)
    summary["num_gpu_blocks"] = gpu_blocks
    summary["num_cpu_blocks"] = cpu_blocks
    summary["kv_capacity_tokens"] = gpu_blocks * cfg.block_size
    summary["wall_time_s"] = time.perf_counter() - t0
    summary["engine"] = {"stepped_iterations": replica.stepped, "skip_windows": replica.windows,
                         "skipped_iterations": replica.skipped, "preempting_in_windows": replica.exhaustions}
    summary["trace"] = trace.name
    summary["config"] = cfg.to_dict()
    return SimResult(requests, iterations, summary, cfg)


@contextlib.contextmanager
def _gc_paused():
    """Requests live for the whole run; the cyclic collector would rescan all of them again and
    again (superlinear in the number of requests). Per-iteration objects are acyclic and freed
    by reference counting, so collection is paused for the run and its tables."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _final_checks(sched, num_requests: int) -> None:
    """Conservation at the end of every run: all requests accounted for, no block leaked."""
    sched.check_conservation()
    if sched.has_unfinished() or len(sched.done) != num_requests:
        raise AssertionError(f"{num_requests} requests in, {len(sched.done)} out")
    bm = getattr(sched, "bm", None)
    if bm is not None:
        bm.assert_empty()
    if hasattr(sched, "check_invariants"):
        sched.check_invariants()


def _progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a core dependency
        return None
    return tqdm(total=total, unit="req", desc="simulating", mininterval=0.5, leave=False)


def _tick(bar, now: float, done: int) -> None:
    if done != bar.n:
        bar.update(done - bar.n)
        bar.set_postfix_str(f"t={now:,.1f}s", refresh=False)


def seeds(seed: int) -> np.random.SeedSequence:
    return np.random.SeedSequence(seed)
