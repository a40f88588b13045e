"""Routers compared: one trace served by several replicas, each router at several request rates
-> a table and curves of TTFT, normalized latency and prefix-cache hits against rate."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from analysis.parallel import run_tasks
from analysis.plots import Panel, serving_figure, serving_panels
from analysis.rate_study import RateStudy
from analysis.report import Report
from analysis.seeds import seeded, seeded_report, seeds_note
from analysis.sweep import headline
from policies.router import MATCH_ROUTERS
from sim.run import SimConfig, run_simulation
from traces import apply_arrivals
from traces.trace import Trace


def router_sweep(trace: Trace | Sequence[Trace], base: SimConfig, routers: Sequence[str], rates: Sequence[float],
                 on_result: Callable[[dict], None] | None = None, router_options: dict | None = None,
                 jobs: int = 1, executor: str = "process", address: str | None = None) -> pd.DataFrame:
    """Simulate every (router, rate) with base.replicas replicas. Arrivals are Poisson at the rate
    (or the trace's timestamps rescaled to it) with the config's seed, the same for every router.
    Each row also says which share of the finished requests' prompt tokens the prefix caches
    served, and how uneven the spread was (requests per replica, max over mean). `router_options`
    go to the routers that take them (the others run with their defaults). `jobs` worker processes
    run the simulations, or `executor` "ray" runs them on the Ray cluster at `address` (the same
    table either way). A sequence of traces, one per seed (analysis.seeds), repeats the study for
    each and adds a `seed` column."""
    if base.replicas < 2:
        raise ValueError(f"a router study needs replicas >= 2, got {base.replicas}")
    runs, tagged = seeded(trace, base.seed)
    timed = {(rate, seed): apply_arrivals(workload, rate=rate, seed=seed) for rate in rates for seed, workload in runs}
    tasks = []  # the table's order (and the printed rows'): router, then rate, then seed
    for router in routers:
        opts = (router_options or {}) if router in MATCH_ROUTERS else {}
        for rate in rates:
            for seed, _ in runs:
                tasks.append((dataclasses.replace(base, router=router, router_options=opts, seed=seed),
                              timed[rate, seed], rate, tagged))
    rows = run_tasks(_routing_run, tasks, jobs, None if on_result is None else (lambda i, r: on_result(r)),
                     executor, address)
    return pd.DataFrame(rows)


def _routing_run(cfg: SimConfig, timed: Trace, rate: float, tag_seed: bool = False) -> dict:
    res = run_simulation(cfg, timed)
    done = res.requests[res.requests.status == "finished"]
    prompt_tokens = int(done.prompt_len.sum())
    router_info = res.summary["router"]
    return {"router": cfg.router, "rate": rate, **({"seed": cfg.seed} if tag_seed else {}), **headline(res.summary),
            "prefix_hit_fraction": res.summary["prefix_hit_tokens"] / max(prompt_tokens, 1),
            "imbalance": router_info["imbalance"],
            "busiest_replica": max(r["busy_fraction"] for r in router_info["replicas"]),
            # prefix-affinity and cache-aware: the share of requests sent by a prefix match
            "affinity_share": router_info.get("affinity_routed", float("nan")) / max(len(res.requests), 1)}


PREFIX_PANEL = Panel("prefix_hit_fraction", "prompt tokens from prefix cache", log=False, ylim=(0, 1))


def routing_figure(table: pd.DataFrame, title: str = "") -> Figure:
    """The serving panels (analysis.plots.serving_figure) one line per router, and the share of
    prompt tokens served from prefix caches."""
    return serving_figure(table, title, by="router", extra=[PREFIX_PANEL])


def routing_plot(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """`routing_figure` written to `path`."""
    return serving_panels(table, path, title, by="router", extra=[PREFIX_PANEL])


# ---- the study `pagesim routing` runs ----

@dataclass(kw_only=True)
class RoutingStudy(RateStudy):
    """A router study's configuration: the routers, the matching routers' options, and what the
    replicas are (for the figure's title)."""

    routers: list[str]
    router_options: dict
    replicas_of: str = ""


@dataclass
class RoutingTables:
    study: RoutingStudy
    table: pd.DataFrame  # one row per (router, rate[, seed])


def run_routing(study: RoutingStudy, on_row: Callable[[dict], None] | None = None) -> RoutingTables:
    """The router study's table; `on_row(row)` as each run finishes."""
    table = router_sweep(study.workload, study.base, study.routers, study.rates, on_result=on_row,
                         router_options=study.router_options, **study.workers.options())
    return RoutingTables(study, table)


def routing_report(result: RoutingTables) -> Report:
    """routing.csv (and routing_summary.csv with seeds), routing.png, and the closing line."""
    table, study = result.table, result.study
    report = seeded_report(table, "routing.csv", ["router", "rate"], "ttft_mean")
    report.figure("routing.png", lambda path: routing_plot(
        table, path, f"{study.trace.name}, {study.base.replicas} replicas of {study.replicas_of}"
        + seeds_note(study.seeds)))
    report.wrote("routing.csv", "routing.png")
    return report
