"""Capacity planning: the fewest replicas that serve a trace at a rate within latency SLOs.

A configuration meets the SLOs when at least `attainment` of all requests (rejected ones count as
missing) finish with TTFT <= slo_ttft and TPOT <= slo_tpot, the attainment measure of DistServe and
Vidur's configuration search. The search doubles the replica count until the SLOs are met, then
bisects between the last miss and the first hit; it assumes that adding a replica never hurts
(true of the routers here up to noise) and reports every configuration it simulated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from analysis.parallel import run_tasks
from analysis.plots import Panel, house_legend, legend_below, rate_figure, save_figure, series_colors
from analysis.rate_study import RateStudy
from analysis.report import Report
from analysis.seeds import seeded, seeded_report, seeds_note
from policies.metrics import headline_latency, headline_mean_normalized_latency
from sim.run import SimConfig, run_simulation
from traces import apply_arrivals
from traces.trace import Trace


def meets(summary: dict, attainment: float) -> bool:
    return summary["slo_attainment"] >= attainment


def min_replicas(trace: Trace, base: SimConfig, attainment: float = 0.9, max_replicas: int = 64,
                 on_run: Callable[[dict], None] | None = None) -> tuple[int | None, list[dict]]:
    """(the fewest replicas meeting base's SLOs on the timed `trace`, or None if even
    `max_replicas` do not; one row per simulated replica count)."""
    if base.slo_ttft is None and base.slo_tpot is None:
        raise ValueError("capacity planning needs an SLO: slo_ttft and/or slo_tpot")
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment}")
    if max_replicas < 1:
        raise ValueError(f"max_replicas must be >= 1, got {max_replicas}")
    rows: dict[int, dict] = {}

    def ok(n: int) -> bool:
        if n not in rows:
            s = run_simulation(dataclasses.replace(base, replicas=n), trace).summary
            rows[n] = {"replicas": n, "slo_attainment": s["slo_attainment"], "meets": meets(s, attainment),
                       "ttft_p90": headline_latency(s, "ttft")["p90"], "tpot_p90": headline_latency(s, "tpot")["p90"],
                       "mean_normalized_latency": headline_mean_normalized_latency(s),
                       "prefix_hit_tokens": s["prefix_hit_tokens"], "wall_s": s["wall_time_s"]}
            if on_run is not None:
                on_run(rows[n])
        return rows[n]["meets"]

    lo, hi = 0, 1  # lo: the largest count known to miss (0: none tried), hi: the count to try
    while not ok(hi):
        if hi >= max_replicas:
            return None, [rows[n] for n in sorted(rows)]
        lo, hi = hi, min(2 * hi, max_replicas)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi, [rows[n] for n in sorted(rows)]


def capacity_table(trace: Trace | Sequence[Trace], base: SimConfig, routers: Sequence[str], rates: Sequence[float],
                   attainment: float = 0.9, max_replicas: int = 64,
                   on_result: Callable[[dict], None] | None = None,
                   on_run: Callable[[dict], None] | None = None, jobs: int = 1, executor: str = "process",
                   address: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """For every (router, rate): the fewest replicas meeting the SLOs. Returns (one row per
    (router, rate) with the answer and GPUs = replicas x tp, every simulated configuration).
    `jobs` worker processes (or `executor` "ray" on the Ray cluster at `address`) search
    different (router, rate) pairs at once; `on_run` then sees a pair's configurations together
    when its search ends. A sequence of traces, one per seed (analysis.seeds), searches each
    seed's workload on its own and adds a `seed` column to both tables."""
    runs, tagged = seeded(trace, base.seed)
    timed = {(rate, seed): apply_arrivals(workload, rate=rate, seed=seed) for rate in rates for seed, workload in runs}
    tasks, tags = [], []  # the tables' order (and the printed rows'): router, then rate, then seed
    for router in routers:
        for rate in rates:
            for seed, _ in runs:
                tasks.append((timed[rate, seed], dataclasses.replace(base, router=router, seed=seed), attainment,
                              max_replicas))
                tags.append({"router": router, "rate": rate, **({"seed": seed} if tagged else {})})
    answers: list[dict] = [{} for _ in tasks]
    tried: list[list[dict]] = [[] for _ in tasks]

    def done(i: int, result: tuple[int | None, list[dict]]) -> None:
        n, rows = result
        cfg, tag = tasks[i][1], tags[i]
        tried[i] = [{**tag, **r} for r in rows]
        answers[i] = {**tag, "min_replicas": n, "gpus": None if n is None else n * cfg.tp, "simulations": len(rows)}
        for r in tried[i] if on_run is not None else ():
            on_run(r)
        if on_result is not None:
            on_result(answers[i])

    run_tasks(min_replicas, tasks, jobs, done, executor, address)
    return pd.DataFrame(answers), pd.DataFrame([r for rows in tried for r in rows])


def capacity_figure(answers: pd.DataFrame, title: str = "", max_replicas: int | None = None) -> Figure:
    """Fewest replicas meeting the SLOs against request rate, one line per router in the house
    style (with a seed column: the mean over seeds and its 95% interval). A (router, rate) that no
    count up to `max_replicas` serves is a triangle above that count, not a missing point."""
    table = answers.astype({"min_replicas": float})
    fig = rate_figure(table, "router", [Panel("min_replicas", "fewest replicas meeting the SLOs", log=False,
                                              integer=True)], legend=False)
    fig.set_size_inches(7, 5)
    ax = fig.axes[0]
    extra = []
    missing = table[table.min_replicas.isna()]
    if max_replicas is not None and len(missing):
        colors = series_colors(table.router)
        for router, g in missing.groupby("router", sort=False):
            ax.plot(g.rate, [max_replicas] * len(g), "^", color=colors[router], markersize=9)
        extra.append((plt.Line2D([], [], marker="^", color="0.3", linestyle=""), f"more than {max_replicas} replicas"))
    ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], (max_replicas or 0) + 1 if len(missing) else 0))
    legend_below(fig, *house_legend(fig, extra=extra), title, max_cols=4)
    return fig


def capacity_plot(answers: pd.DataFrame, path: str | Path, title: str = "", max_replicas: int | None = None) -> Path:
    """`capacity_figure` written to `path`."""
    return save_figure(capacity_figure(answers, title, max_replicas), path, layout=False)


# ---- the study `pagesim capacity` runs ----

@dataclass(kw_only=True)
class CapacityStudy(RateStudy):
    """A capacity search's configuration (the SLOs in its base): the routers, the share of requests
    that must meet the SLOs, the most replicas tried, and the SLOs in words ("TTFT <= 1 s")."""

    routers: list[str]
    attainment: float = 0.9
    max_replicas: int = 64
    slo: str = ""


@dataclass
class CapacityTables:
    study: CapacityStudy
    answers: pd.DataFrame  # one row per (router, rate[, seed]): the fewest replicas meeting the SLOs
    tried: pd.DataFrame    # every configuration simulated


def run_capacity(study: CapacityStudy, on_result: Callable[[dict], None] | None = None,
                 on_run: Callable[[dict], None] | None = None) -> CapacityTables:
    """The capacity tables; `on_run(row)` for each configuration simulated, `on_result(row)` for
    each answer."""
    answers, tried = capacity_table(study.workload, study.base, study.routers, study.rates, study.attainment,
                                    study.max_replicas, on_result=on_result, on_run=on_run,
                                    **study.workers.options())
    return CapacityTables(study, answers, tried)


def capacity_report(result: CapacityTables) -> Report:
    """capacity.csv, capacity_runs.csv (and capacity_summary.csv with seeds), capacity.png."""
    study = result.study
    report = seeded_report(result.answers, "capacity.csv", ["router", "rate"], "min_replicas")
    report.table("capacity_runs.csv", result.tried)
    report.figure("capacity.png", lambda path: capacity_plot(
        result.answers, path, f"{study.trace.name}, {study.title}, {study.slo}" + seeds_note(study.seeds),
        study.max_replicas))
    report.wrote("capacity.csv", "capacity_runs.csv", "capacity.png")
    return report
