"""`pagesim fidelity`: every measured stage simulated, predictions set against measurements.

For each stage of each experiment (analysis/measurements.py) the simulator replays the measured
workload under the measured engine's settings, and each of `LATENCY_METRICS` (TTFT mean/p90, E2E
mean/p90/p99, time per output token) is compared: error % = 100 (predicted - measured) / measured.
The summary gives the median and mean absolute error per metric and overall, over all stages and
over the stages the real server carried (an overloaded stage's measured latencies depend on the
client's timeouts and the run's length, so they are shown but summarised apart), and whether
simulation and measurement agree on which stages were overloaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.measurement_files import load_measurements
from analysis.measurements import (
    LATENCY_METRICS,
    Experiment,
    StageResult,
    simulate_stage,
    stage_config,
)
from analysis.parallel import Workers, run_tasks
from analysis.plots import save_figure
from analysis.report import Report
from analysis.request_runs import RequestRunReport, add_request_run, stage_reports
from sim.calibrated import load_calibration
from sim.run import num_blocks_for

DEFAULT_HARDWARE = "h100-sxm"
METRIC_LABELS = {"ttft_mean": "TTFT mean", "ttft_p90": "TTFT p90", "e2e_mean": "E2E mean", "e2e_p90": "E2E p90",
                 "e2e_p99": "E2E p99", "tpot": "time per output token"}


def fidelity_results(experiments: Sequence[Experiment], calibration: str | None = None, hardware: str | None = None,
                     jobs: int = 1, max_duration_s: float | None = None, seed: int = 0,
                     on_result: Callable[[StageResult], None] | None = None, executor: str = "process",
                     address: str | None = None) -> list[StageResult]:
    """Every stage of every experiment simulated (in `jobs` worker processes, or with `executor`
    "ray" on the Ray cluster at `address`; the same results either way), in input order.
    `hardware` overrides each experiment's own (default h100-sxm)."""
    tasks = [(exp, i, hardware or exp.hardware or DEFAULT_HARDWARE, calibration, max_duration_s, seed)
             for exp in experiments for i in range(len(exp.stages))]
    done = None if on_result is None else (lambda _, r: on_result(r))
    return run_tasks(_simulate, tasks, jobs, done, executor, address)


def unfit_experiments(experiments: Sequence[Experiment], calibration: str | None = None,
                      hardware: str | None = None) -> dict[str, str]:
    """Experiment name -> why it cannot be simulated as measured (its model's weights leave no KV
    cache on its GPUs in pagesim's memory model, a block size that leaves no whole block, a
    calibration that cannot be read...), for those that cannot; checked before any simulation."""
    unfit = {}
    for exp in experiments:
        try:
            num_blocks_for(stage_config(exp, exp.stages[0], hardware or exp.hardware or DEFAULT_HARDWARE,
                                        calibration))
        except ValueError as e:
            unfit[exp.name] = str(e)
    return unfit


def engine_warnings(experiments: Sequence[Experiment], calibration: str | None) -> list[str]:
    """A warning line for each experiment whose engine version the calibration was not fitted on
    (both must say theirs: a per-request run's meta.json, a calibration's engine.vllm_version)."""
    if not calibration:
        return []
    cal = load_calibration(calibration)
    fitted = (cal.meta.get("engine") or {}).get("vllm_version") or []
    return [f"warning: calibration {cal.name} was fitted on vLLM {', '.join(fitted)}; {e.name} ran vLLM "
            f"{e.engine_version}: its engine terms may not hold there"
            for e in experiments if fitted and e.engine_version and e.engine_version not in fitted]


def _simulate(exp: Experiment, index: int, hardware: str, calibration: str | None, max_duration_s: float | None,
              seed: int) -> StageResult:
    stage = exp.stages[index]
    cfg = stage_config(exp, stage, hardware, calibration)
    return simulate_stage(exp, stage, cfg, seed=seed, max_duration_s=max_duration_s)


def results_table(results: Sequence[StageResult], experiments: Sequence[Experiment] = ()) -> pd.DataFrame:
    """One row per stage x metric the source measured: measured, predicted, error % and the stage's
    throughput and overload flags, the arrivals simulated and the warm-up requests left out of them
    (analysis.measurements `stage_window`)."""
    models = {e.name: e.model_id for e in experiments}
    rows = []
    for r in results:
        for metric in LATENCY_METRICS:
            measured = r.measured.get(metric)
            if measured is None or not np.isfinite(measured):
                continue
            predicted = r.predicted[metric]
            rows.append({"experiment": r.experiment, "model": models.get(r.experiment, ""), "stage": r.stage,
                         "rate": r.rate, "metric": metric, "measured": measured, "predicted": predicted,
                         "error_pct": 100 * (predicted - measured) / measured if measured else np.nan,
                         "measured_throughput": r.measured_throughput, "predicted_throughput": r.predicted_throughput,
                         "measured_overloaded": r.measured_overloaded, "predicted_overloaded": r.predicted_overloaded,
                         "simulated_s": r.simulated_s, "warm_up_requests": r.warm_up, "wall_s": r.wall_s})
    return pd.DataFrame(rows)


def fidelity_table(experiments: Sequence[Experiment], calibration: str | None = None, **kw: Any) -> pd.DataFrame:
    """`results_table` of `fidelity_results` (keyword arguments as there)."""
    return results_table(fidelity_results(experiments, calibration, **kw), experiments)


def fidelity_summary(table: pd.DataFrame) -> dict[str, Any]:
    """Median and mean absolute error % per metric and overall, over all stages ("all") and over the
    stages the real server carried ("carried"); and overload agreement per stage."""
    carried = table[~table.measured_overloaded.astype(bool)]
    stages = table.drop_duplicates(["experiment", "stage"])
    disagree = stages[stages.measured_overloaded.astype(bool) != stages.predicted_overloaded.astype(bool)]
    return {"all": _errors(table), "carried": _errors(carried),
            "overload": {"stages": len(stages), "agree": len(stages) - len(disagree),
                         "measured_overloaded": int(stages.measured_overloaded.sum()),
                         "predicted_overloaded": int(stages.predicted_overloaded.sum()),
                         "disagree": [f"{r.experiment} stage {r.stage}" for r in disagree.itertuples()]}}


def _errors(t: pd.DataFrame) -> dict[str, Any]:
    def stats(x: pd.Series) -> dict[str, float]:
        a = x.abs().dropna()
        return {"n": len(a), "median_abs_pct": float(a.median()) if len(a) else np.nan,
                "mean_abs_pct": float(a.mean()) if len(a) else np.nan}

    out: dict[str, Any] = {m: stats(t.error_pct[t.metric == m]) for m in LATENCY_METRICS}
    out["overall"] = stats(t.error_pct)
    return out


# --- output --------------------------------------------------------------------------------------

def format_table(table: pd.DataFrame) -> str:
    """The comparison, one line per stage x metric, grouped by stage."""
    lines = [f"{'experiment':<44} {'rate':>5}  {'metric':<22} {'measured':>11} {'predicted':>11} {'error':>8}"]
    for (exp, _stage), g in table.groupby(["experiment", "stage"], sort=False):
        first = g.iloc[0]
        flags = f"overloaded: measured {_yes(first.measured_overloaded)}, predicted {_yes(first.predicted_overloaded)}"
        lines.append(f"{exp[-44:]:<44} {first.rate:>5g}  {flags}")
        for r in g.itertuples():
            lines.append(f"{'':<44} {'':>5}  {METRIC_LABELS[r.metric]:<22} {_value(r.measured):>11} "
                         f"{_value(r.predicted):>11} {r.error_pct:>+7.1f}%")
    return "\n".join(lines)


def _yes(flag: Any) -> str:
    return "yes" if bool(flag) else "no"


def _value(v: float) -> str:
    """Seconds, in ms below one second."""
    if not np.isfinite(v):
        return "-"
    return f"{v * 1e3:.2f} ms" if abs(v) < 1 else f"{v:.3f} s"


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"{'absolute error %':<24} {'median':>8} {'mean':>8} {'n':>4}   {'(carried stages:)':>18} {'median':>8} "
             f"{'mean':>8} {'n':>4}"]
    for key in (*LATENCY_METRICS, "overall"):
        a, c = summary["all"][key], summary["carried"][key]
        label = METRIC_LABELS.get(key, key)
        lines.append(f"{label:<24} {a['median_abs_pct']:>8.1f} {a['mean_abs_pct']:>8.1f} {a['n']:>4}   {'':>18} "
                     f"{c['median_abs_pct']:>8.1f} {c['mean_abs_pct']:>8.1f} {c['n']:>4}")
    o = summary["overload"]
    lines.append(f"overload: {o['agree']} of {o['stages']} stages agree (measured overloaded {o['measured_overloaded']}, "
                 f"predicted {o['predicted_overloaded']})" + (f"; disagree: {', '.join(o['disagree'])}"
                                                                 if o["disagree"] else ""))
    return "\n".join(lines)


def fidelity_figure(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """Predicted against measured on log axes, one colour per metric (hollow: stages the real
    server could not carry), the y = x line and a +-10% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    data = table[(table.measured > 0) & (table.predicted > 0)].assign(
        metric=lambda t: t.metric.map(METRIC_LABELS),
        stage_kind=lambda t: np.where(t.measured_overloaded, "overloaded (measured)", "carried"))
    fig, ax = plt.subplots(figsize=(8.5, 6))
    if len(data):
        lo = float(min(data.measured.min(), data.predicted.min())) / 1.5
        hi = float(max(data.measured.max(), data.predicted.max())) * 1.5
        xs = np.geomspace(lo, hi, 50)
        ax.fill_between(xs, xs * 0.9, xs * 1.1, color="0.85", label="±10%")
        ax.plot(xs, xs, color="0.3", lw=1, label="y = x")
        sns.scatterplot(data=data, x="measured", y="predicted", hue="metric", style="stage_kind", s=45, ax=ax,
                        markers={"carried": "o", "overloaded (measured)": "X"})
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (s)")
    ax.set_ylabel("predicted (s)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    return save_figure(fig, path)


# ---- the study `pagesim fidelity` runs ----

@dataclass
class FidelityStudy:
    """A fidelity study's configuration: the measurement files (or pagesim run folders) and where
    their models' configs are, the calibration (None: the roofline cost model), the GPU to simulate
    on (None: each experiment's own), the seconds of each stage simulated (None: all), the seed,
    where the runs go, and the server settings `vllm bench serve` results do not record
    (analysis/bench_settings.py; None: each file's own or its sidecar's)."""

    measurements: list[str]
    models_dirs: list[str] | None = None
    calibration: str | None = None
    hardware: str | None = None
    max_duration: float | None = None
    seed: int = 0
    workers: Workers = field(default_factory=Workers)
    server: dict[str, Any] | None = None

    @property
    def cost(self) -> str:
        # a calibration file by its name, not its path (the headers' and figures' titles)
        return f"calibration {Path(self.calibration).stem}" if self.calibration else "the roofline cost model"


@dataclass
class FidelityPlan:
    """The experiments read, those that cannot be simulated as measured (name -> why), and warnings
    about the calibration (`engine_warnings`)."""

    study: FidelityStudy
    experiments: list[Experiment]
    unfit: dict[str, str]
    warnings: list[str] = field(default_factory=list)

    def intro(self) -> Report:
        """What will be simulated, and what will not and why."""
        study, experiments = self.study, self.experiments
        report = Report()
        report.say(f"{len(experiments)} experiments, {sum(len(e.stages) for e in experiments)} stages; simulating "
                   f"with {study.cost}" + (f", {study.max_duration:g} s of each stage (after a warm-up prompt cycle, left out, where the "
                      "stage cycles its prompts)" if study.max_duration else ""))
        unsaid = [e.name for e in experiments if not e.hardware]
        if unsaid and not study.hardware:
            report.say(f"note: {len(unsaid)} experiments do not say their hardware ({', '.join(unsaid[:3])}"
                       f"{', ...' if len(unsaid) > 3 else ''}): simulated on {DEFAULT_HARDWARE} (--hardware to choose)")
        report.say(*self.warnings)
        report.say(*(f"not simulated: {name}: {why}" for name, why in self.unfit.items()))
        return report

    def fit(self) -> list[Experiment]:
        """The experiments to simulate; raises when there are none."""
        if len(self.unfit) == len(self.experiments):
            raise ValueError("no experiment can be simulated as measured (see the lines above)")
        return [e for e in self.experiments if e.name not in self.unfit]


def plan_fidelity(study: FidelityStudy) -> FidelityPlan:
    """Read the measurements and check which experiments can be simulated, before any simulation."""
    if study.max_duration is not None and not study.max_duration > 0:
        raise ValueError(f"--max-duration must be > 0, got {study.max_duration}")
    experiments = load_measurements(study.measurements, study.models_dirs, study.server)
    return FidelityPlan(study, experiments, unfit_experiments(experiments, study.calibration, study.hardware),
                        engine_warnings(experiments, study.calibration))


@dataclass
class FidelityOutcome:
    """A fidelity study's results: one row per (stage, metric), and the per-request runs' comparisons
    (analysis/request_runs.py), in order."""

    table: pd.DataFrame
    request_runs: list[RequestRunReport]


def run_fidelity(plan: FidelityPlan) -> FidelityOutcome:
    """Every stage of every experiment that can be simulated."""
    study, experiments = plan.study, plan.fit()
    results = fidelity_results(experiments, study.calibration, study.hardware, max_duration_s=study.max_duration,
                               seed=study.seed, **study.workers.options())
    return FidelityOutcome(results_table(results, experiments), stage_reports(experiments, results))


def fidelity_report(plan: FidelityPlan, outcome: FidelityOutcome, wall_s: float) -> Report:
    """fidelity.csv, fidelity.json (the summary and the study's settings), fidelity.png, the table
    and the summary; each per-request run's comparison under request_runs/<n>/, their errors in
    request_runs.json."""
    study, unfit, table = plan.study, plan.unfit, outcome.table
    summary = fidelity_summary(table)
    meta = {"measurements": [str(m) for m in study.measurements], "calibration": study.calibration,
            "hardware": study.hardware, "max_duration_s": study.max_duration, "seed": study.seed, "wall_s": wall_s,
            "not_simulated": unfit}
    report = Report()
    report.table("fidelity.csv", table)
    report.json("fidelity.json", {**meta, **summary}, default=float)
    report.figure("fidelity.png", lambda path: fidelity_figure(table, path, f"pagesim fidelity ({study.cost})"))
    report.say(format_table(table), "", format_summary(summary))
    if unfit:
        report.say(f"not simulated ({len(unfit)} experiments, in fidelity.json): {', '.join(unfit)}")
    report.wrote("fidelity.csv", "fidelity.json", "fidelity.png",
                 before=f"\n{len(table)} comparisons; wall time {wall_s:.1f} s; ")
    for i, run in enumerate(outcome.request_runs):
        add_request_run(report, run, f"request_runs/{i}", f"{run.name} ({study.cost})")
    if outcome.request_runs:
        report.json("request_runs.json", [r.summary() for r in outcome.request_runs], default=float)
    return report
