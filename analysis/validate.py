"""The validate step of the calibration loop: a live run and a simulated run of the same trace (the
same request ids) compared metric by metric: relative error of the simulator on mean and P90
TTFT, TPOT, end-to-end and normalized latency, and on throughput, with a terminal table, a summary
and CDF figures. Statistics come from `policies.metrics.summarize`, as in every run's summary."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.benchmark_results import guidellm_requests
from analysis.plots import house_legend, legend_below, save_figure
from analysis.reprofile import ReprofileDecision, check_and_reprofile
from policies.iteration_log import ITERATION_COLUMNS, iteration_compositions
from policies.metrics import summarize
from sim.profiled import ProfiledCostModel, load_profile
from sim.run import run_simulation

LATENCY_METRICS = ("ttft", "tpot", "e2e_latency", "normalized_latency")
LATENCY_STATISTICS = ("mean", "p90")
THROUGHPUT_METRICS = ("request_throughput", "output_token_throughput")
TABLE_COLUMNS = ("metric", "statistic", "live", "sim", "error", "abs_error")

LIVE_COLOR, SIM_COLOR = "#4c72b0", "#dd8452"
CDF_PANELS = (("ttft", "TTFT (s)"), ("tpot", "TPOT (s)"), ("e2e_latency", "end-to-end latency (s)"))

_EMPTY_ITERATIONS = pd.DataFrame({c: pd.Series(dtype=float) for c in ITERATION_COLUMNS})
_COUNT_COLUMNS = ("num_preemptions", "prefix_hit_tokens")  # summarize sums these; not compared here


def _some(ids: Iterable[Any], k: int = 5) -> str:
    """The first k ids, and how many more there are."""
    ids = list(ids)
    shown = ", ".join(str(i) for i in ids[:k])
    return shown + (f", ... (+{len(ids) - k} more)" if len(ids) > k else "")


def _check_same_requests(live: pd.DataFrame, sim: pd.DataFrame) -> None:
    """Raise ValueError unless both tables hold the same request ids, once each, with equal statuses."""
    for name, t in (("live", live), ("sim", sim)):
        dup = t.request_id[t.request_id.duplicated()].unique()
        if len(dup):
            raise ValueError(f"{name} run repeats request ids: {_some(sorted(dup))}")
    live_ids, sim_ids = set(live.request_id), set(sim.request_id)
    only_live, only_sim = sorted(live_ids - sim_ids), sorted(sim_ids - live_ids)
    if only_live or only_sim:
        raise ValueError("live and sim runs hold different requests (not the same trace?): "
                         f"{len(only_live)} only in live [{_some(only_live)}], "
                         f"{len(only_sim)} only in sim [{_some(only_sim)}]")
    joined = live[["request_id", "status"]].merge(sim[["request_id", "status"]], on="request_id",
                                                  suffixes=("_live", "_sim"))
    bad = joined[joined.status_live != joined.status_sim].sort_values("request_id")
    if len(bad):
        described = [f"{r.request_id} ({r.status_live} live, {r.status_sim} sim)" for r in bad.itertuples()]
        raise ValueError(f"{len(bad)} requests differ in status between live and sim: {_some(described)}")


def _summary(requests: pd.DataFrame) -> dict[str, Any]:
    """summarize() of the requests alone (no iterations; the compared numbers do not use them)."""
    missing = {c: 0 for c in _COUNT_COLUMNS if c not in requests.columns}
    return summarize(requests.assign(**missing), _EMPTY_ITERATIONS)


def _relative_error(live: float, sim: float) -> float:
    """(sim - live) / live; NaN when live is 0 or either is NaN."""
    if live == 0 or math.isnan(live) or math.isnan(sim):
        return float("nan")
    return (sim - live) / live


def compare_runs(live_requests: pd.DataFrame, sim_requests: pd.DataFrame) -> pd.DataFrame:
    """One row per (metric, statistic): the live and simulated values and the simulator's signed
    relative error (sim - live) / live, with its absolute value. Latency statistics are over
    finished requests; throughputs (statistic "value") over the span from first arrival to last
    finish, as in `summarize`. Raises ValueError unless the runs hold the same requests with the
    same statuses."""
    _check_same_requests(live_requests, sim_requests)
    live, sim = _summary(live_requests), _summary(sim_requests)
    rows = [(m, s, live[m][s], sim[m][s]) for m in LATENCY_METRICS for s in LATENCY_STATISTICS]
    rows += [(m, "value", float(live[m]), float(sim[m])) for m in THROUGHPUT_METRICS]
    table = pd.DataFrame(rows, columns=list(TABLE_COLUMNS[:4]))
    table["error"] = [_relative_error(a, b) for a, b in zip(table.live, table.sim)]
    table["abs_error"] = table.error.abs()
    return table


def validation_summary(table: pd.DataFrame) -> dict[str, Any]:
    """Headline errors of a compare_runs table, as fractions (0.1 is 10%): the mean absolute
    relative error over rows ("mape"), the largest and its row ("worst"), and the mean absolute
    error per statistic. Rows with NaN error are left out (counted in "num_undefined")."""
    defined = table[table.abs_error.notna()]
    worst = None
    if len(defined):
        row = defined.loc[defined.abs_error.idxmax()]
        worst = {"metric": str(row.metric), "statistic": str(row.statistic), "error": float(row.error)}
    by_stat = defined.groupby("statistic", sort=False).abs_error.mean()
    return {
        "mape": float(defined.abs_error.mean()) if len(defined) else float("nan"),
        "max_abs_error": float(defined.abs_error.max()) if len(defined) else float("nan"),
        "worst": worst,
        "by_statistic": {str(s): float(v) for s, v in by_stat.items()},
        "num_rows": len(table),
        "num_undefined": len(table) - len(defined),
    }


def _number(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.4g}"


def _percent(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:+.1f}%"


def validation_table(table: pd.DataFrame) -> str:
    """A compare_runs table for the terminal: metric, statistic, live, sim, signed error in percent."""
    header = ("metric", "stat", "live", "sim", "error")
    cells = [(str(r.metric), str(r.statistic), _number(r.live), _number(r.sim), _percent(r.error))
             for r in table.itertuples()]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]

    def line(row: tuple[str, ...]) -> str:
        text = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(text)

    lines = [line(header), "  ".join("-" * w for w in widths)]
    lines += [line(c) for c in cells]
    return "\n".join(lines)


def _ecdf(ax: plt.Axes, values: pd.Series, label: str, color: str) -> None:
    x = np.sort(values.dropna().to_numpy(dtype=float))
    if len(x):
        ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label, color=color)


def validation_plot(live_requests: pd.DataFrame, sim_requests: pd.DataFrame, path: str | Path,
                    title: str = "") -> Path:
    """Empirical CDFs of TTFT, TPOT and end-to-end latency over finished requests, live against
    simulated, in three panels; written as PNG to path."""
    live = live_requests[live_requests.status == "finished"]
    sim = sim_requests[sim_requests.status == "finished"]
    fig, axes = plt.subplots(1, len(CDF_PANELS), figsize=(13, 4))
    for ax, (col, label) in zip(axes, CDF_PANELS):
        # one label per side in every panel, so that the figure's one legend names each side once
        _ecdf(ax, live[col], f"live ({len(live)} finished requests)", LIVE_COLOR)
        _ecdf(ax, sim[col], f"simulated ({len(sim)} finished requests)", SIM_COLOR)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.set_size_inches(13, 4.6)
    legend_below(fig, *house_legend(fig), title)  # under the panels: a CDF's tail runs to the lower right
    return save_figure(fig, path, layout=False)


def per_request_errors(live_requests: pd.DataFrame, sim_requests: pd.DataFrame) -> pd.DataFrame:
    """Finished requests joined on request_id: live and simulated TTFT and end-to-end latency, and
    the relative end-to-end error (sim - live) / live (NaN where live is 0). Raises ValueError
    unless the runs hold the same requests with the same statuses."""
    _check_same_requests(live_requests, sim_requests)
    cols = ["request_id", "ttft", "e2e_latency"]
    live = live_requests.loc[live_requests.status == "finished", cols]
    sim = sim_requests.loc[sim_requests.status == "finished", cols]
    out = live.merge(sim, on="request_id", suffixes=("_live", "_sim")).sort_values("request_id")
    out = out.rename(columns={"e2e_latency_live": "e2e_live", "e2e_latency_sim": "e2e_sim"})
    e2e_live = out.e2e_live.where(out.e2e_live != 0)
    out["e2e_error"] = (out.e2e_sim - e2e_live) / e2e_live
    return out[["request_id", "ttft_live", "ttft_sim", "e2e_live", "e2e_sim", "e2e_error"]].reset_index(drop=True)


def step_time_errors(iterations: pd.DataFrame, cost_model: Any, block_size: int = 16) -> dict[str, Any]:
    """The cost model against every measured iteration of a live run: each row's composition priced
    and compared with its measured duration. Mean absolute relative error overall, for pure-decode
    iterations and for iterations carrying prompt tokens, and the mean signed error (bias)."""

    comps = iteration_compositions(iterations, block_size)
    measured = iterations.duration.to_numpy(dtype=float)
    predicted = np.array([cost_model.step_time(c) for c in comps])
    err = (predicted - measured) / measured
    prompt = iterations.prefill_tokens.to_numpy() > 0

    def mean(x: np.ndarray) -> float:
        return float(x.mean()) if len(x) else float("nan")

    return {"iterations": len(err), "mape": mean(np.abs(err)), "bias": mean(err),
            "decode_mape": mean(np.abs(err[~prompt])), "prompt_mape": mean(np.abs(err[prompt])),
            "decode_bias": mean(err[~prompt]), "prompt_bias": mean(err[prompt])}


# ---- the study `pagesim validate` runs ----

# writes a run's folder: (folder, requests, iterations, summary) -> the folder
RunWriter = Callable[[Path, pd.DataFrame, pd.DataFrame, dict], Path]

@dataclass
class Validation:
    """What `run_validation` compared: `table` live against the simulation with the profile used;
    `adjusted` against the simulation with every step scaled by the machine speed measured around
    the live run; `given` against the simulation with the given profile, when a re-profile
    replaced it. `summary` is validation.json."""

    table: pd.DataFrame
    summary: dict[str, Any]
    live_requests: pd.DataFrame
    sim_requests: pd.DataFrame
    adjusted: pd.DataFrame | None = None
    given: pd.DataFrame | None = None
    reprofile: Any = None  # analysis.reprofile.ReprofileDecision
    steps: dict[str, Any] | None = None


def run_validation(trace: Any, cfg: Any, out: str | Path, live: Any = None, live_run: str | None = None,
                   reprofile_threshold: float | None = 0.1, reprofile_reps: int = 2, progress: bool = False,
                   config: dict[str, Any] | None = None, *, write_run: RunWriter) -> Validation:
    """Serve `trace` live (`live`, backend.replay.LiveOptions; or reuse `live_run`: an earlier run
    directory or a guidellm result file whose requests `trace` holds) and simulate it with
    `cfg` (a sim.run.SimConfig naming the profile); write live/, sim/, validation.csv and
    validation.json to `out`. Before a live run the machine's speed is measured against the
    profile and, when more than `reprofile_threshold` away (None: never), the profile is measured
    again here (analysis.reprofile) and the simulation uses it; a reused live run uses the profile
    re-fitted with it, if there was one. `config` goes into the live summary. `write_run` writes
    the live/ and sim/ run folders (the command's pagesim.report_writer.write_run)."""

    out = Path(out)
    first = run_simulation(cfg, trace, progress=progress)  # first: a bad profile fails fast
    given = load_profile(cfg.profile)
    decision = ReprofileDecision(str(cfg.profile), None, reprofile_threshold, given, str(given["source"]))
    drift: dict[str, Any] = {}
    if live_run and Path(live_run).is_file():
        live_requests = guidellm_requests(live_run)[1]
    elif live_run:
        live_requests = pd.read_csv(Path(live_run) / "requests.csv")
        earlier = Path(live_run) / "summary.json"
        if earlier.is_file():  # a live run made by `validate` recorded the machine speed around it
            recorded = json.loads(earlier.read_text())
            if recorded.get("check_before") is not None:
                drift = {"before": recorded["check_before"], "after": recorded["check_after"]}
            decision = _earlier_reprofile(recorded.get("reprofile"), decision)
    else:
        live_requests, drift, decision = _serve(trace, cfg, live, out, decision, reprofile_reps, progress, config,
                                                write_run)
    cfg_used = replace(cfg, profile=decision.path) if decision.adopted else cfg
    sim = run_simulation(cfg_used, trace) if decision.adopted else first
    write_run(out / "sim", sim.requests, sim.iterations, sim.summary)
    table = compare_runs(live_requests, sim.requests)
    table.to_csv(out / "validation.csv", index=False)
    summary = validation_summary(table)
    result = Validation(table, summary, live_requests, sim.requests, reprofile=decision)
    cost = ProfiledCostModel.from_profile(decision.profile, sim_block_size=cfg.block_size)  # as the simulation priced it
    live_dir = Path(live_run) if live_run else out / "live"
    if (live_dir / "iterations.parquet").is_file():
        its = pd.read_parquet(live_dir / "iterations.parquet")
        if "prefill_attn_pairs" in its.columns:  # runs written before the column existed cannot be repriced
            result.steps = summary["step_time"] = step_time_errors(its, cost, cfg.block_size)
    adjusted = None
    if drift.get("before") and drift.get("after"):
        # a sensitivity check: the same simulation with every step scaled by the machine speed
        # measured around the live run (profile grid points re-timed before and after it); it
        # corrects only a drift that holds through the run
        factor = math.sqrt(drift["before"] * drift["after"])
        again = run_simulation(cfg_used, trace, cost_model=cost.scaled(factor))
        result.adjusted = compare_runs(live_requests, again.requests)
        result.adjusted.to_csv(out / "validation_speed_adjusted.csv", index=False)
        adjusted = {"factor": factor, **validation_summary(result.adjusted)}
    given_summary = None
    if decision.adopted:
        result.given = compare_runs(live_requests, first.requests)
        result.given.to_csv(out / "validation_given_profile.csv", index=False)
        given_summary = validation_summary(result.given)
    summary.update(profile=decision.path, given_profile=str(cfg.profile), trace=trace.name, num_requests=len(trace),
                   policy=cfg.policy, machine_speed=drift, speed_adjusted=adjusted, reprofile=decision.record(),
                   given_profile_validation=given_summary)
    (out / "validation.json").write_text(json.dumps(summary, indent=1) + "\n")
    validation_plot(live_requests, sim.requests, out / "validation.png",
                    f"{trace.name}, {len(trace)} requests, {cfg.policy}: live vs simulated ({Path(decision.path).stem})")
    return result


def _serve(trace, cfg, live, out: Path, decision, reps: int, progress: bool, config, write_run: RunWriter):
    """Serve the trace live, measuring the machine's speed against the profile first (and
    re-profiling if it is off): (live requests, speed before and after, the re-profile decision)."""
    # deferred: the backend imports torch
    from backend.profiler import drift as machine_drift
    from backend.replay import serve_trace

    state = {"decision": decision}

    def prepare(runner) -> None:
        d = check_and_reprofile(runner, decision.given, decision.profile, decision.threshold,
                                out / "profile.json", reps=reps, seed=cfg.seed)
        state["decision"] = d
        if d.message():
            print(d.message(), flush=True)

    def check(runner):
        return machine_drift(runner, state["decision"].profile["measurements"])

    req_df, it_df, summary = serve_trace(live, trace, cfg.n, cfg.beam_width, realtime=True, check=check,
                                         prepare=prepare, progress=progress)
    summary.update(trace=trace.name, config=config or {}, reprofile=state["decision"].record())
    write_run(out / "live", req_df, it_df, summary)
    return req_df, {"before": summary["check_before"], "after": summary["check_after"]}, state["decision"]


def _earlier_reprofile(record: dict[str, Any] | None, decision):
    """With a reused live run: the profile re-fitted with it (recorded in its summary), if one was
    adopted and still exists, unless re-profiling is off."""

    if not record or not record.get("adopted") or decision.threshold is None or not Path(record["profile"]).is_file():
        return decision
    return replace(decision, speed=record.get("speed"), profile=load_profile(record["profile"]), path=record["profile"],
                   reprofiled=True, adopted=True, seconds=record.get("seconds") or 0.0, cv_mape=record.get("cv_mape"),
                   given_cv_mape=record.get("given_cv_mape"))
