"""Measured serving runs, and the same runs simulated: what fidelity checks and calibration fit.

An `Experiment` is one engine configuration serving one workload at one or more load `Stage`s, with
what a client measured at each (TTFT, end-to-end latency, throughput). `load_measurements` reads
the formats in `analysis/measurement_formats.py` (the vllm-h100 measurements.json, `vllm bench
serve` result files, pagesim run folders). `stage_workload` rebuilds a stage's requests,
`stage_config` the engine's settings as a `SimConfig`, and `simulate_stage` simulates the stage
and returns measured and predicted metrics side by side, over the window `stage_window` gives (one
warm-up rule for fidelity, calibrate and --max-duration windows: a whole stage as measured; a
window of a stage that cycles its prompts after one cycle simulated and left out).

Conventions, the same for measured and predicted figures:
- latencies are in seconds, percentiles over finished (successful) requests;
- time per output token = (mean E2E - mean TTFT) / (output_len - 1): a client's own per-request
  TPOT counts streamed chunks, not tokens (see ../shared/calibration/README.md);
- a stage is overloaded when requests finish at less than `OVERLOAD_FRACTION` of the rate they
  arrive (measured: the run's throughput against the offered rate; simulated: completions against
  arrivals over the steady second half of the arrival window, see `steady_state`, so that neither
  the warm-up nor the drain after the last arrival counts), or when its mean TTFT exceeds
  `QUEUED_TTFT_S` (a queue built up that completions alone may not show over a finite run). One
  rule, `is_overloaded`, for measured and simulated stages alike (fidelity and calibrate).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from policies.client_latency import ClientTerms, client_ttft_e2e, sent_pair
from sim.cost_model import CostModel
from sim.run import SimConfig, build_cost_model, run_simulation
from sim.specs import get_hardware
from traces import apply_arrivals
from traces.synthetic import grouped_prefix
from traces.trace import Trace

LATENCY_METRICS = ("ttft_mean", "ttft_p90", "e2e_mean", "e2e_p90", "e2e_p99", "tpot")
# what a per-request run measures beyond a stage summary (analysis/request_runs.py): the low-load and
# middle TTFT, the per-request time per output token, and the engine's mean running and waiting
# requests over the run's ticks
REQUEST_RUN_METRICS = ("ttft_p10", "ttft_p50", "tpot_p50", "tpot_p90", "running_mean", "waiting_mean")
OVERLOAD_FRACTION = 0.9
QUEUED_TTFT_S = 1.0  # a mean TTFT above this means requests queued: the load was not carried


def is_overloaded(throughput_rps: float | None, rate: float, ttft_mean: float | None) -> bool:
    """The one overload rule (module docstring): completions under OVERLOAD_FRACTION of the offered
    rate, or a mean TTFT above QUEUED_TTFT_S. Unknown figures (None, NaN) say nothing."""
    slow = throughput_rps is not None and throughput_rps < OVERLOAD_FRACTION * rate
    queued = ttft_mean is not None and ttft_mean > QUEUED_TTFT_S
    return bool(slow or queued)
LOAD_TYPES = ("constant", "poisson", "gamma")
NO_CLIENT_TERMS = ClientTerms()


@dataclass(frozen=True)
class Latency:
    """One latency's summary over a stage's successful requests, seconds (None: not reported)."""

    mean: float
    p90: float | None = None
    p99: float | None = None


@dataclass(frozen=True)
class SharedPrefix:
    """inference-perf's shared_prefix data: G groups x P prompts, each a group system prompt of S
    tokens followed by its own question of Q tokens; every request generates output_len tokens."""

    num_groups: int
    prompts_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int


@dataclass(frozen=True)
class Stage:
    """One load level: arrivals at `rate` for `duration_s` seconds, and what was measured.

    `load_type` constant (evenly spaced), poisson, or gamma (inter-arrival CV `burstiness`).
    `requests`, when the source recorded them, are the stage's own requests (lengths; arrival times
    too when it has timestamps), replayed instead of a generated workload.
    """

    index: int
    rate: float
    duration_s: float
    ttft: Latency
    e2e: Latency
    output_len: float                  # tokens generated per successful request (mean)
    load_type: str = "constant"
    burstiness: float | None = None
    prompt_len_mean: float | None = None  # measured (re-tokenized) prompt length
    throughput_rps: float | None = None   # successful requests per second
    successes: int = 0
    failures: int = 0
    requests: Trace | None = None
    # a per-request run's own measurements (analysis.request_runs.MeasuredRun): per request and over time
    measured_run: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def tpot(self) -> float:
        return time_per_output_token(self.e2e.mean, self.ttft.mean, self.output_len)

    @property
    def overloaded(self) -> bool:
        return is_overloaded(self.throughput_rps, self.rate, self.ttft.mean)

    def metrics(self) -> dict[str, float | None]:
        """The measured `LATENCY_METRICS` (None where the source did not report one), and a
        per-request run's `REQUEST_RUN_METRICS`."""
        out = {"ttft_mean": self.ttft.mean, "ttft_p90": self.ttft.p90, "e2e_mean": self.e2e.mean,
               "e2e_p90": self.e2e.p90, "e2e_p99": self.e2e.p99, "tpot": self.tpot}
        return out if self.measured_run is None else {**out, **self.measured_run.metrics()}


@dataclass(frozen=True)
class Experiment:
    """One engine configuration and workload, measured at one or more stages.

    `model` is what `SimConfig.model` takes (a shipped spec's name, or a config file), resolved from
    `model_id` when the file was loaded. Engine limits None mean vLLM's default on the hardware
    (`engine_defaults`). `workload` None: every stage carries its own `requests`.
    """

    name: str
    model_id: str
    model: str
    tp: int
    stages: tuple[Stage, ...]
    workload: SharedPrefix | None = None
    workload_name: str = ""
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int = 16
    prefix_caching: bool = True      # vLLM V1's defaults
    chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None
    policy: str = "vllm"
    preemption: str = "recompute"
    hardware: str | None = None
    overloaded_by_source: bool = False
    source: str = ""
    engine_version: str | None = None  # the serving engine's version, where the source says it (vLLM's)


@dataclass
class StageResult:
    """One stage, measured and simulated: metrics keyed as `LATENCY_METRICS`."""

    experiment: str
    stage: int
    rate: float
    measured: dict[str, float | None]
    predicted: dict[str, float]
    measured_overloaded: bool
    predicted_overloaded: bool
    measured_throughput: float | None
    predicted_throughput: float      # completions per second in the steady window (NaN: none)
    num_requests: int
    simulated_s: float               # the arrival window simulated (shorter when truncated)
    wall_s: float
    # the simulated requests the latencies are over, and the iterations: kept so that client terms
    # can be re-applied without simulating again (`with_client`); not part of equality or printing
    requests: pd.DataFrame | None = dataclasses.field(default=None, repr=False, compare=False)
    iterations: pd.DataFrame | None = dataclasses.field(default=None, repr=False, compare=False)
    backlog_grew: bool = dataclasses.field(default=False, repr=False, compare=False)  # steady_state's verdict
    warm_up: int = 0                 # requests simulated first and left out of the latencies (stage_window)
    finished: FinishedRequests | None = dataclasses.field(default=None, repr=False, compare=False)

    def with_client(self, client: ClientTerms) -> StageResult:
        """The same simulated run seen by another client (ClientTerms): the server's times do not
        depend on the client terms, so nothing is simulated again."""
        if self.requests is None:
            raise ValueError(f"{self.experiment}#{self.stage}: the simulated requests were not kept")
        if self.finished is None:  # the finished rows' arrays, taken once (a fit applies many clients)
            self.finished = FinishedRequests.of(self.requests)
        # the server-side figures (a per-request run's gauges) do not depend on the client
        predicted = {**self.predicted, **predicted_metrics(self.finished, client, self.iterations)}
        return dataclasses.replace(self, predicted=predicted, predicted_overloaded=self.backlog_grew or is_overloaded(
            None, self.rate, predicted["ttft_mean"]))


def time_per_output_token(e2e_mean: float, ttft_mean: float, output_len: float) -> float:
    """(mean E2E - mean TTFT) / (output_len - 1); NaN for single-token outputs."""
    return (e2e_mean - ttft_mean) / (output_len - 1) if output_len > 1 else math.nan


# --- a stage rebuilt for the simulator -------------------------------------------------------------

def stage_workload(exp: Experiment, stage: Stage, seed: int = 0, max_duration_s: float | None = None) -> Trace:
    """The stage's requests with their arrivals, truncated to the first `max_duration_s` seconds of
    arrivals when given (for speed; default: the whole stage).

    Shared-prefix workloads: the question length is scaled so that the mean prompt length equals
    the measured one (re-tokenized prompts run ~5% above the nominal S + Q). Arrivals: the stage's
    load type at its rate (recorded arrivals are replayed as they were)."""
    duration = stage.duration_s if max_duration_s is None else min(stage.duration_s, max_duration_s)
    recorded = stage.requests
    if recorded is not None and recorded.has_timestamps:
        keep = int(np.searchsorted(recorded.arrival, recorded.arrival[0] + duration, side="right")) if len(
            recorded) else 0
        return recorded.head(keep)
    n = max(1, round(stage.rate * duration))
    if recorded is not None:
        trace = recorded.head(min(n, len(recorded)))
    elif exp.workload is not None:
        trace = _shared_prefix_trace(exp, stage, n, seed)
    else:
        raise ValueError(f"{exp.source}: experiment {exp.name!r} stage {stage.index}: no workload to rebuild")
    return apply_arrivals(trace, rate=stage.rate, burstiness=_burstiness(stage), seed=seed)


def _shared_prefix_trace(exp: Experiment, stage: Stage, n: int, seed: int) -> Trace:
    w = exp.workload
    question = w.question_len
    if stage.prompt_len_mean is not None:  # measured data: honest to match
        question = max(0, round(stage.prompt_len_mean - w.system_prompt_len))
    return grouped_prefix(n, seed=seed, num_groups=w.num_groups, prompts_per_group=w.prompts_per_group,
                          system_prompt_len=w.system_prompt_len, question_len=question,
                          output_len=w.output_len, hash_block_size=exp.block_size)


def _burstiness(stage: Stage) -> float | None:
    """apply_arrivals' burstiness for the stage's load type: 0 constant, None Poisson, CV gamma."""
    if stage.load_type == "constant":
        return 0.0
    if stage.load_type == "poisson":
        return None
    return stage.burstiness


def engine_defaults(hardware: str) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM's API server uses when not told: 8192 and 1024
    on GPUs of at least 70 GiB other than the A100, else 2048 and 256 (vllm EngineArgs)."""
    hw = get_hardware(hardware)
    big = hw.memory_bytes >= 70 * 2**30 and not hw.name.startswith("a100")
    return (8192, 1024) if big else (2048, 256)


def stage_config(exp: Experiment, stage: Stage, hardware: str | None = None, calibration: str | None = None,
                 **overrides: Any) -> SimConfig:
    """The engine of `exp` as a SimConfig on `hardware` (default: the experiment's own): its policy,
    budgets, block size, chunked prefill and prefix caching, tensor parallelism, and the KV cache
    sized from gpu_memory_utilization as sim.run.num_blocks_for does (unless the source recorded the
    cache's size). `calibration` (a file or shipped name) selects the calibrated cost model; without
    it the roofline model prices iterations. `overrides` replace any SimConfig field."""
    hw = hardware or exp.hardware
    if not hw:
        raise ValueError(f"{exp.source}: experiment {exp.name!r} does not say its hardware: give one (--hardware)")
    batched, seqs = engine_defaults(hw)
    cfg = SimConfig(model=exp.model, hardware=hw, tp=exp.tp, policy=exp.policy, block_size=exp.block_size,
                    preemption=exp.preemption, max_num_seqs=exp.max_num_seqs or seqs,
                    max_num_batched_tokens=exp.max_num_batched_tokens or batched,
                    chunked_prefill=exp.chunked_prefill, prefix_caching=exp.prefix_caching,
                    gpu_memory_utilization=exp.gpu_memory_utilization, num_gpu_blocks=exp.num_gpu_blocks)
    if calibration is not None:
        cfg = dataclasses.replace(cfg, cost_model="calibrated", calibration=str(calibration))
    return dataclasses.replace(cfg, **overrides)


# --- simulated next to measured -------------------------------------------------------------------

def client_terms(client: Any) -> ClientTerms:
    """ClientTerms from None (zero), a ClientTerms, a dict (ttft_s, per_output_token_s,
    output_lag_steps), or a cost model (its `client_terms()`; zero when it has none), or an object
    with calibration parameters (client_ttft_s, ...) or a `params` attribute holding them."""
    if client is None:
        return ClientTerms()
    if isinstance(client, ClientTerms):
        return client
    if isinstance(client, dict):
        unknown = set(client) - {"ttft_s", "per_output_token_s", "output_lag_steps"}
        if unknown:
            raise ValueError(f"client: unknown keys {sorted(unknown)}; known: ttft_s, per_output_token_s, "
                             "output_lag_steps")
        return ClientTerms(**{k: float(v) for k, v in client.items()})
    if isinstance(client, CostModel):
        return client.client_terms() or ClientTerms()
    params = getattr(client, "params", client)
    if hasattr(params, "client_ttft_s"):
        return ClientTerms(float(params.client_ttft_s), float(getattr(params, "client_per_output_token_s", 0.0)),
                           float(getattr(params, "client_output_lag_steps", 0.0)))
    raise ValueError(f"client: expected a dict, ClientTerms, a cost model or calibration parameters, "
                     f"got {type(client).__name__}")


@dataclass(frozen=True)
class FinishedRequests:
    """A simulated request table's finished rows as the arrays `predicted_metrics` reads: kept beside
    a StageResult so that client terms can be applied again and again (a calibration's inner fit)
    without pandas. `replica`: each row's replica, None for a one-replica table."""

    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    output_len: np.ndarray
    replica: np.ndarray | None = None

    @classmethod
    def of(cls, requests: pd.DataFrame) -> FinishedRequests:
        done = requests[requests.status == "finished"]
        return cls(done.arrival.to_numpy(np.float64), done.first_token_time.to_numpy(np.float64),
                   done.finish_time.to_numpy(np.float64), done.output_len.to_numpy(np.float64),
                   done.replica.to_numpy() if "replica" in done.columns else None)


def predicted_metrics(requests: pd.DataFrame | FinishedRequests, client: ClientTerms = NO_CLIENT_TERMS,
                      iterations: pd.DataFrame | None = None) -> dict[str, float]:
    """`LATENCY_METRICS` of a simulated requests table (or its `FinishedRequests`), as a client would
    measure them: the client's TTFT add on TTFT and E2E, its per-token add on E2E, and its output lag
    (over `iterations`, the run's iteration table; needed when the lag is not zero) on the first and
    last tokens, by the functions the client columns every run reports use (policies/client_latency.py
    `sent_pair`, `client_ttft_e2e`), on the finished rows: the same figures bit for bit."""
    done = requests if isinstance(requests, FinishedRequests) else FinishedRequests.of(requests)
    if not len(done.arrival):
        return dict.fromkeys(LATENCY_METRICS + REQUEST_RUN_METRICS[:4], math.nan)
    first, last = sent_pair(done.first_token, done.finish, iterations, client.output_lag_steps, done.replica)
    out = done.output_len
    with np.errstate(divide="ignore", invalid="ignore"):
        ttft, e2e = client_ttft_e2e(done.arrival, first, last, out, client)
        tpot = np.where(out > 1, (e2e - ttft) / (out - 1), np.nan)
    tpot = tpot[~np.isnan(tpot)]
    p_ttft, p_e2e = np.percentile(ttft, [10, 50, 90]), np.percentile(e2e, [90, 99])
    p_tpot = np.percentile(tpot, [50, 90]) if len(tpot) else (math.nan, math.nan)
    return {"ttft_mean": float(ttft.mean()), "ttft_p90": float(p_ttft[2]), "e2e_mean": float(e2e.mean()),
            "e2e_p90": float(p_e2e[0]), "e2e_p99": float(p_e2e[1]),
            "tpot": time_per_output_token(float(e2e.mean()), float(ttft.mean()), float(out.mean())),
            "ttft_p10": float(p_ttft[0]), "ttft_p50": float(p_ttft[1]), "tpot_p50": float(p_tpot[0]),
            "tpot_p90": float(p_tpot[1])}


@dataclass(frozen=True)
class SteadyState:
    """Arrivals and completions over the steady part of a simulated stage (see `steady_state`)."""

    window_s: float
    arrived: int
    finished: int

    @property
    def completion_rate(self) -> float:
        return self.finished / self.window_s if self.window_s > 0 else math.nan

    @property
    def overloaded(self) -> bool:
        """Requests finish at under OVERLOAD_FRACTION of the rate they arrive, so the backlog grows
        (one request of slack for the window's edges); an empty window counts as overloaded."""
        return self.window_s <= 0 or self.finished < OVERLOAD_FRACTION * self.arrived - 1


def steady_state(requests: pd.DataFrame) -> SteadyState:
    """The window from the middle of the arrivals (or later, once one typical latency, the median
    E2E of the first half's arrivals, has passed since the first arrival: the backlog has filled) to
    the last arrival; the requests that arrived and finished in it. Window 0: too short to tell."""
    arrival = requests.arrival.to_numpy(np.float64)
    first, last = float(arrival.min()), float(arrival.max())
    mid = 0.5 * (first + last)
    done = requests[requests.status == "finished"]
    early = done.e2e_latency[done.arrival <= mid]
    start = max(mid, first + float(early.median())) if len(early) else mid
    if last <= start:
        return SteadyState(0.0, 0, 0)
    finish = done.finish_time.to_numpy(np.float64)
    return SteadyState(last - start, int(((arrival > start) & (arrival <= last)).sum()),
                       int(((finish > start) & (finish <= last)).sum()))


@dataclass(frozen=True)
class StageWindow:
    """What of a stage one simulation covers: its first `simulated_s` seconds of arrivals (None: all
    of them), of which the first `warm_up` requests are simulated but left out of the latencies.
    Invariant: the simulated arrivals are the start of the stage's own, never beyond its duration."""

    simulated_s: float | None
    warm_up: int = 0


def prompt_cycle(exp: Experiment, stage: Stage) -> int:
    """Requests in one cycle of the prompts a rebuilt stage repeats (a shared-prefix workload's
    groups x prompts per group, `stage_workload`); 0 where the stage does not cycle prompts (its own
    recorded requests are replayed)."""
    if stage.requests is not None or exp.workload is None:
        return 0
    return exp.workload.num_groups * exp.workload.prompts_per_group


def stage_window(exp: Experiment, stage: Stage, max_duration_s: float | None = None) -> StageWindow:
    """The one warm-up rule (fidelity, calibrate, --max-duration windows alike). A whole stage is
    simulated as it was measured, from its first arrival, cold prefix cache included: the measured
    figures include that first prompt cycle (left out, the simulated E2E p99 of the H100 stages falls
    11-17% under the measured one). A window of its first `max_duration_s` seconds stands for the
    whole stage: where the stage cycles its prompts (`prompt_cycle`), one cycle is simulated before
    the window and left out of its latencies, since a short window would otherwise be mostly that cold
    cycle (a 10 s window of codegen reads ~20% high on TTFT), while the measured stage repeats each
    prompt tens of times. A window that, after the cycle, would reach the stage's end is the stage
    as measured, cut at `max_duration_s`."""
    cycle = prompt_cycle(exp, stage)
    if max_duration_s is None or not cycle or max_duration_s + cycle / stage.rate >= stage.duration_s:
        return StageWindow(max_duration_s)
    return StageWindow(max_duration_s + cycle / stage.rate, cycle)


def simulate_stage(exp: Experiment, stage: Stage, cfg: SimConfig, cost_model: CostModel | None = None,
                   seed: int = 0, max_duration_s: float | None = None, client: Any = None) -> StageResult:
    """Simulate the stage under `cfg` (see `stage_config`) and compare with what was measured, over
    the window `stage_window` gives (None: the whole stage; else `max_duration_s` seconds of
    arrivals, counted after a warm-up prompt cycle where the stage cycles its prompts). `cost_model` replaces the one cfg names (built once by a caller
    that simulates many stages); `client` (see `client_terms`) defaults to the cost model's client
    terms when it has them (a calibrated model), else none. Deterministic for a given seed."""
    t0 = time.perf_counter()
    window = stage_window(exp, stage, max_duration_s)
    trace = stage_workload(exp, stage, seed, window.simulated_s)
    cost_model = cost_model or build_cost_model(cfg)
    res = run_simulation(dataclasses.replace(cfg, seed=seed), trace, cost_model)
    return stage_result(exp, stage, trace, res, client_terms(client if client is not None else cost_model), t0,
                        skip=window.warm_up)


def stage_result(exp: Experiment, stage: Stage, trace: Trace, res: Any, client: ClientTerms, t0: float,
                 skip: int = 0) -> StageResult:
    """A simulated run of the stage (`res`, a SimResult of `trace`) set beside the measurement:
    latencies as the client would see them over the requests after the first `skip`, and the one
    overload rule (`is_overloaded`) applied to both sides."""
    steady = steady_state(res.requests)
    requests = res.requests[res.requests.request_id >= skip] if skip else res.requests
    predicted = predicted_metrics(requests, client, res.iterations)
    if stage.measured_run is not None:  # the simulated engine's gauges at the run's ticks
        predicted.update(stage.measured_run.predicted_gauges(res.iterations))
    return StageResult(
        experiment=exp.name, stage=stage.index, rate=stage.rate, measured=stage.metrics(), predicted=predicted,
        measured_overloaded=exp.overloaded_by_source or stage.overloaded,
        predicted_overloaded=steady.overloaded or is_overloaded(None, stage.rate, predicted["ttft_mean"]),
        measured_throughput=stage.throughput_rps, predicted_throughput=steady.completion_rate, num_requests=len(trace),
        simulated_s=float(trace.arrival[-1] - trace.arrival[0]) if len(trace) else 0.0,
        wall_s=time.perf_counter() - t0, requests=requests, iterations=res.iterations, backlog_grew=steady.overloaded,
        warm_up=skip)
