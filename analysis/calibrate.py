"""`pagesim calibrate`: fit the calibrated roofline (sim/calibrated.py) of a hardware x engine pair.

Two steps, each fitting what its data can tell:
1. Operator terms (GEMM efficiency curve, weight streaming, elementwise kernels, all-reduce) from
   per-operator kernel times (--operators, Vidur's profiles: analysis/operator_fit.py). They are
   shape-generic: rows of several models and TP degrees are points of the same curves.
2. Engine terms (`ENGINE_PARAMS`: per-iteration and per-sequence overheads, attention efficiencies,
   the client's TTFT add and output lag) by simulation in the loop: every unsaturated measured stage
   is rebuilt (analysis/measurements.py), simulated over its first `max_duration_s` seconds of
   arrivals, and scipy's least_squares moves the parameters (in log space) to minimise a soft-L1 loss
   of log(predicted / measured) over TTFT mean/p90, E2E mean/p90 and time per output token (and, for
   a per-request run, TTFT p10/p50, per-request time per output token p50/p90 and the mean running and
   waiting requests over its ticks: analysis/request_runs.py).

Stages the measurement marks overloaded, and stages overloaded by the one rule of
analysis/measurements.py `is_overloaded` (completions below the offered rate, or a mean TTFT above
`QUEUED_TTFT_S`: a queue built up), are not fitted; they are simulated at the end and checked to come
out overloaded by that same rule, as `pagesim fidelity` judges them. Errors are reported in sample, and left
out (--leave-one-out model|experiment: refit without each group, predict it).
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from analysis.kernel_profiles import fit_profiles, is_profile_tree
from analysis.measurements import (
    REQUEST_RUN_METRICS,
    Experiment,
    Stage,
    StageResult,
    client_terms,
    simulate_stage,
    stage_config,
)
from analysis.operator_fit import fit_operators
from analysis.plots import save_figure
from analysis.request_runs import is_request_run, run_files
from sim.calibrated import CalibratedCostModel, CalibrationParams
from sim.specs import get_hardware, get_model

ENGINE_PARAMS = ("iteration_overhead_s", "per_seq_s", "attn_mem_eff", "prefill_attn_eff", "client_ttft_s",
                 "client_output_lag_steps", "gemm_m_half", "allreduce_latency_s")
# Two operator terms are refitted end to end, starting from the kernel fits, because the engine's kernels
# are not the profiler's standalone calls: gemm_m_half (how decode GEMMs slow with the batch, inside CUDA
# graphs) and allreduce_latency_s (when a fitted stage runs at tp > 1: a standalone NCCL call, ~30 us, is
# not vLLM's custom all-reduce inside a CUDA graph; with no such stage it is the link's small-message latency
# from the hardware file). weight_mem_eff stays the kernels' own: with one model
# size a fit cannot tell weight streaming from a fixed per-step cost, and trading one for the other does
# not transfer to other sizes (left out, it moved to 0.67 on Llama-2-7B and mispredicted CodeLlama-34B
# by 38%; kept, 16%).
CLIENT_PARAMS = ("client_ttft_s", "client_output_lag_steps", "client_per_output_token_s")  # fitted inside (fit_engine)
FIT_METRICS = ("ttft_mean", "ttft_p90", "e2e_mean", "e2e_p90", "tpot")
_LOG_CLIP = 3.0       # |log(pred / meas)| cap: an overloaded trial point stays a finite residual
_BOUNDS = {  # search ranges (physical limits, not targets)
    "iteration_overhead_s": (1e-5, 0.05), "per_seq_s": (1e-8, 1e-3), "attn_mem_eff": (0.05, 1.0),
    "prefill_attn_eff": (0.05, 1.0), "client_ttft_s": (1e-5, 0.5), "client_per_output_token_s": (1e-8, 0.01),
    "allreduce_latency_s": (1e-7, 1e-3), "weight_mem_eff": (0.3, 1.0),
    "gemm_m_half": (1.0, 2000.0), "client_output_lag_steps": (0.01, 4.0),
}
# where the search starts for a parameter whose prior (0: off) is outside its range
_SEARCH_START = {"client_output_lag_steps": 1.0}


@dataclass(frozen=True)
class StageRef:
    """A measured stage to simulate, and the group it is left out with."""

    exp: Experiment
    stage: Stage
    group: str

    @property
    def label(self) -> str:
        return f"{self.exp.name}#{self.stage.index}"


def split_stages(experiments: Sequence[Experiment], by: str = "model") -> tuple[list[StageRef], list[StageRef]]:
    """(stages to fit, overloaded stages to check); `by` names the leave-one-out group."""
    fit, over = [], []
    for e in experiments:
        for s in e.stages:
            ref = StageRef(e, s, e.model_id if by == "model" else e.name)
            # a per-request run is replayed whole, arrival by arrival: its latencies, queueing included,
            # are what the replay must reproduce, however overloaded the engine was
            queued = (e.overloaded_by_source or s.overloaded) and s.measured_run is None
            (over if queued else fit).append(ref)
    return fit, over


# --- one evaluation: simulate stages under trial parameters ----------------------------------------

def simulate_ref(ref: StageRef, params: CalibrationParams, hardware: str, seed: int,
                 max_duration_s: float | None) -> StageResult:
    """The stage simulated under `params` over `max_duration_s` seconds of arrivals (None: all), as
    `pagesim fidelity` simulates it: analysis.measurements `simulate_stage`, whose one warm-up rule
    (`stage_window`) leaves a shared-prefix stage's first prompt cycle out of the latencies."""
    exp, stage = ref.exp, ref.stage
    cfg = stage_config(exp, stage, hardware)
    model = CalibratedCostModel(get_model(cfg.model), get_hardware(cfg.hardware), params, tp=cfg.tp)
    return simulate_stage(exp, stage, cfg, model, seed=seed, max_duration_s=max_duration_s)


def _simulate_job(job: tuple) -> StageResult:
    return simulate_ref(*job)


def simulate_all(refs: Sequence[StageRef], params: CalibrationParams, hardware: str, seed: int,
                 max_duration_s: float | None, pool: ProcessPoolExecutor | None) -> list[StageResult]:
    jobs = [(r, params, hardware, seed, max_duration_s) for r in refs]
    if pool is None:
        return [_simulate_job(j) for j in jobs]
    return list(pool.map(_simulate_job, jobs))


def fit_metrics() -> tuple[str, ...]:
    """Every metric a fit weighs: FIT_METRICS, and a per-request run's distribution and gauges
    (measurements.REQUEST_RUN_METRICS) where a stage measured them (others are skipped)."""
    return FIT_METRICS + REQUEST_RUN_METRICS


def log_errors(results: Sequence[StageResult], metrics: Sequence[str] | None = None) -> np.ndarray:
    metrics = metrics or fit_metrics()
    out = []
    for r in results:
        for m in metrics:
            meas, pred = r.measured.get(m), r.predicted.get(m)
            if meas is None or not meas > 0:
                continue
            ratio = pred / meas if pred is not None and pred > 0 and math.isfinite(pred) else math.exp(_LOG_CLIP)
            out.append(float(np.clip(math.log(ratio), -_LOG_CLIP, _LOG_CLIP)))
    return np.asarray(out)


def error_table(results: Sequence[StageResult], metrics: Sequence[str] | None = None) -> dict[str, Any]:
    """Median absolute relative error per metric (default `fit_metrics()`), and each stage's errors."""
    metrics = metrics or fit_metrics()
    per: dict[str, list[float]] = {m: [] for m in metrics}
    stages = []
    for r in results:
        row = {"stage": f"{r.experiment}#{r.stage}", "rate": r.rate,
               "predicted_overloaded": r.predicted_overloaded, "measured_overloaded": r.measured_overloaded}
        for m in metrics:
            meas, pred = r.measured.get(m), r.predicted.get(m)
            if meas and pred is not None and math.isfinite(pred):
                err = pred / meas - 1
                per[m].append(abs(err))
                row[m] = {"measured": meas, "predicted": pred, "error": err}
        stages.append(row)
    med = {m: float(np.median(v)) if v else None for m, v in per.items()}
    return {"median_abs_error": med, "stages": stages}


# --- the fit --------------------------------------------------------------------------------------

_F_SCALE = 0.05  # soft-L1 scale of a log error: errors under ~5% weigh quadratically, larger ones linearly
# A term's prior weight: a fitted term a factor e from its prior costs what one fitted metric 1% off costs
# (its residual is PRIOR_WEIGHT x log(term / prior), next to log errors). Weak against the ~50 log errors:
# it decides only where the data cannot (a direction along which they trade terms at no cost).
PRIOR_WEIGHT = 0.01


@dataclass(frozen=True)
class Prior:
    """Where a fit is pulled to when the data are indifferent: log-space residuals
    `weight x log(term / centre)` for every fitted server term (invariant: weight >= 0; 0: no pull).
    The centre is the operator fit's value for an operator term (gemm_m_half, allreduce_latency_s) and
    CalibrationParams' engineering prior for the others: the start `pagesim calibrate` itself fits from."""

    centre: CalibrationParams
    weight: float = PRIOR_WEIGHT

    def __post_init__(self) -> None:
        if not (self.weight >= 0 and math.isfinite(self.weight)):
            raise ValueError(f"prior weight: expected a finite number >= 0, got {self.weight}")


def soft_l1_cost(r: np.ndarray) -> float:
    """scipy least_squares' objective for loss="soft_l1", f_scale=_F_SCALE: 0.5 sum f^2 rho((r/f)^2)."""
    z = (np.asarray(r) / _F_SCALE) ** 2
    return float(0.5 * _F_SCALE ** 2 * np.sum(2.0 * (np.sqrt(1.0 + z) - 1.0)))


def fit_names(refs: Sequence[StageRef], start: CalibrationParams, hardware: str, names: Sequence[str],
              log: Callable[[str], None] | None = None) -> tuple[list[str], CalibrationParams]:
    """(the terms the stages can tell, the start): with no stage at tp > 1 nothing says what the
    engine's all-reduce costs, so it is not fitted and is the link's latency (when the hardware gives one)."""
    names = list(names)
    if any(r.exp.tp > 1 for r in refs):
        return names, start
    names = [n for n in names if n != "allreduce_latency_s"]
    link = get_hardware(hardware).interconnect_latency_s
    if link > 0 and start.allreduce_latency_s != link:  # the engine's all-reduce (custom, in a CUDA graph)
        start = replace(start, allreduce_latency_s=link)  # is the link's latency, not a NCCL call's
        if log is not None:
            log(f"  no stage runs at tp > 1: all-reduce latency {link * 1e6:.3g} us, the link's on {hardware} "
                "(the kernel profiles time a standalone NCCL call)")
    return names, start


class _Problem:
    """The residuals of one fit: clipped log errors of every stage (the client terms fitted inside:
    fit_client) and the prior's pull, at points in log space of the `outer` terms. Simulations of
    several points (a finite-difference Jacobian's columns) go to the pool at once."""

    def __init__(self, refs: Sequence[StageRef], start: CalibrationParams, hardware: str, outer: Sequence[str],
                 inner: Sequence[str], seed: int, max_duration_s: float | None, pool: ProcessPoolExecutor | None,
                 prior: Prior | None, log: Callable[[str], None], diff_step: float,
                 race: tuple[_Race, int] | None = None) -> None:
        self.refs, self.start, self.hardware, self.outer, self.inner = refs, start, hardware, outer, inner
        self.seed, self.max_duration_s, self.pool, self.log, self.diff_step = seed, max_duration_s, pool, log, diff_step
        self.race = race
        self.jacobians = 0  # Jacobians the solver asked for (the k-th at its k-th accepted point; 0: the start)
        self.lo, self.hi, _ = _log_box(outer, start)
        self.centre = None if prior is None or prior.weight == 0 else _log_box(outer, prior.centre)[2]
        self.weight = 0.0 if prior is None else prior.weight
        self.evaluations = 0
        self.best: dict[str, Any] = {"cost": math.inf, "params": start}
        self._seen: dict[bytes, np.ndarray] = {}  # residuals at every point evaluated (the solver asks again)

    def params_at(self, x: np.ndarray) -> CalibrationParams:
        return replace(self.start, **{n: float(v) for n, v in zip(self.outer, np.exp(x), strict=True)})

    def resid_many(self, xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Residuals at each point; every (point, stage) simulation in one batch."""
        t0 = time.perf_counter()
        points = [self.params_at(x) for x in xs]
        jobs = [(r, p, self.hardware, self.seed, self.max_duration_s) for p in points for r in self.refs]
        flat = list(self.pool.map(_simulate_job, jobs)) if self.pool is not None else [_simulate_job(j) for j in jobs]
        out, fitted = [], []
        for i, (x, p) in enumerate(zip(xs, points, strict=True)):
            params, r = fit_client(flat[i * len(self.refs):(i + 1) * len(self.refs)], p, self.inner)
            fitted.append(params)
            full = np.concatenate([r, self._prior(x)])
            cost = soft_l1_cost(full)
            if cost < self.best["cost"]:
                self.best.update(cost=cost, params=params)
            self.evaluations += 1
            out.append(full)
        first = fitted[0]
        self.log(f"  eval {self.evaluations}{f' ({len(xs)} points)' if len(xs) > 1 else ''} "
                 f"({time.perf_counter() - t0:.1f} s): objective {soft_l1_cost(out[0]):.5g} at "
                 + ", ".join(f"{n} {getattr(first, n):.3g}" for n in [*self.outer, *self.inner]))
        return out

    def _prior(self, x: np.ndarray) -> np.ndarray:
        return np.zeros(0) if self.centre is None else self.weight * (x - self.centre)

    def resid(self, x: np.ndarray) -> np.ndarray:
        key = np.asarray(x, dtype=float).tobytes()
        if key not in self._seen:
            (self._seen[key],) = self.resid_many([x])
        return self._seen[key]

    def jac(self, x: np.ndarray) -> np.ndarray:
        """Forward differences as scipy's "2-point" takes them (a step of diff_step x max(1, |x|) in log
        space, away from x's sign, backwards where it would leave the box); the columns simulated together.
        In a race (`_Race`), the objective at the point (an accepted one: scipy asks for the Jacobian at
        its start and after each accepted step) is reported first, and a start left behind stops here."""
        k, self.jacobians = self.jacobians, self.jacobians + 1
        if self.race is not None:
            race, index = self.race
            if not race.report(index, k, soft_l1_cost(self.resid(x))):
                raise _Dropped(k)
        f0 = self.resid(x)
        h = self.diff_step * np.where(x >= 0, 1.0, -1.0) * np.maximum(1.0, np.abs(x))
        h = np.where((x + h > self.hi) | (x + h < self.lo), -h, h)
        xs = [x + np.eye(len(x))[i] * h[i] for i in range(len(x))]
        steps = [xi[i] - x[i] for i, xi in enumerate(xs)]
        cols = self.resid_many(xs)
        for xi, f in zip(xs, cols, strict=True):
            self._seen[np.asarray(xi, dtype=float).tobytes()] = f
        return np.column_stack([(f - f0) / h for f, h in zip(cols, steps, strict=True)])


class _Dropped(Exception):
    """A coarse start stopped by its race (`_Race`) at its k-th accepted point."""

    def __init__(self, step: int) -> None:
        super().__init__(f"dropped at step {step}")
        self.step = step


class _Race:
    """Coarse fits side by side (threads), stopped early where one is clearly behind. At its k-th
    accepted point each start reports its objective and waits for every other start's k-th (or its
    last objective, once it has ended); from k = 1 a start is dropped when its objective is more than
    `factor` times the lowest there and another step that improved it as much as its last one did
    would still leave it above that lowest. The starts left run exactly as they would alone: when the
    start that ends lowest is never dropped, the race ends where the full round would have (a rule of
    thumb, not a bound: a start may still fall faster than it did)."""

    def __init__(self, starts: int, factor: float) -> None:
        self.factor = factor
        self._cond = threading.Condition()
        self._reports: list[dict[int, float]] = [{} for _ in range(starts)]
        self._ended: list[float | None] = [None] * starts

    def report(self, index: int, k: int, cost: float) -> bool:
        """True: go on; False: dropped (recorded as ended at `cost`)."""
        with self._cond:
            self._reports[index][k] = cost
            self._cond.notify_all()
            others = range(len(self._reports))
            self._cond.wait_for(lambda: all(k in self._reports[j] or self._ended[j] is not None for j in others))
            if k == 0:
                return True
            best = min(self._reports[j].get(k, self._ended[j]) for j in others)  # type: ignore[type-var]
            # behind by more than the factor, and one more step improving as much as its last one
            # would still leave it above the lowest now (a start far out can fall 5-10x in a step)
            if cost > self.factor * best and cost * cost / self._reports[index][k - 1] > best:
                self._ended[index] = cost
                self._cond.notify_all()
                return False
            return True

    def ended(self, index: int, cost: float) -> None:
        """The start's fit ended (steps done, converged, or failed) at objective `cost`."""
        with self._cond:
            if self._ended[index] is None:
                self._ended[index] = cost
            self._cond.notify_all()


def fit_engine(refs: Sequence[StageRef], start: CalibrationParams, hardware: str, names: Sequence[str] = ENGINE_PARAMS,
               seed: int = 0, max_duration_s: float | None = 40.0, max_evals: int = 8,
               pool: ProcessPoolExecutor | None = None, log: Callable[[str], None] = print,
               tolerance: float | None = None, outcome: dict[str, Any] | None = None,
               prior: Prior | None = None, race: tuple[_Race, int] | None = None) -> CalibrationParams:
    """The parameters `names` that best explain the stages (least squares on clipped log errors,
    soft-L1 loss, parameters searched in log space within `_BOUNDS`, from `start`); the others stay as
    `start`. With a `prior`, each fitted server term is also pulled to its centre (Prior).

    The client terms (`CLIENT_PARAMS`) do not change what the server does, so they are fitted inside
    each evaluation over the runs just simulated (`fit_client`), and the outer search moves only the
    terms that need a simulation (variable projection: fewer dimensions, and no trade between a
    client constant and a server cost along a flat valley). `outcome` gets the evaluations, steps,
    whether it converged and the objective (soft-L1 cost, prior included) at the end. `race` (the
    race, this start's index): a coarse start of fit_multistart, dropped when left behind (`_Race`)."""
    from scipy.optimize import least_squares
    if not refs:
        raise ValueError("no unsaturated stage to fit the engine terms to")
    names, start = fit_names(refs, start, hardware, names, log)
    inner = [n for n in names if n in CLIENT_PARAMS]
    outer = [n for n in names if n not in CLIENT_PARAMS]
    if not outer:  # client terms only: one simulation
        return fit_client(simulate_all(refs, start, hardware, seed, max_duration_s, pool), start, inner)[0]
    # tolerance: converged once a step moves the (log) parameters by less than that share, or the
    # loss by less than a tenth of it; else the solver stops after max_evals steps wherever it is
    # (and finite differences of 1% rather than 3%: near the optimum a coarse slope stops it short)
    tol = {"xtol": tolerance, "ftol": tolerance / 10, "gtol": 1e-12} if tolerance else {}
    problem = _Problem(refs, start, hardware, outer, inner, seed, max_duration_s, pool, prior, log,
                       diff_step=0.01 if tolerance else 0.03, race=race)
    lo, hi, x0 = _log_box(outer, start)
    try:
        res = least_squares(problem.resid, x0, jac=problem.jac, bounds=(lo, hi), loss="soft_l1", f_scale=_F_SCALE,
                            max_nfev=max_evals, x_scale=1.0, **tol)
    except _Dropped as dropped:
        log(f"  {problem.evaluations} evaluations, {dropped}: objective {problem.best['cost']:.5g} more than "
            f"{race[0].factor:g} x another start's at the same step" if race else f"  {dropped}")
        if outcome is not None:
            outcome.update(evaluations=problem.evaluations, steps=dropped.step, converged=False,
                           message=f"{dropped} (race)", tolerance=tolerance, objective=problem.best["cost"],
                           dropped_at_step=dropped.step)
        return problem.best["params"]
    finally:
        if race is not None:
            race[0].ended(race[1], problem.best["cost"])
    log(f"  {problem.evaluations} evaluations, {res.message}")
    # the solution with its client terms (the residuals' inner fit), or the best point evaluated if the
    # solver ended elsewhere
    problem.resid(res.x)
    end, cost = problem.best["params"], problem.best["cost"]
    if outcome is not None:
        outcome.update(evaluations=problem.evaluations, steps=int(res.nfev), converged=bool(res.status > 0),
                       message=str(res.message), tolerance=tolerance, objective=cost)
    return end


@dataclass(frozen=True)
class MultiStart:
    """A multi-start fit: `starts` points (the given start, then seeded ones spread uniformly within a
    factor `spread` of the prior's centre in log space, Latin-hypercube style, inside `_BOUNDS`), each
    fitted coarsely (`coarse_duration_s` seconds of each stage, at most `coarse_evals` steps, tolerance
    `coarse_tolerance`), side by side in a race (`_Race`: a start whose objective after a step is more
    than `race_factor` times the lowest after the same step, and would stay above it after one more
    step improving as much as its last, stops there; 0: no race); the one with the
    lowest objective is then fitted to convergence.
    Invariants: starts >= 1, spread >= 1, race_factor 0 or >= 1; starts == 1 is the plain fit from the start."""

    starts: int = 4
    spread: float = 3.0
    coarse_duration_s: float = 10.0
    coarse_evals: int = 4
    coarse_tolerance: float = 1e-2
    race_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.starts < 1 or not self.spread >= 1 or self.coarse_evals < 1 or not self.coarse_duration_s > 0 \
                or not (self.race_factor == 0 or self.race_factor >= 1):
            raise ValueError(f"multi-start: starts >= 1, spread >= 1, coarse evals >= 1, a coarse duration > 0 and a "
                             f"race factor of 0 or >= 1 expected, got {self}")


def spread_starts(start: CalibrationParams, centre: CalibrationParams, names: Sequence[str], count: int,
                  spread: float, seed: int) -> list[CalibrationParams]:
    """`start`, then `count - 1` seeded points: each term's log drawn from `count - 1` equal strata of
    [log(centre / spread), log(centre * spread)] (one point per stratum, strata shuffled per term),
    clipped to `_BOUNDS`."""
    rng = np.random.default_rng(seed)
    lo, hi, c = _log_box(names, centre)
    n = count - 1
    out = [start]
    if n == 0:
        return out
    half = math.log(spread)
    u = np.column_stack([(rng.permutation(n) + rng.random(n)) / n for _ in names])  # n x terms in [0, 1)
    for row in u:
        x = np.clip(c - half + 2 * half * row, lo, hi)
        out.append(replace(start, **{k: float(v) for k, v in zip(names, np.exp(x), strict=True)}))
    return out


def fit_multistart(refs: Sequence[StageRef], start: CalibrationParams, hardware: str,
                   names: Sequence[str] = ENGINE_PARAMS, seed: int = 0, max_duration_s: float | None = 40.0,
                   max_evals: int = 8, pool: ProcessPoolExecutor | None = None, log: Callable[[str], None] = print,
                   tolerance: float | None = None, outcome: dict[str, Any] | None = None,
                   prior: Prior | None = None, multi: MultiStart = MultiStart()) -> CalibrationParams:
    """fit_engine from several starts (MultiStart): where the data leave local minima along nearly
    flat directions, the end point no longer depends on the one start given. The coarse fits run
    side by side (threads, each sending its simulations to `pool`), each deterministic on its own.
    `outcome` gets every start, its coarse end and objective, which was chosen, and the refinement's."""
    from concurrent.futures import ThreadPoolExecutor
    names, start = fit_names(refs, start, hardware, names, log)
    outer = [n for n in names if n not in CLIENT_PARAMS]
    centre = prior.centre if prior is not None else start
    starts = spread_starts(start, replace(start, **{n: getattr(centre, n) for n in outer}), outer,
                           multi.starts if outer else 1, multi.spread, seed)
    record: dict[str, Any] = {"starts": [], "spread": multi.spread, "coarse_duration_s": multi.coarse_duration_s,
                              "coarse_evals": multi.coarse_evals, "coarse_tolerance": multi.coarse_tolerance,
                              "race_factor": multi.race_factor, "seed": seed}
    if len(starts) > 1:
        race = _Race(len(starts), multi.race_factor) if multi.race_factor else None

        def coarse(i: int) -> tuple[CalibrationParams, dict[str, Any]]:
            said: dict[str, Any] = {}
            try:
                end = fit_engine(refs, starts[i], hardware, names, seed, multi.coarse_duration_s, multi.coarse_evals,
                                 pool, lambda line: log(f"  start {i}:{line}"), multi.coarse_tolerance, said, prior,
                                 None if race is None else (race, i))
            finally:  # however it ended (an error included), the other starts must not wait for it
                if race is not None:
                    race.ended(i, math.inf)
            return end, said

        log(f"{len(starts)} starts, each fitted on {multi.coarse_duration_s:g} s of every stage, "
            f"at most {multi.coarse_evals} steps" + (f", a start more than {multi.race_factor:g} x the lowest objective "
                                                     "after a step stopped there" if race else ""))
        with ThreadPoolExecutor(len(starts)) as threads:
            ends = list(threads.map(coarse, range(len(starts))))
        for s, (end, said) in zip(starts, ends, strict=True):
            record["starts"].append({"start": {n: getattr(s, n) for n in outer},
                                     "end": {n: getattr(end, n) for n in names}, **said})
        chosen = min(range(len(ends)), key=lambda i: (ends[i][1]["objective"], i))
        record["chosen"] = chosen
        log(f"start {chosen} has the lowest objective ({ends[chosen][1]['objective']:.5g}): refined")
        start = ends[chosen][0]
    refined: dict[str, Any] = {}
    params = fit_engine(refs, start, hardware, names, seed, max_duration_s, max_evals, pool, log, tolerance,
                        refined, prior)
    if outcome is not None:
        outcome.update(refined, multi_start=record,
                       prior={"weight": prior.weight if prior else 0.0,
                              "centre": {n: getattr(centre, n) for n in outer}} if prior else None)
    return params


def fit_client(results: Sequence[StageResult], params: CalibrationParams,
               names: Sequence[str]) -> tuple[CalibrationParams, np.ndarray]:
    """The client terms `names` that best explain simulated `results` (runs kept in them; nothing is
    simulated), and the log errors there: (params with them set, residuals)."""
    from scipy.optimize import least_squares

    def with_client(u: np.ndarray) -> CalibrationParams:
        return replace(params, **{n: float(v) for n, v in zip(names, np.exp(x0 + u), strict=True)})

    def resid(x: np.ndarray) -> np.ndarray:
        client = client_terms(with_client(x))
        return log_errors([r.with_client(client) for r in results])

    if not names:
        return params, log_errors(results)
    lo, hi, x0 = _log_box(names, params)
    res = least_squares(resid, np.zeros(len(names)), bounds=(lo - x0, hi - x0), loss="soft_l1", f_scale=_F_SCALE,
                        diff_step=1e-3, max_nfev=60)
    return with_client(res.x), resid(res.x)


def _log_box(names: Sequence[str], start: CalibrationParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lower, upper, start) in log space; a prior outside its range starts at `_SEARCH_START`."""
    lo = np.log([_BOUNDS[n][0] for n in names])
    hi = np.log([_BOUNDS[n][1] for n in names])
    x0 = [getattr(start, n) if getattr(start, n) >= _BOUNDS[n][0] else _SEARCH_START.get(n, _BOUNDS[n][0])
          for n in names]
    return lo, hi, np.clip(np.log(x0), lo, hi)


def operator_params(directory: str | Path | None, hardware: str) -> tuple[CalibrationParams, dict]:
    """Step 1: the operator terms fitted to kernel times (the defaults when no directory is given)."""
    if directory is None:
        return CalibrationParams(), {"note": "no operator profiles: operator terms are the priors"}
    hw = get_hardware(hardware)
    if is_profile_tree(directory):  # vLLM layer-wise profiles (llmservingsim's profiler/perf/<GPU>)
        params, report = fit_profiles(directory, hw)
        return replace(CalibrationParams(), **params), report
    gpu = hw.name.split("-")[0]
    params, report = fit_operators(directory, hw, gpu)
    return replace(CalibrationParams(), **params), report


def leave_one_out(refs: Sequence[StageRef], start: CalibrationParams, hardware: str, names: Sequence[str],
                  seed: int, max_duration_s: float | None, eval_duration_s: float | None, max_evals: int,
                  pool: ProcessPoolExecutor | None, log: Callable[[str], None], tolerance: float | None = None,
                  prior: Prior | None = None, multi: MultiStart = MultiStart(starts=1)) -> dict[str, Any]:
    """Refit without each group (fit_multistart, as the whole fit); predict the group. Median errors
    over all held-out stages."""
    groups = sorted({r.group for r in refs})
    held: list[StageResult] = []
    per_group = {}
    for g in groups:
        train = [r for r in refs if r.group != g]
        test = [r for r in refs if r.group == g]
        if not train:
            continue
        log(f"leave out {g}: fit on {len(train)} stages, predict {len(test)}")
        params = fit_multistart(train, start, hardware, names, seed, max_duration_s, max_evals, pool, log, tolerance,
                                prior=prior, multi=multi)
        results = simulate_all(test, params, hardware, seed, eval_duration_s, pool)
        held.extend(results)
        per_group[g] = {"params": {n: getattr(params, n) for n in names}, **error_table(results)}
    return {"groups": per_group, "median_abs_error": error_table(held)["median_abs_error"]}


def source_files(paths: Sequence[str | Path]) -> list[Path]:
    """The files measurements were read from: a file itself; a per-request run folder's files
    (analysis/request_runs.py `run_files`); every file directly in another folder (a pagesim run)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if is_request_run(p):
            out += run_files(p)
        elif p.is_dir():
            out += sorted(f for f in p.iterdir() if f.is_file())
        else:
            out.append(p)
    return out


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --- the command -----------------------------------------------------------------------------------


def calibration_plot(in_sample: Sequence[StageResult], left_out: dict | None, path: str | Path,
                     title: str = "") -> Path:
    """Predicted against measured, one panel per metric (log axes): in-sample stages as dots,
    left-out predictions as crosses, the y = x line and +-10% around it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FIT_METRICS), figsize=(3.2 * len(FIT_METRICS), 3.4))
    for ax, m in zip(axes, FIT_METRICS, strict=True):
        pts = [(r.measured.get(m), r.predicted.get(m)) for r in in_sample]
        _scatter(ax, pts, "o", "in sample")
        held = [(row[m]["measured"], row[m]["predicted"]) for g in (left_out or {}).values()
                for row in g["stages"] if m in row]
        _scatter(ax, held, "x", "left out")
        ax.set_title(m, fontsize=9)
        ax.set_xlabel("measured (s)", fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        lims = ax.get_xlim()
        xs = np.geomspace(*lims, 10)
        ax.plot(xs, xs, "k-", lw=0.6)
        ax.fill_between(xs, 0.9 * xs, 1.1 * xs, color="0.85", zorder=0)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("predicted (s)", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, dpi=110)


def _scatter(ax: Any, pts: list, marker: str, label: str) -> None:
    pts = [(a, b) for a, b in pts if a and b and math.isfinite(b)]
    if pts:
        ax.scatter(*zip(*pts, strict=True), marker=marker, s=18, label=label)


def engine_description(experiments: Sequence[Experiment]) -> dict[str, Any]:
    e = experiments[0]
    return {"source": e.source, "policy": e.policy, "block_size": e.block_size, "chunked_prefill": e.chunked_prefill,
            "prefix_caching": e.prefix_caching, "max_num_batched_tokens": e.max_num_batched_tokens,
            "max_num_seqs": e.max_num_seqs, "models": sorted({x.model_id for x in experiments}),
            "tp": sorted({x.tp for x in experiments}),
            **({"vllm_version": versions} if (versions := sorted({x.engine_version for x in experiments
                                                               if x.engine_version})) else {})}
