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

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.cli_args import add_server_args, server_settings
from analysis.measurements import (
    LATENCY_METRICS,
    Experiment,
    StageResult,
    load_measurements,
    simulate_stage,
    stage_config,
)
from analysis.parallel import add_executor_args, executor_options, run_tasks

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
    from sim.run import num_blocks_for

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
    from sim.calibrated import load_calibration
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
    throughput and overload flags."""
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
                         "simulated_s": r.simulated_s, "wall_s": r.wall_s})
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# --- command line --------------------------------------------------------------------------------

def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pagesim.argtypes import out_dir, positive_float, positive_int, seed
    p = subparsers.add_parser(
        "fidelity", help="simulate measured serving runs and report the simulator's error on each",
        description="Simulate every stage of the measured experiments (the vllm-h100 measurements.json format, "
                    "`vllm bench serve --save-result` files, pagesim run folders) and print measured vs predicted "
                    "TTFT mean/p90, E2E mean/p90/p99 and time per output token with the error of each, and the "
                    "median and mean absolute error. Writes fidelity.csv, fidelity.json and fidelity.png to --out.")
    p.add_argument("--measurements", nargs="+", required=True, metavar="FILE",
                   help="measurement files or pagesim run folders")
    p.add_argument("--calibration", help="a calibration file or shipped name (default: the roofline cost model)")
    p.add_argument("--hardware", help=f"GPU spec to simulate on (default: each experiment's own, else "
                                      f"{DEFAULT_HARDWARE})")
    p.add_argument("--models-dir", action="append", metavar="DIR",
                   help="folder of HF config.json files for model ids (repeatable; default ../shared/models beside "
                        "the repository and the working directory)")
    p.add_argument("--max-duration", type=positive_float, metavar="S",
                   help="simulate only each stage's first S seconds of arrivals (default: the whole stage)")
    p.add_argument("--seed", type=seed, default=0)
    add_server_args(p)
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="simulations run at once in worker processes (default 1; the results are the same)")
    add_executor_args(p)
    p.add_argument("--out", type=out_dir, default="runs/fidelity", help="output folder (default runs/fidelity)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.max_duration is not None and not args.max_duration > 0:
        raise ValueError(f"--max-duration must be > 0, got {args.max_duration}")
    t0 = time.perf_counter()
    experiments = load_measurements(args.measurements, args.models_dir, server_settings(args))
    n = sum(len(e.stages) for e in experiments)
    cost = f"calibration {args.calibration}" if args.calibration else "the roofline cost model"
    print(f"{len(experiments)} experiments, {n} stages; simulating with {cost}"
          + (f", first {args.max_duration:g} s of each stage" if args.max_duration else ""))
    unsaid = [e.name for e in experiments if not e.hardware]
    if unsaid and not args.hardware:
        print(f"note: {len(unsaid)} experiments do not say their hardware ({', '.join(unsaid[:3])}"
              f"{', ...' if len(unsaid) > 3 else ''}): simulated on {DEFAULT_HARDWARE} (--hardware to choose)")
    for line in engine_warnings(experiments, args.calibration):
        print(line)
    unfit = unfit_experiments(experiments, args.calibration, args.hardware)
    for name, why in unfit.items():
        print(f"not simulated: {name}: {why}")
    if len(unfit) == len(experiments):
        raise ValueError("no experiment can be simulated as measured (see the lines above)")
    experiments = [e for e in experiments if e.name not in unfit]
    results = fidelity_results(experiments, args.calibration, args.hardware, args.jobs, args.max_duration, args.seed,
                                 **executor_options(args))
    table = results_table(results, experiments)
    summary = fidelity_summary(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "fidelity.csv", index=False)
    wall = time.perf_counter() - t0
    meta = {"measurements": [str(m) for m in args.measurements], "calibration": args.calibration,
            "hardware": args.hardware, "max_duration_s": args.max_duration, "seed": args.seed, "wall_s": wall,
            "not_simulated": unfit}
    (out / "fidelity.json").write_text(json.dumps({**meta, **summary}, indent=1, default=float) + "\n")
    fidelity_figure(table, out / "fidelity.png", f"pagesim fidelity ({cost})")
    print(format_table(table))
    print()
    print(format_summary(summary))
    if unfit:
        print(f"not simulated ({len(unfit)} experiments, in fidelity.json): {', '.join(unfit)}")
    print(f"\n{len(table)} comparisons; wall time {wall:.1f} s; wrote {out}/fidelity.csv, fidelity.json, fidelity.png")
    write_request_runs(experiments, results, out, cost)
    return 0


def write_request_runs(experiments: Sequence[Experiment], results: Sequence[StageResult], out: Path, cost: str) -> None:
    """Per-request runs' comparisons (analysis/request_runs.py): printed, and written under
    out/request_runs/<n>/, their errors into out/request_runs.json."""
    from analysis.request_runs import format_report, stage_reports, write_report
    reports = stage_reports(experiments, results)
    for i, report in enumerate(reports):
        print()
        print(format_report(report))
        paths = write_report(report, out / "request_runs" / str(i), f"{report.name} ({cost})")
        print(f"wrote {', '.join(str(p) for p in paths)}")
    if reports:
        (out / "request_runs.json").write_text(json.dumps([r.summary() for r in reports], indent=1, default=float) + "\n")
