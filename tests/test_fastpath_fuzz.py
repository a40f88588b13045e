"""Differential fuzzing: skip-ahead (repeat plans) against stepping one iteration at a time.

Hypothesis draws whole SimConfigs over the space users reach (every registered policy, routers and
1-4 or 16 replicas, prefix caching, chunked prefill with budgets near prompt sizes, tiny caches that force
preemption, recompute / swap with a small CPU space, block sizes, n > 1 and beam search, the
roofline, calibrated and profiled cost models) and traces from the synthetic generators with
Poisson, bursty, constant and simultaneous arrivals. Both runs must give identical request and
iteration tables and summaries; runs on small caches are in debug mode, so every iteration (or
window) also checks the block manager's invariants, and every run ends with the conservation checks
(no block leaked, every request finished or rejected).

Disaggregated runs are not drawn: sim/disagg.py always steps (no fast path to compare). The sim
has no trace-driven aborts (Scheduler.abort is live-only), so none are drawn either.

More examples, outside the suite: `make test-deep` (PAGESIM_FUZZ_EXAMPLES=500 on three values of
PAGESIM_FUZZ_SEED, which picks another stream; tests/fuzz_budget.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from sim.run import SimConfig, SimResult, run_simulation
from sim.specs import get_model
from tests.fuzz_budget import fuzz_examples, fuzz_seed
from traces import resolve_trace
from traces.trace import Trace

EXAMPLES = fuzz_examples(60)
FUZZ_SEED = fuzz_seed()

PAGED = ["vllm", "priority", "sjf", "srpt", "vtc", "edf"]
CONTIGUOUS = ["orca-max", "orca-pow2", "orca-oracle", "static"]
ROUTERS = ["round-robin", "random", "least-loaded", "prefix-affinity", "cache-aware"]
WORKLOADS = ["sharegpt-like", "alpaca-like", "fixed", "shared-prefix", "grouped-prefix", "multi-client"]
# (model, hardware, cost-model fields): roofline, calibrated roofline, measured profile
COSTS: list[tuple[str, str, dict[str, Any]]] = [
    ("opt-13b", "a100-40gb", {}),
    ("llama-3-70b", "h100-sxm", {"tp": 4}),
    ("llama-3.1-8b", "l40s", {}),
    ("llama-7b", "h100-sxm", {"calibration": "vllm-v1-h100"}),
    ("smollm2-135m", "a100-40gb", {"cost_model": "profiled", "profile": "smollm2-135m-cpu"}),
]
_MIXTRAL = Path(__file__).resolve().parents[2] / "shared" / "models" / "mixtral-8x7b-v0.1.json"
if _MIXTRAL.is_file():  # a mixture-of-experts model (its own expert-count cost terms)
    COSTS.append((str(_MIXTRAL), "h200", {"tp": 2}))
# sampled_from lists put the stressful choice first: hypothesis starts from (and shrinks towards)
# the first element, so a short run still preempts
# summary keys that legitimately differ: wall time, how the engine got there, the config itself
VOLATILE = {"wall_time_s", "engine", "config"}


@st.composite
def policy_options(draw: st.DrawFn, policy: str) -> dict[str, Any]:
    if policy in ("sjf", "srpt"):
        opts: dict[str, Any] = {"predictor": draw(st.sampled_from(["oracle", "noisy", "fitted"]))}
        if opts["predictor"] == "noisy":
            opts["seed"] = draw(st.integers(0, 99))
        if draw(st.booleans()):
            opts["aging"] = draw(st.sampled_from([0.5, 5.0]))
        return opts
    if policy == "edf" and draw(st.booleans()):
        return {"slo_ttft": draw(st.sampled_from([0.2, 1.0]))}
    return {}


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    """A small synthetic trace (outputs capped so stepping stays fast) with one arrival shape."""
    name = draw(st.sampled_from(WORKLOADS))
    n = draw(st.integers(12, 30))
    seed = draw(st.integers(0, 2**16))
    rate = draw(st.sampled_from([40.0, 4.0, 400.0, 0.5]))
    shape = draw(st.sampled_from(["poisson", "bursty", "constant", "simultaneous", "ties"]))
    timestamped = name == "multi-client"
    burst = {"bursty": 3.0, "constant": 0.0}.get(shape) if not timestamped else None
    tr = resolve_trace(name, num_requests=n, rate=rate, burstiness=burst, seed=seed)
    cap = draw(st.sampled_from([200, 60, 400, 8]))
    tr = dataclasses.replace(tr, output_len=np.minimum(tr.output_len, cap))
    if shape == "simultaneous":  # every request at one instant
        tr = tr.with_arrivals(np.full(len(tr), float(tr.arrival[0]) if len(tr) else 0.0))
    elif shape == "ties":  # arrivals rounded onto a coarse grid: several share a timestamp
        tr = tr.with_arrivals(np.floor(tr.arrival * rate / 3.0) * 3.0 / rate)
    return tr


@st.composite
def cases(draw: st.DrawFn) -> tuple[SimConfig, Trace]:
    """A trace, then a configuration sized against it: budgets and caches near its prompt sizes,
    so that chunking, head-of-line blocking, preemption and swap happen rather than rejection."""
    tr = draw(traces())
    policy = draw(st.sampled_from(PAGED * 2 + CONTIGUOUS))  # the paged ones have more options
    paged = policy in PAGED
    model, hardware, cost = draw(st.sampled_from(COSTS))
    block_size = draw(st.sampled_from([8, 16, 32]))
    # the contiguous baselines reserve a whole max-length context per request (static pads to it)
    longest = int(tr.prompt_len.max() + tr.output_len.max()) if paged else get_model(model).max_position
    chunked = paged and draw(st.booleans())
    kw: dict[str, Any] = {"policy": policy, "policy_options": draw(policy_options(policy)), "model": model,
                          "hardware": hardware, "block_size": block_size, **cost,
                          "max_num_seqs": draw(st.sampled_from([256, 4, 2, 1])),
                          "max_num_batched_tokens": max(block_size, int(tr.prompt_len.max()) + draw(
                              st.sampled_from([2048, -64, -1, 0, 1, 16] if chunked else [2048, 0, 1, 16]))),
                          "seed": draw(st.integers(0, 2**16))}
    # from one longest request's worth of blocks (preempting) to the hardware's own (None)
    # or a share of what the whole trace holds at once (several requests fit, then outgrow it)
    factor = draw(st.sampled_from(["share", 1.0, 1.2, None, 2.0, 8.0]))
    if factor == "share" and paged:
        total = int((tr.prompt_len + tr.output_len).sum())
        kw["num_gpu_blocks"] = -(-max(longest, int(total * draw(st.sampled_from([0.15, 0.3, 0.6])))) // block_size)
    elif factor is not None or "profile" in cost:
        kw["num_gpu_blocks"] = max(1, int(-(-longest // block_size) * (factor if factor not in (None, "share") else 8.0)))
    if paged:
        kw["prefix_caching"] = draw(st.booleans())
        kw["chunked_prefill"] = chunked
        kw["preemption"] = draw(st.sampled_from(["recompute", "swap"]))
        kw["num_cpu_blocks"] = draw(st.sampled_from([None, 4, 32] if kw["preemption"] == "swap" else [None, 0]))
        width = draw(st.sampled_from([None, None, 2, 3]))
        if width is not None:
            kw[draw(st.sampled_from(["n", "beam_width"]))] = width
    replicas = draw(st.sampled_from([1, 1, 2, 3, 4, 16]))  # 16: many windows running across arrivals
    if replicas > 1:
        kw["replicas"] = replicas
        kw["router"] = draw(st.sampled_from(ROUTERS))
        if not cost and draw(st.booleans()):  # replicas on different GPUs (roofline only)
            kw["replica_hardware"] = tuple(draw(st.sampled_from(["a100-40gb", "h100-sxm"])) for _ in range(replicas))
    if draw(st.booleans()):  # goodput and SLO attainment in the summary
        kw["slo_ttft"], kw["slo_tpot"] = draw(st.sampled_from([(0.5, 0.05), (5.0, 0.2)]))
    # per-iteration invariant checks walk the whole pool: on for the small caches that preempt; a
    # hardware-sized cache gets the end-of-run conservation checks every run makes (final_checks)
    return SimConfig(**kw, debug="num_gpu_blocks" in kw), tr


def _run(cfg: SimConfig, tr: Trace) -> SimResult | str:
    """The run, or the error it stopped with (both paths must stop with the same one)."""
    try:
        return run_simulation(cfg, tr)
    except ValueError as e:
        return f"ValueError: {e}"


def _summary(res: SimResult) -> dict[str, Any]:
    return {k: v for k, v in res.summary.items() if k not in VOLATILE}


def assert_same_runs(cfg: SimConfig, tr: Trace, record: bool = False) -> None:
    """`record`: inside a hypothesis test, count what the space reached. Skip-ahead and stepping agree exactly: every request's times, tokens, preemptions and
    rejection reason; every iteration row; every summary figure."""
    fast = _run(cfg, tr)
    step = _run(dataclasses.replace(cfg, fast_forward=False), tr)
    if isinstance(fast, str) or isinstance(step, str):
        assert fast == step, (fast, step)
        if record:
            event(f"refused: {fast[:70]}")
        return
    pd.testing.assert_frame_equal(fast.requests, step.requests, check_exact=True)
    pd.testing.assert_frame_equal(fast.iterations, step.iterations, check_exact=True)
    pd.testing.assert_series_equal(pd.Series(_summary(fast), dtype=object), pd.Series(_summary(step), dtype=object))
    assert len(fast.requests) == len(tr)  # every request accounted for, finished or rejected
    if record:  # what the space reached (pytest --hypothesis-show-statistics)
        _record(fast)


def _record(fast: SimResult) -> None:
    event(f"skip-ahead windows: {'yes' if fast.summary['engine']['skip_windows'] else 'no'}")
    event(f"preempted: {'yes' if fast.requests.num_preemptions.sum() else 'no'}")
    event(f"rejected: {'yes' if (fast.requests.status == 'rejected').any() else 'no'}")


# seed 0: hypothesis's derandomized stream; another PAGESIM_FUZZ_SEED: a fixed seed of its own
@seed(FUZZ_SEED)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=FUZZ_SEED == 0, database=None, print_blob=True,
          suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_skip_ahead_equals_stepping_over_drawn_configs(case: tuple[SimConfig, Trace]) -> None:
    assert_same_runs(*case, record=True)


def test_the_fuzz_space_reaches_skip_ahead_and_preemption() -> None:
    # guards against a fuzzer that only draws trivially stepped runs: a tiny cache under a burst
    tr = resolve_trace("sharegpt-like", num_requests=20, rate=40.0, seed=3)
    tr = dataclasses.replace(tr, output_len=np.minimum(tr.output_len, 200))
    res = run_simulation(SimConfig(num_gpu_blocks=48, debug=True), tr)
    assert res.summary["engine"]["skipped_iterations"] > 0
    assert int(res.requests.num_preemptions.sum()) > 0
    assert_same_runs(SimConfig(num_gpu_blocks=48, debug=True), tr)


@settings(max_examples=max(EXAMPLES // 3, 10), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(policy=st.sampled_from(["vllm", "priority", "edf", "vtc"]), blocks=st.sampled_from([None, 40]),
       replicas=st.sampled_from([1, 2]), k=st.integers(3, 150), before=st.sampled_from([0.0, 0.7, 1.0]))
def test_arrivals_at_exactly_an_iteration_end(policy: str, blocks: int | None, replicas: int, k: int,
                                              before: float) -> None:
    # random traces almost never put an arrival on an iteration's end to the bit; place some there
    # (the waiting-column disagreement of tests/test_skip_ahead_regressions.py hid here)
    cfg = SimConfig(policy=policy, num_gpu_blocks=blocks, replicas=replicas, max_num_seqs=2, debug=blocks is not None)
    base = Trace(arrival=np.array([0.0, 0.0]), prompt_len=np.array([100, 50]), output_len=np.array([300, 200]))
    starts = run_simulation(dataclasses.replace(cfg, fast_forward=False), base).iterations.start.to_numpy()
    e = float(starts[min(k, len(starts) - 1)])
    p = float(np.nextafter(e, 0.0)) if before == 1.0 else e * before  # the arrival that schedules e's
    tr = Trace(arrival=np.array([0.0, 0.0, p, e, e]), prompt_len=np.array([100, 50, 20, 30, 40]),
               output_len=np.array([300, 200, 5, 40, 60]))
    assert_same_runs(cfg, tr)
