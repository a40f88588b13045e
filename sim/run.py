"""Wiring for one simulation: a trace, a policy and a cost model in; request and iteration tables
and a summary out."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import simpy

from policies.client_latency import ClientTerms, with_client_latencies
from policies.metrics import request_frame, summarize
from policies.registry import make_scheduler, scheduler_options
from policies.request import Request, SamplingParams
from policies.router import PrefixAffinityRouter, Router, counts_only, make_router
from policies.scheduler import Scheduler
from sim.cost_model import CostModel, RooflineCostModel
from sim.engine import ArrivalFeed, Replica, arrival_process, engine_process
from sim.executor import SimulatedExecutor, load_beam_picks
from sim.limits import CPU_BLOCK_BYTES, GPU_BLOCK_BYTES, REPLICA_BYTES, REQUEST_BYTES, check_fits
from sim.specs import get_hardware, get_model, kv_capacity_blocks
from traces.trace import Trace


@dataclass
class SimConfig:
    """One simulation's settings. Construction refuses values no run could use (ValueError naming
    the field and the `pagesim` flag that sets it): tp must split the model's attention and KV heads
    evenly; num_gpu_blocks, when given, is >= 1 (None derives it from the hardware); seeds lie in
    [0, 2**32); SLOs are finite and > 0; a given cache size must fit in this machine's memory."""

    model: str = "opt-13b"
    hardware: str = "a100-40gb"
    tp: int = 1
    policy: str = "vllm"                   # a registry name, package.module:Class, or an entry point
    policy_options: dict[str, Any] = field(default_factory=dict)  # the policy class's keyword options
    replicas: int = 1                      # model replicas serving the trace, each with its own KV cache
    router: str = "round-robin"            # how arrivals are spread over replicas (policies.router)
    router_options: dict[str, Any] = field(default_factory=dict)
    replica_hardware: tuple[str, ...] = ()  # each replica's GPU spec (default: every replica on `hardware`)
    disaggregate: tuple[int, ...] = ()      # (prefill replicas, decode replicas): disaggregated serving (sim.disagg)
    transfer_bandwidth: float | None = None  # prefill -> decode KV link, bytes/s (default: the NVLink bandwidth)
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
    calibration: str | None = None         # a calibration file or shipped name: the calibrated roofline (sim.calibrated)
    n: int | None = None                   # override the trace's parallel samples
    beam_width: int | None = None          # override the trace's beam width
    beam_rank_decay: float = 0.5           # the simulated beam rule's q (sim/executor.py)
    beam_picks: str | None = None          # a measured pick table (`pagesim beams --out`) instead of the rule
    seed: int = 0
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    fast_forward: bool = True
    debug: bool = False

    def __post_init__(self) -> None:
        _check_config(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_config(cfg: SimConfig) -> None:
    if not isinstance(cfg.seed, (int, np.integer)) or not 0 <= cfg.seed < 2**32:
        raise ValueError(f"seed (--seed): must be an integer in [0, 2**32), got {cfg.seed!r}")
    for name in ("slo_ttft", "slo_tpot"):
        value = getattr(cfg, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} (--{name.replace('_', '-')}): must be a finite number of seconds > 0, "
                             f"got {value!r}")
    if cfg.num_gpu_blocks is not None and cfg.num_gpu_blocks < 1:
        raise ValueError(f"num_gpu_blocks (--num-gpu-blocks): must be >= 1 (leave it unset to derive the cache "
                         f"from the hardware), got {cfg.num_gpu_blocks}")
    if cfg.num_cpu_blocks is not None and cfg.num_cpu_blocks < 0:
        raise ValueError(f"num_cpu_blocks (--num-cpu-blocks): must be >= 0, got {cfg.num_cpu_blocks}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization (--gpu-memory-utilization): must be in (0, 1], "
                         f"got {cfg.gpu_memory_utilization}")
    _check_tp(cfg)
    _check_cache_memory(cfg)
    if cfg.replicas > 1 or cfg.disaggregate or cfg.router_options:
        try:
            run_router(cfg)  # an unknown router, a class that is not one, or an unknown option
        except (ValueError, TypeError) as e:
            raise ValueError(f"router (--router): {e}") from None


def _check_tp(cfg: SimConfig) -> None:
    """Tensor parallelism splits the attention heads and the KV heads evenly over the GPUs."""
    if not isinstance(cfg.tp, (int, np.integer)) or cfg.tp < 1:
        raise ValueError(f"tp (--tp): must be an integer >= 1, got {cfg.tp!r}")
    if cfg.tp == 1:
        return
    try:
        model = get_model(cfg.model)
    except (ValueError, OSError):
        return  # an unknown model fails where it is used, listing the known ones
    heads = math.gcd(model.num_heads, model.num_kv_heads)
    if heads % cfg.tp:
        fits = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"tp (--tp): {cfg.tp} does not divide {model.name}'s {model.num_heads} attention heads and "
                         f"{model.num_kv_heads} KV heads evenly; use one of {', '.join(map(str, fits))}")


def _check_cache_memory(cfg: SimConfig) -> None:
    """Every replica's cache (given, or derived from the hardware) and bookkeeping must fit in memory
    (--replicas 100000 with derived caches was killed by the OOM killer, not refused)."""
    replicas = sum(cfg.disaggregate) if cfg.disaggregate else max(cfg.replicas, 1)
    if cfg.num_gpu_blocks is None and cfg.num_cpu_blocks is None and replicas == 1:
        return  # one cache derived from a hardware spec: at most a few million blocks
    gpu, cpu = cfg.num_gpu_blocks, cfg.num_cpu_blocks
    if gpu is None or cpu is None:
        try:
            derived = num_blocks_for(cfg)
        except (ValueError, OSError):
            return  # an unknown model or hardware, or no whole block, fails where it is used, naming it
        gpu, cpu = derived[0] if gpu is None else gpu, derived[1] if cpu is None else cpu
    what = " and ".join(f"{n:,} {kind} blocks ({flag if given is not None else 'derived'})"
                        for n, kind, flag, given in ((gpu, "GPU", "--num-gpu-blocks", cfg.num_gpu_blocks),
                                                     (cpu, "CPU", "--num-cpu-blocks", cfg.num_cpu_blocks)) if n)
    check_fits(f"a KV cache of {what}" + (f" on each of {replicas:,} replicas (--replicas)" if replicas > 1 else ""),
               [(replicas * gpu, GPU_BLOCK_BYTES), (replicas * cpu, CPU_BLOCK_BYTES), (replicas, REPLICA_BYTES)])


@dataclass
class SimResult:
    requests: pd.DataFrame
    iterations: pd.DataFrame
    summary: dict[str, Any]
    config: SimConfig
    extra: dict[str, Any] = field(default_factory=dict)


def requests_from_trace(trace: Trace, max_model_len: int, n: int | None = None,
                        beam_width: int | None = None) -> list[Request]:
    """Trace rows as requests that decode exactly the trace's output length (ignore EOS), one per
    row: a row with a reject reason (trace.reject_reason) becomes a request the scheduler rejects
    on arrival with that reason. max_tokens is what the context leaves after the prompt (what
    Orca-Max reserves). Refuses (ValueError) a trace whose requests could not fit in memory."""
    check_fits(f"{len(trace):,} requests", [(len(trace), REQUEST_BYTES)])
    prompts, outputs = trace.prompt_len.tolist(), trace.output_len.tolist()
    arrivals = trace.arrival.astype(float).tolist()
    ns = [n] * len(trace) if n is not None else trace.n.tolist()
    beams = [beam_width] * len(trace) if beam_width is not None else trace.beam_width.tolist()
    hashes = trace.prefix_hashes
    ids = trace.prompt_token_ids
    hbs = trace.hash_block_size or 16
    reasons = trace.reject_reason or [""] * len(trace)
    classes = request_classes(trace)
    params: dict[tuple[int, int, int], SamplingParams] = {}  # frozen, so equal ones are shared
    reqs = []
    for i, (p, out, arrival, ni, bi) in enumerate(zip(prompts, outputs, arrivals, ns, beams)):
        key = (max(max_model_len - p, out, 1), ni, bi)
        sp = params.get(key)
        if sp is None:
            sp = params[key] = SamplingParams(max_tokens=key[0], ignore_eos=True, n=ni, beam_width=bi)
        reqs.append(Request(i, arrival, p, sp, out, None if ids is None or ids[i] is None else list(ids[i]),
                            None if hashes is None or hashes[i] is None else tuple(hashes[i]), hbs,
                            reject_reason=reasons[i] or None, **classes[i]))
    return reqs


def request_classes(trace: Trace) -> list[dict[str, Any]]:
    """Per trace row, the Request fields of its client / priority / SLO class (empty when absent)."""
    out: list[dict[str, Any]] = [{} for _ in range(len(trace))]
    if trace.client is not None:
        for d, c in zip(out, trace.client):
            d["client"] = c
    if trace.priority is not None:
        for d, p in zip(out, trace.priority.tolist()):
            d["priority"] = p
    for name in ("slo_ttft", "slo_tpot"):
        values = getattr(trace, name)
        if values is not None:
            for d, v in zip(out, values.tolist()):
                d[name] = None if v != v else v  # NaN: the run's SLO
    return out


def build_cost_model(cfg: SimConfig) -> CostModel:
    """The roofline model of cfg.model on cfg.hardware, or the profiled model in cfg.profile (which
    must have been measured on cfg.model, at tensor-parallel degree 1, and needs an explicit
    num_gpu_blocks: a profile does not say how large the measured machine's cache was). With
    cfg.calibration, the roofline is the calibrated one (warns when fitted on other hardware)."""
    kind = cfg.cost_model.strip().lower()
    if cfg.calibration and kind in ("roofline", "calibrated"):
        from sim.calibrated import load_calibration
        return load_calibration(cfg.calibration).cost_model(get_model(cfg.model), get_hardware(cfg.hardware), tp=cfg.tp)
    if kind == "calibrated":
        raise ValueError("cost_model 'calibrated' needs a calibration (a calibration file, or a shipped one's name)")
    if kind == "roofline":
        return RooflineCostModel(get_model(cfg.model), get_hardware(cfg.hardware), tp=cfg.tp)
    if kind != "profiled":
        raise ValueError(f"cost_model: unknown {cfg.cost_model!r}; known: roofline, calibrated, profiled")
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
    return ProfiledCostModel.from_profile(profile, sim_block_size=cfg.block_size)


def run_client_terms(cost_models: Iterable[CostModel]) -> ClientTerms | None:
    """The client terms of a run's cost models (one per kind of hardware), None when they carry none.
    Replicas priced by models with different client terms are refused: one client measures a run."""
    terms = {m.client_terms() for m in cost_models}
    if len(terms) > 1:
        raise ValueError(f"the run's cost models carry different client terms ({sorted(map(str, terms))}); "
                         "one client measures a run")
    return terms.pop() if terms else None


def _spec_name(model: str) -> str:
    try:
        return get_model(model).name
    except ValueError:
        return model


def num_blocks_for(cfg: SimConfig) -> tuple[int, int]:
    """(GPU KV blocks, CPU swap blocks) for the configuration."""
    model, hw = get_model(cfg.model), get_hardware(cfg.hardware)
    gpu = cfg.num_gpu_blocks  # 0 is refused by SimConfig, never replaced by the derived size
    if gpu is None:
        gpu = kv_capacity_blocks(model, hw, block_size=cfg.block_size, tp=cfg.tp,
                                 gpu_memory_utilization=cfg.gpu_memory_utilization)
        if gpu < 1:  # the scheduler's "num_blocks must be >= 1" named no flag
            raise ValueError(f"block_size (--block-size): the KV memory left on {cfg.tp} x {hw.name} after "
                             f"{model.name}'s weights holds no whole block of {cfg.block_size:,} tokens; use a "
                             f"smaller --block-size or give --num-gpu-blocks")
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
    width, sim.executor.BeamPicks) overrides the file named by cfg.beam_picks.

    With cfg.replicas > 1, each replica has its own scheduler, KV cache and executor (on
    cfg.replica_hardware[i] when given, else cfg.hardware), the router spreads arrivals, and the
    tables gain a `replica` column."""
    if cfg.disaggregate:
        from sim.disagg import run_disaggregated
        return run_disaggregated(cfg, trace, cost_model)
    t0 = time.perf_counter()
    if cfg.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {cfg.replicas}")
    model = get_model(cfg.model)
    per_replica = _replica_configs(cfg, cost_model)
    costs: dict[str, CostModel] = {}
    for c in per_replica:  # one cost model per kind of hardware
        if c.hardware not in costs:
            costs[c.hardware] = cost_model or build_cost_model(c)
    blocks = [num_blocks_for(c) for c in per_replica]  # (GPU, CPU) blocks of each replica
    gpu_blocks, cpu_blocks = blocks[0]  # every replica's: summary["router"]["replicas"]
    picks = beam_picks if beam_picks is not None else (load_beam_picks(cfg.beam_picks) if cfg.beam_picks else None)
    router = run_router(cfg) if cfg.replicas > 1 else None
    env = simpy.Environment()
    with gc_paused():
        feed = ArrivalFeed(requests_from_trace(trace, model.max_position, cfg.n, cfg.beam_width))
        bar = _progress_bar(len(feed.requests)) if progress else None
        replicas: list[Replica] = []
        tick = (lambda now, _: _tick(bar, now, sum(len(r.scheduler.done) for r in replicas))) if bar else None
        for i, (rcfg, (gpu_i, cpu_i)) in enumerate(zip(per_replica, blocks)):
            sched = replica_scheduler(cfg, gpu_i, cpu_i, model.max_position)
            # replica 0 keeps the run's seed, so that one replica is exactly the single-engine run
            seed = cfg.seed if i == 0 else np.random.SeedSequence([cfg.seed, i])
            executor = SimulatedExecutor(sched, costs[rcfg.hardware], seed=seed, beam_rank_decay=cfg.beam_rank_decay,
                                         beam_picks=picks)
            replicas.append(Replica(env, sched, executor, cfg.fast_forward, cfg.debug, on_progress=tick,
                                    observer=observer, index=i, routed=router is not None,
                                    counts_only=router is not None and counts_only(router)))
        env.process(arrival_process(env, feed, replicas, router))
        for replica in replicas:
            env.process(engine_process(env, replica, feed))
        env.run()
        if bar is not None:
            bar.close()
        for replica in replicas:
            final_checks(replica.scheduler, replica.scheduler.num_added)
        requests, iterations = _tables(replicas)
        if len(requests) != len(feed.requests):
            raise AssertionError(f"{len(feed.requests)} requests in, {len(requests)} out")
        requests = with_client_latencies(requests, iterations, run_client_terms(costs.values()))
        summary = summarize(requests, iterations, cfg.slo_ttft, cfg.slo_tpot)
    summary["num_gpu_blocks"] = gpu_blocks
    summary["num_cpu_blocks"] = cpu_blocks
    summary["kv_capacity_tokens"] = gpu_blocks * cfg.block_size
    summary["wall_time_s"] = time.perf_counter() - t0
    summary["engine"] = {"stepped_iterations": sum(r.stepped for r in replicas),
                         "skip_windows": sum(r.windows for r in replicas),
                         "skipped_iterations": sum(r.skipped for r in replicas),
                         "preempting_in_windows": sum(r.exhaustions for r in replicas)}
    if router is not None:
        summary["router"] = _router_summary(router, requests, iterations,
                                            [(c.hardware, gpu) for c, (gpu, _) in zip(per_replica, blocks)])
    summary["trace"] = trace.name
    summary["config"] = cfg.to_dict()
    return SimResult(requests, iterations, summary, cfg)


def replica_scheduler(cfg: SimConfig, gpu_blocks: int, cpu_blocks: int, max_model_len: int,
                      prefix_caching: bool | None = None) -> Scheduler:
    """One replica's scheduler under cfg's policy and its options (`prefix_caching` overrides
    cfg.prefix_caching), over a cache of the given size, refusing prompts beyond max_model_len."""
    caching = cfg.prefix_caching if prefix_caching is None else prefix_caching
    kw = scheduler_options(cfg.policy, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.preemption,
                           cfg.chunked_prefill, caching, cpu_blocks)
    sched = make_scheduler(cfg.policy, gpu_blocks, cfg.block_size, policy_options=cfg.policy_options,
                           slo_ttft=cfg.slo_ttft, **kw)
    sched.max_model_len = max_model_len
    return sched


def _replica_configs(cfg: SimConfig, cost_model: CostModel | None) -> list[SimConfig]:
    """Each replica's configuration: cfg, on its own hardware when cfg.replica_hardware says."""
    hw = cfg.replica_hardware
    if not hw:
        return [cfg] * cfg.replicas
    if len(hw) != cfg.replicas:
        raise ValueError(f"replica_hardware names {len(hw)} GPUs for {cfg.replicas} replicas")
    if len(set(hw)) > 1 and (cost_model is not None or cfg.cost_model.strip().lower() != "roofline"):
        raise ValueError("replica_hardware: replicas on different hardware need the roofline cost model (a "
                         "profile, or a given cost model, prices one machine)")
    for name in hw:
        get_hardware(name)  # an unknown name fails here, listing the known ones
    return [dataclasses.replace(cfg, hardware=name) for name in hw]


def run_router(cfg: SimConfig) -> Router:
    """The router a run spreads its arrivals with: cfg.router with cfg.router_options, seeded by the
    run's seed."""
    opts = dict(cfg.router_options)
    opts.setdefault("seed", cfg.seed)
    if cfg.router == PrefixAffinityRouter.name:
        opts.setdefault("block", cfg.block_size)  # token-id prompts are keyed in KV blocks
    return make_router(cfg.router, **opts)


def _tables(replicas: list[Replica]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Request and iteration tables of all replicas (one replica: exactly its own tables)."""
    if len(replicas) == 1:
        return request_frame(replicas[0].scheduler.done), replicas[0].log.frame()
    # each column copied once (the logs' frames are views; assign and concat copied them twice):
    # the iteration tables of a large run are gigabytes
    its = [r.log.frame() for r in replicas]
    columns = {c: np.concatenate([f[c].to_numpy() for f in its]) for c in its[0].columns}
    columns["replica"] = np.repeat(np.array([r.index for r in replicas], dtype=np.int64), [len(f) for f in its])
    iterations = pd.DataFrame(columns, copy=False)
    # one request table over every replica's groups, in request id order (ids are unique)
    pairs = sorted(((g, r.index) for r in replicas for g in r.scheduler.done), key=lambda p: p[0].request.request_id)
    requests = request_frame([g for g, _ in pairs])
    requests["replica"] = np.array([i for _, i in pairs], dtype=np.int64)
    return requests, iterations


def _router_summary(router: Router, requests: pd.DataFrame, iterations: pd.DataFrame,
                    caches: list[tuple[str, int]]) -> dict:
    """Per replica: its hardware and cache, its share of the requests, how busy it was, its latency
    and prefix hits; and how even the spread was (max over mean of requests per replica). `caches`:
    (hardware, GPU blocks) of each replica."""
    end = requests.finish_time.max()  # NaN when nothing finished
    span = max(float(end - requests.arrival.min()), 1e-12) if len(requests) and end == end else 1e-12
    rows = []
    for i, (hardware, gpu_blocks) in enumerate(caches):
        mine = requests[requests.replica == i]
        done = mine[mine.status == "finished"]
        busy = float(iterations.duration[iterations.replica == i].sum())
        rows.append({"replica": i, "hardware": hardware, "num_gpu_blocks": gpu_blocks,
                     "requests": len(mine), "finished": len(done),
                     "busy_fraction": busy / span, "prefix_hit_tokens": int(mine.prefix_hit_tokens.sum()),
                     "preemptions": int(mine.num_preemptions.sum()),
                     "mean_normalized_latency": float(done.normalized_latency.mean()) if len(done) else float("nan")})
    counts = np.array([r["requests"] for r in rows], dtype=float)
    out: dict[str, Any] = {"name": router.name, "replicas": rows,
                           "imbalance": float(counts.max() / counts.mean()) if counts.sum() else float("nan")}
    if hasattr(router, "affinity_hits"):  # the routers that follow a prefix match
        out["affinity_routed"] = router.affinity_hits
    return out


@contextlib.contextmanager
def gc_paused():
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


def final_checks(sched: Scheduler, num_requests: int) -> None:
    """Conservation at the end of every run: all requests accounted for, no block leaked."""
    sched.check_conservation()
    if sched.has_unfinished() or len(sched.done) != num_requests:
        raise AssertionError(f"{num_requests} requests in, {len(sched.done)} out")
    sched.assert_drained()
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
