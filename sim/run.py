"""Wiring for one simulation: a trace, a policy and a cost model in; request and iteration tables
and a summary out."""

from __future__ import annotations

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

from policies.client_latency import CLIENT_ITERATION_COLUMNS, ClientTerms, with_client_latencies
from policies.dp_router import VllmDPRouter
from policies.limits import CPU_BLOCK_BYTES, GPU_BLOCK_BYTES, REPLICA_BYTES, check_fits
from policies.metrics import summarize
from policies.queue_policy import QueuePolicy
from policies.replica_config import ReplicaConfig, build_scheduler
from policies.request_rows import RequestRows, rows_frame
from policies.router import PrefixAffinityRouter, Router, make_router, reads_counts
from policies.scheduler import Scheduler
from policies.trace_requests import requests_from_trace
from sim.cluster import gc_paused, run_replicas, sim_replica
from sim.contract_check import Deciders, check_contract
from sim.cost_model import CostModel, RooflineCostModel
from sim.disagg import run_disaggregated
from sim.dp import run_dp_group
from sim.engine import ArrivalFeed, Replica
from sim.executor import load_beam_picks
from sim.iteration_table import IterationTable
from sim.specs import get_hardware, get_model, kv_capacity_blocks
from traces.trace import Trace


@dataclass
class SimConfig:
    """One simulation's settings. Construction refuses values no run could use (ValueError naming
    the field and the `pagesim` flag that sets it): tp must split the model's attention and KV heads
    evenly; dp >= 1, ep only on an MoE model, and dp > 1 is one server (no --replicas, --disaggregate,
    --replica-hardware or --router-arg with it; its ranks are fed by vLLM's balancer); num_gpu_blocks, when given, is >= 1 (None derives it from the hardware); seeds lie in
    [0, 2**32); SLOs are finite and > 0; a given cache size must fit in this machine's memory."""

    model: str = "opt-13b"
    hardware: str = "a100-40gb"
    tp: int = 1
    policy: str = "vllm"                   # a registry name, package.module:Class, or an entry point
    policy_options: dict[str, Any] = field(default_factory=dict)  # the policy class's keyword options
    replicas: int = 1                      # model replicas serving the trace, each with its own KV cache
    dp: int = 1                            # vLLM data-parallel ranks of one server, each with its own requests and
                                           # KV cache; an MoE model's ranks step in lockstep (sim.dp)
    ep: bool = False                       # expert parallelism: an MoE model's experts spread whole over dp x tp GPUs
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
    debug: bool = False                    # check invariants every iteration, and skip-ahead against stepping (sim.contract_check)

    def __post_init__(self) -> None:
        _check_config(self)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data; dp and ep only when set (a single server's config reads as it did
        before they existed, so its summary is unchanged)."""
        d = dataclasses.asdict(self)
        for name, default in (("dp", 1), ("ep", False)):
            if d[name] == default:
                del d[name]
        return d

    def replica(self, hardware: str | None = None) -> ReplicaConfig:
        """One replica's configuration, on `hardware` (default self.hardware): the policy fields of
        the same names, the cache num_blocks_for derives (or the one given), and the model's
        context as the longest request. The one place a simulated replica's configuration is made."""
        gpu, cpu = num_blocks_for(self, hardware)
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(ReplicaConfig)
                  if f.name in _REPLICA_FIELDS}
        return ReplicaConfig(**shared, num_gpu_blocks=gpu, num_cpu_blocks=cpu,
                             max_model_len=get_model(self.model).max_position)


# the ReplicaConfig fields a SimConfig sets by the same name (its block counts are overrides: None derives them)
_REPLICA_FIELDS = {f.name for f in dataclasses.fields(SimConfig)} - {"num_gpu_blocks", "num_cpu_blocks"}


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
    _check_dp(cfg)
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


def _check_dp(cfg: SimConfig) -> None:
    """Data parallelism (--dp) and expert parallelism (--ep), as vLLM's --data-parallel-size and
    --enable-expert-parallel: one server of dp ranks; experts only where the model has them."""
    if not isinstance(cfg.dp, (int, np.integer)) or isinstance(cfg.dp, bool) or cfg.dp < 1:
        raise ValueError(f"dp (--dp): must be an integer >= 1, got {cfg.dp!r}")
    if not isinstance(cfg.ep, (bool, np.bool_)):
        raise ValueError(f"ep (--ep): must be true or false, got {cfg.ep!r}")
    if cfg.dp > 1:
        for name, flag, given in (("replicas", "--replicas", cfg.replicas > 1),
                                  ("disaggregate", "--disaggregate", bool(cfg.disaggregate)),
                                  ("replica_hardware", "--replica-hardware", bool(cfg.replica_hardware)),
                                  ("router_options", "--router-arg", bool(cfg.router_options))):
            if given:
                raise ValueError(f"dp (--dp): {cfg.dp} ranks of one server are fed by vLLM's own balancer; "
                                 f"{name} ({flag}) does not combine with it")
    if (cfg.ep or cfg.dp > 1) and cfg.cost_model.strip().lower() == "profiled":
        raise ValueError("dp/ep (--dp, --ep): a profile prices one device's iterations; use the roofline or "
                         "a calibration")
    if cfg.ep:
        try:
            model = get_model(cfg.model)
        except (ValueError, OSError):
            return  # an unknown model fails where it is used, listing the known ones
        if not model.is_moe:
            raise ValueError(f"ep (--ep): {model.name} is a dense model; expert parallelism needs a "
                             f"mixture-of-experts model")


def _check_cache_memory(cfg: SimConfig) -> None:
    """Every replica's cache (given, or derived from the hardware) and bookkeeping must fit in memory
    (--replicas 100000 with derived caches was killed by the OOM killer, not refused)."""
    replicas = sum(cfg.disaggregate) if cfg.disaggregate else max(cfg.replicas, cfg.dp, 1)
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
    """A run's tables and summary. The iteration table is built when `iterations` is first read
    (a run leaves it as the logs' pieces: sim.iteration_table), then kept."""

    requests: pd.DataFrame
    _iterations: pd.DataFrame | IterationTable
    summary: dict[str, Any]
    config: SimConfig
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def iterations(self) -> pd.DataFrame:
        if isinstance(self._iterations, IterationTable):
            self._iterations = self._iterations.frame()
        return self._iterations

    def iteration_columns(self, names: Iterable[str]) -> pd.DataFrame:
        """Only the iteration table's columns `names` (in the table's order), without building the
        rest: what a study that reads a few of them needs (a KeyError names a column there is not)."""
        if isinstance(self._iterations, IterationTable):
            return self._iterations.frame(names)
        wanted = set(names)
        if missing := wanted - set(self._iterations.columns):
            raise KeyError(f"the iteration table has no column {sorted(missing)[0]!r}")
        return self._iterations[[c for c in self._iterations.columns if c in wanted]]


def build_cost_model(cfg: SimConfig) -> CostModel:
    """The roofline model of cfg.model on cfg.hardware, or the profiled model in cfg.profile (which
    must have been measured on cfg.model, at tensor-parallel degree 1, and needs an explicit
    num_gpu_blocks: a profile does not say how large the measured machine's cache was). With
    cfg.calibration, the roofline is the calibrated one (warns when fitted on other hardware).
    With cfg.ep the experts are spread whole over dp x tp GPUs; with cfg.dp > 1 on an MoE model the
    model prices one rank of a DP group, its MoE layers by group (sim.dp)."""
    kind = cfg.cost_model.strip().lower()
    ep, dp = expert_layout(cfg)
    if cfg.calibration and kind in ("roofline", "calibrated"):
        from sim.calibrated import load_calibration
        return load_calibration(cfg.calibration).cost_model(get_model(cfg.model), get_hardware(cfg.hardware), tp=cfg.tp,
                                                            ep=ep, dp=dp)
    if kind == "calibrated":
        raise ValueError("cost_model 'calibrated' needs a calibration (a calibration file, or a shipped one's name)")
    if kind == "roofline":
        return RooflineCostModel(get_model(cfg.model), get_hardware(cfg.hardware), tp=cfg.tp, ep=ep, dp=dp)
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


def expert_layout(cfg: SimConfig) -> tuple[int, int]:
    """(EP size, DP ranks sharing the MoE layers) a cost model of cfg takes: (dp x tp with --ep, else
    1; dp for an MoE model, else 1: a dense model's DP ranks are independent replicas)."""
    if cfg.dp == 1 and not cfg.ep:
        return 1, 1
    moe = get_model(cfg.model).is_moe
    return (cfg.dp * cfg.tp if cfg.ep else 1), (cfg.dp if moe else 1)


def is_dp_group(cfg: SimConfig) -> bool:
    """Whether cfg's replicas are the lockstep ranks of a DP group (dp > 1 on an MoE model)."""
    return cfg.dp > 1 and get_model(cfg.model).is_moe


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


def num_blocks_for(cfg: SimConfig, hardware: str | None = None) -> tuple[int, int]:
    """(GPU KV blocks, CPU swap blocks) for the configuration, on `hardware` (default cfg.hardware)."""
    model, hw = get_model(cfg.model), get_hardware(hardware or cfg.hardware)
    gpu = cfg.num_gpu_blocks  # 0 is refused by SimConfig, never replaced by the derived size
    if gpu is None:  # one rank's cache: an MoE model's DP ranks hold 1/dp of the experts each
        gpu = kv_capacity_blocks(model, hw, block_size=cfg.block_size, tp=cfg.tp,
                                 gpu_memory_utilization=cfg.gpu_memory_utilization,
                                 expert_shards=cfg.dp if model.is_moe else 1)
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
    tables gain a `replica` column. With cfg.dp > 1, the replicas are the server's DP ranks, fed by
    vLLM's balancer (policies.dp_router); an MoE model's ranks step in lockstep (sim.dp: the summary's
    `dp` entry, the group's per-rank iterations in `extra["dp_group"]`).

    With cfg.debug (and skip-ahead on), the run is simulated twice, stepping and skipping ahead,
    and a ContractError names the policy or router class and the decision at the first difference
    (sim.contract_check); a read of a running sequence's owed field from outside the scheduler
    raises StaleReadError (policies.exact_reads); disaggregated runs step every iteration, so they
    run once."""
    if cfg.debug and cfg.fast_forward and observer is None and not cfg.disaggregate:
        def run(c: SimConfig) -> SimResult:
            return _simulate(c, trace, cost_model, progress and c.fast_forward, None, beam_picks)
        return check_contract(cfg, run, _deciders(cfg))
    return _simulate(cfg, trace, cost_model, progress, observer, beam_picks)


def _deciders(cfg: SimConfig) -> Deciders:
    """Who decides in the run cfg describes: the policy's (or scheduler's) class and the router's."""
    sched = build_scheduler(cfg.replica())
    policy = getattr(sched, "policy", None)
    router = run_router(cfg) if cfg.replicas > 1 else (VllmDPRouter() if cfg.dp > 1 else None)
    decider = type(policy) if isinstance(policy, QueuePolicy) else type(sched)
    return Deciders(type(policy) if isinstance(policy, QueuePolicy) else None, type(sched).__name__,
                    type(router).__name__ if router else None, router.reads if router else None,
                    _builtin(decider), router is None or _builtin(type(router)))


def _builtin(cls: type) -> bool:
    return cls.__module__.startswith("policies.")


def _simulate(cfg: SimConfig, trace: Trace, cost_model: CostModel | None, progress: bool,
              observer: Callable[[float, float, Scheduler], None] | None, beam_picks: dict | None) -> SimResult:
    """run_simulation's one run."""
    t0 = time.perf_counter()
    if cfg.disaggregate:
        replica = cfg.replica()
        router = run_router(cfg) if cfg.disaggregate[0] > 1 else None
        cost = cost_model or build_cost_model(cfg)
        return SimResult(*run_disaggregated(cfg, trace, replica, cost, router, t0), cfg)
    if cfg.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {cfg.replicas}")
    hardware = _replica_hardware(cfg, cost_model)
    costs: dict[str, CostModel] = {}
    for hw in hardware:  # one cost model per kind of hardware
        if hw not in costs:
            costs[hw] = cost_model or build_cost_model(cfg if hw == cfg.hardware else dataclasses.replace(cfg, hardware=hw))
    configs = {hw: cfg.replica(hw) for hw in costs}
    picks = beam_picks if beam_picks is not None else (load_beam_picks(cfg.beam_picks) if cfg.beam_picks else None)
    router = run_router(cfg) if cfg.replicas > 1 else (VllmDPRouter() if cfg.dp > 1 else None)
    grouped = is_dp_group(cfg)
    group_log = None
    env = simpy.Environment()
    with gc_paused():
        feed = ArrivalFeed(requests_from_trace(trace, configs[hardware[0]].max_model_len, cfg.n, cfg.beam_width))
        bar = _progress_bar(len(feed.requests)) if progress else None
        replicas: list[Replica] = []
        tick = (lambda now, _: _tick(bar, now, _num_done(replicas))) if bar else None
        for i, hw in enumerate(hardware):
            # replica 0 keeps the run's seed, so that one replica is exactly the single-engine run
            seed = cfg.seed if i == 0 else np.random.SeedSequence([cfg.seed, i])
            replicas.append(sim_replica(env, configs[hw], costs[hw], seed, cfg.beam_rank_decay, picks,
                                        routed=router is not None, counts_only=router is not None and reads_counts(router),
                                        fast_forward=cfg.fast_forward and not grouped, debug=cfg.debug,
                                        on_progress=tick, observer=observer, index=i,
                                        rows=RequestRows(_ROWS_CHUNK)))  # finished groups handed over as the run goes
        if grouped:
            group_log = run_dp_group(env, feed, replicas, router, costs[cfg.hardware])
        else:
            run_replicas(env, feed, replicas, router)
        if bar is not None:
            bar.close()
        num_in = len(feed.requests)
        del feed
        requests, table = _tables(replicas)
        if len(requests) != num_in:
            raise AssertionError(f"{num_in} requests in, {len(requests)} out")
        terms = run_client_terms(costs.values())
        if terms is not None:
            requests = with_client_latencies(requests, _columns(table, CLIENT_ITERATION_COLUMNS), terms)
        summary = summarize(requests, table, cfg.slo_ttft, cfg.slo_tpot)  # reads the table's blocks
    first = configs[hardware[0]]  # every replica's: summary["router"]["replicas"]
    summary["num_gpu_blocks"] = first.num_gpu_blocks
    summary["num_cpu_blocks"] = first.num_cpu_blocks
    summary["kv_capacity_tokens"] = first.num_gpu_blocks * cfg.block_size
    summary["wall_time_s"] = time.perf_counter() - t0
    summary["engine"] = {"stepped_iterations": sum(r.stepped for r in replicas),
                         "skip_windows": sum(r.windows for r in replicas),
                         "skipped_iterations": sum(r.skipped for r in replicas),
                         "preempting_in_windows": sum(r.exhaustions for r in replicas)}
    if router is not None:
        summary["router"] = _router_summary(router, requests, _columns(table, _ROUTER_COLUMNS),
                                            [(hw, configs[hw].num_gpu_blocks) for hw in hardware])
    extra: dict[str, Any] = {}
    if cfg.dp > 1 or cfg.ep:
        ep, _ = expert_layout(cfg)
        summary["dp"] = {"ranks": cfg.dp, "expert_parallel_size": ep, "lockstep": grouped,
                         **(group_log.summary() if group_log is not None else {})}
    if group_log is not None:
        extra["dp_group"] = group_log.frame()
    summary["trace"] = trace.name
    summary["config"] = cfg.to_dict()
    return SimResult(requests, table, summary, cfg, extra)


def _replica_hardware(cfg: SimConfig, cost_model: CostModel | None) -> list[str]:
    """Each replica's GPU spec: cfg.replica_hardware when given, else cfg.hardware for all."""
    hw = cfg.replica_hardware
    if not hw:
        return [cfg.hardware] * (cfg.dp if cfg.dp > 1 else cfg.replicas)
    if len(hw) != cfg.replicas:
        raise ValueError(f"replica_hardware names {len(hw)} GPUs for {cfg.replicas} replicas")
    if len(set(hw)) > 1 and (cost_model is not None or cfg.cost_model.strip().lower() != "roofline"):
        raise ValueError("replica_hardware: replicas on different hardware need the roofline cost model (a "
                         "profile, or a given cost model, prices one machine)")
    for name in hw:
        get_hardware(name)  # an unknown name fails here, listing the known ones
    return list(hw)


def run_router(cfg: SimConfig) -> Router:
    """The router a run spreads its arrivals with: cfg.router with cfg.router_options, seeded by the
    run's seed."""
    opts = dict(cfg.router_options)
    opts.setdefault("seed", cfg.seed)
    if cfg.router == PrefixAffinityRouter.name:
        opts.setdefault("block", cfg.block_size)  # token-id prompts are keyed in KV blocks
    return make_router(cfg.router, **opts)


def _tables(replicas: list[Replica]) -> tuple[pd.DataFrame, IterationTable]:
    """Request and iteration tables of all replicas (one replica: exactly its own tables).

    The request table is built first, from the rows each replica kept (its finished groups were
    handed over and let go during the run: sim.engine Replica.hand_over) and those of the groups
    it still holds, which are let go too (a million-request run's request objects are ~0.8 GB
    when all are held to the end). The iteration table takes the logs' pieces and builds a column
    when it is read (sim.iteration_table). One collection of the youngest generation then frees
    what other cycles the run left (a few closures): with the collector paused for the run
    (gc_paused) it holds everything the run made and nothing was promoted; it walks only the
    survivors, after the logs have handed their pieces over so that their lists of numbers are
    gone by then (~10 M instructions on 20,000 requests over 16 replicas, 49 M before either); a
    full collection would also walk the caller's whole heap (a test process or a calibration with
    a thousand short runs paid ~0.1-0.3 s per run for it)."""
    requests = _request_table(replicas)
    iterations = _iteration_table(replicas)
    gc.collect(0)
    return requests, iterations


def _columns(table: IterationTable, names: tuple[str, ...]) -> pd.DataFrame:
    """Those of the iteration columns `names` the table has (one replica's has no `replica`)."""
    return table.frame(set(names) & set(table.names))


def _iteration_table(replicas: list[Replica]) -> IterationTable:
    """The replicas' iteration logs as one table, built as it is read (their logs emptied)."""
    return IterationTable([r.log for r in replicas], [r.index for r in replicas])


def _request_table(replicas: list[Replica]) -> pd.DataFrame:
    """One request table over every replica's finished requests, in request id order (checked
    unique); with more than one replica, a `replica` column says which served each. Each
    replica's rows are those it kept during the run and then those of the groups left in its
    scheduler's `done`, handed over here (and let go: RequestRows.take). The replicas' rows are
    dropped with the table built: they would stay alive beside the iteration table for nothing."""
    stores = []
    for r in replicas:
        rows = r.rows if r.rows is not None else RequestRows()
        rows.take(r.scheduler.release_done())
        stores.append(rows)
        r.rows = None
    served = None
    if len(replicas) > 1:
        served = np.repeat(np.array([r.index for r in replicas], dtype=np.int64), [s.rows for s in stores])
    table = rows_frame(stores, served)  # ordered by one numpy sort of the ids
    ids = table.request_id.to_numpy()
    if len(ids) > 1 and bool((ids[1:] == ids[:-1]).any()):
        raise AssertionError(f"request {int(ids[1:][ids[1:] == ids[:-1]][0])} appears more than once in the run's "
                             "request table")
    return table


# finished groups a replica holds before it hands them over to its rows (sim.engine Replica.hand_over):
# freed during the run, their memory is reused by the groups made after them (callgrind, 20,000 requests
# over 16 replicas: 1,024 costs 35 M instructions less than handing them all over at the end, 256 only 22 M less)
_ROWS_CHUNK = 1024


_ROUTER_COLUMNS = ("replica", "duration")  # what _router_summary reads of the iterations


def _router_summary(router: Router, requests: pd.DataFrame, iterations: pd.DataFrame,
                    caches: list[tuple[str, int]]) -> dict:
    """Per replica: its hardware and cache, its share of the requests, how busy it was, its latency
    and prefix hits; and how even the spread was (max over mean of requests per replica). `caches`:
    (hardware, GPU blocks) of each replica.

    Each table is ordered by replica once (a stable sort: each replica's rows keep the table's
    order) and every replica's figures are read from its slice, summed as pandas sums a masked
    column (`_slice_sum`, `_slice_mean`: the same values in the same order, so the same bits),
    instead of masking every column once per replica."""
    end = requests.finish_time.max()  # NaN when nothing finished
    span = max(float(end - requests.arrival.min()), 1e-12) if len(requests) and end == end else 1e-12
    n = len(caches)
    req = _by_replica(requests.replica.to_numpy(), n)
    its = _by_replica(iterations.replica.to_numpy(), n)
    finished = req.take((requests.status == "finished").to_numpy())
    hits, preempted = req.take(requests.prefix_hit_tokens.to_numpy()), req.take(requests.num_preemptions.to_numpy())
    latency, busy = req.take(requests.normalized_latency.to_numpy()), its.take(iterations.duration.to_numpy())
    rows = []
    for i, (hardware, gpu_blocks) in enumerate(caches):
        mine, ran = req.rows(i), its.rows(i)
        done = latency[mine][finished[mine]]
        rows.append({"replica": i, "hardware": hardware, "num_gpu_blocks": gpu_blocks,
                     "requests": mine.stop - mine.start, "finished": len(done),
                     "busy_fraction": _slice_sum(busy[ran]) / span, "prefix_hit_tokens": int(hits[mine].sum()),
                     "preemptions": int(preempted[mine].sum()),
                     "mean_normalized_latency": _slice_mean(done) if len(done) else float("nan")})
    counts = np.array([r["requests"] for r in rows], dtype=float)
    out: dict[str, Any] = {"name": router.name, "replicas": rows,
                           "imbalance": float(counts.max() / counts.mean()) if counts.sum() else float("nan")}
    if hasattr(router, "affinity_hits"):  # the routers that follow a prefix match
        out["affinity_routed"] = router.affinity_hits
    return out


@dataclass
class _ByReplica:
    """A table's rows grouped by replica: `order` (a stable sort of the replica column) and
    `bounds` (replica i's rows are order[bounds[i]:bounds[i + 1]])."""

    order: np.ndarray | None  # None: the rows are in replica order already
    bounds: np.ndarray

    def take(self, column: np.ndarray) -> np.ndarray:
        return column if self.order is None else column[self.order]

    def rows(self, i: int) -> slice:
        return slice(int(self.bounds[i]), int(self.bounds[i + 1]))


def _by_replica(replica: np.ndarray, n: int) -> _ByReplica:
    if (replica[1:] >= replica[:-1]).all():  # grouped already, as a run's iteration table is
        return _ByReplica(None, np.searchsorted(replica, np.arange(n + 1), side="left"))
    order = np.argsort(replica, kind="stable")
    return _ByReplica(order, np.searchsorted(replica[order], np.arange(n + 1), side="left"))


def _slice_sum(values: np.ndarray) -> float:
    """`Series.sum()` of these float values (NaN skipped as 0), on a fresh copy as pandas sums a
    masked column (numpy's pairwise sum of the same values in the same order)."""
    v = values.copy()
    np.putmask(v, np.isnan(v), 0.0)
    return float(v.sum())


def _slice_mean(values: np.ndarray) -> float:
    """`Series.mean()` of these float values: their sum (NaN as 0) over the count of the others."""
    v = values.copy()
    nan = np.isnan(v)
    np.putmask(v, nan, 0.0)
    count = np.float64(len(v) - int(nan.sum()))
    return float(v.sum() / count) if count > 0 else float("nan")


def _progress_bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a core dependency
        return None
    return tqdm(total=total, unit="req", desc="simulating", mininterval=0.5, leave=False)


def _num_done(replicas: list[Replica]) -> int:
    """Requests the replicas have finished (those still in `done` and those handed over)."""
    return sum(r.scheduler.num_done for r in replicas)


def _tick(bar, now: float, done: int) -> None:
    if done != bar.n:
        bar.update(done - bar.n)
        bar.set_postfix_str(f"t={now:,.1f}s", refresh=False)


def seeds(seed: int) -> np.random.SeedSequence:
    return np.random.SeedSequence(seed)
