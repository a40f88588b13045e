"""Scheduling policies compared (`pagesim policies`): one workload served under each policy at each
request rate, over several seeds -> throughput-latency, SLO attainment and fairness against rate,
with confidence intervals across seeds.

A seed re-draws a synthetic workload (lengths, clients, arrivals); for a trace file it takes the
next window of `num_requests` consecutive requests, so the seeds see different slices of the real
trace. Every policy sees the same requests at the same times for a given (rate, seed).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.parallel import Workers, run_tasks
from analysis.plots import Panel, rate_figure, save_figure
from analysis.report import Report, table_value
from analysis.seeds import add_seed_summary, seeds_note
from policies.metrics import headline_latency, headline_mean_normalized_latency, per_client
from policies.registry import resolve_policy
from sim.run import SimConfig, run_simulation
from traces import apply_arrivals, load_trace
from traces.trace import Trace
from traces.workloads import SYNTHETIC, make_synthetic

METRICS = {  # column -> axis label, for the figure
    "throughput": "finished requests/s",
    "mean_normalized_latency": "normalized latency (s/token)",
    "ttft_p90": "TTFT p90 (s)",
    "slo_attainment": "SLO attainment",
    "min_client_attainment": "worst client's SLO attainment",
    "max_service_gap": "max service gap between active clients (tokens)",
}


def workload(spec: str, num_requests: int, seed: int, rate: float) -> Trace:
    """The requests seed `seed` serves at `rate` (see the module docstring)."""
    if spec in SYNTHETIC:
        return apply_arrivals(make_synthetic(spec, num_requests, seed=seed), rate=rate, seed=seed)
    trace = load_trace(spec)
    start = seed * num_requests
    if start + num_requests > len(trace):
        raise ValueError(f"{spec}: seed {seed} needs requests {start}..{start + num_requests - 1}, but the trace "
                         f"holds {len(trace)}; use fewer --seeds or a smaller --num-requests")
    part = _window(trace, start, num_requests)
    return apply_arrivals(part, rate=rate, seed=seed)


def _window(trace: Trace, start: int, n: int) -> Trace:
    """Requests [start, start + n), their arrivals shifted to begin at 0."""
    rest = trace.head(start + n)
    cut = slice(start, start + n)
    fields = {f.name: getattr(rest, f.name) for f in dataclasses.fields(rest)}
    for name, value in fields.items():
        if isinstance(value, (np.ndarray, list)) and len(value) == len(rest):
            fields[name] = value[cut]
    if rest.has_timestamps and n:
        fields["arrival"] = fields["arrival"] - fields["arrival"][0]
    return Trace(**fields)


def policy_study(spec: str, base: SimConfig, policies: Sequence[str], rates: Sequence[float], seeds: int,
                 num_requests: int, options: dict[str, dict[str, Any]] | None = None, jobs: int = 1,
                 on_result: Callable[[dict], None] | None = None, executor: str = "process",
                 address: str | None = None) -> pd.DataFrame:
    """One row per (policy, rate, seed); `options[policy]` are that policy's keyword options.
    `jobs` worker processes, or `executor` "ray" at `address`, run the simulations (same table)."""
    for p in policies:
        resolve_policy(p)  # a bad name fails before any simulation
    traces = {(rate, seed): workload(spec, num_requests, seed, rate) for rate in rates for seed in range(seeds)}
    tasks = []  # the table's order, policy by policy: by rate, then by seed
    for p in policies:
        for rate in rates:
            for seed in range(seeds):
                cfg = dataclasses.replace(base, policy=p, policy_options=(options or {}).get(p, {}), seed=seed)
                tasks.append((cfg, traces[rate, seed], rate))
    return pd.DataFrame(run_tasks(_one_run, tasks, jobs, None if on_result is None else (lambda i, r: on_result(r)),
                                  executor, address))


def _one_run(cfg: SimConfig, trace: Trace, rate: float) -> dict:
    t0 = time.perf_counter()
    res = run_simulation(cfg, trace)
    s = res.summary
    clients, fairness = per_client(res.requests, cfg.slo_ttft, cfg.slo_tpot)
    return {"policy": cfg.policy, "rate": rate, "seed": cfg.seed, "requests": s["num_requests"],
            "rejected": s["num_rejected"], "throughput": s["request_throughput"],
            "mean_normalized_latency": headline_mean_normalized_latency(s),
            "ttft_mean": headline_latency(s, "ttft")["mean"], "ttft_p90": headline_latency(s, "ttft")["p90"],
            "e2e_mean": headline_latency(s, "e2e_latency")["mean"], "goodput": table_value(s["goodput"]),
            "slo_attainment": table_value(s["slo_attainment"]),
            "min_client_attainment": float(clients.slo_attainment.min()) if len(clients) else float("nan"),
            "jain_service": fairness["jain_service"], "max_service_gap": fairness["max_service_gap"],
            "preemptions": s["num_preemptions"], "wall_s": time.perf_counter() - t0}


PANELS = [Panel("throughput", METRICS["throughput"], log=False),
          Panel("mean_normalized_latency", METRICS["mean_normalized_latency"]),
          Panel("ttft_p90", METRICS["ttft_p90"]),
          Panel("slo_attainment", METRICS["slo_attainment"], log=False, ylim=(0, 1.02)),
          Panel("min_client_attainment", METRICS["min_client_attainment"], log=False, ylim=(0, 1.02)),
          Panel("max_service_gap", METRICS["max_service_gap"])]


def policy_figure(table: pd.DataFrame, title: str = "") -> Figure:
    """One panel per metric against rate in the house style (analysis.plots.rate_figure), a line per
    policy: with seeds, the mean and its 95% interval (the one policies_summary.csv gives); each
    policy's saturation point marked."""
    return rate_figure(table, "policy", PANELS, title, cols=3, saturation=True)


def policy_plot(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """`policy_figure` written to `path`."""
    return save_figure(policy_figure(table, title), path, dpi=110, layout=False)


# ---- the study `pagesim policies` runs ----

@dataclass
class PolicyStudy:
    """A policy comparison's configuration: the workload spec (synthetic kind or trace file), the
    requests per run, the configuration every run starts from, the policies with their own options,
    the rates and seeds, where the runs go, and the model and hardware in words."""

    spec: str
    num_requests: int
    base: SimConfig
    policies: list[str]
    rates: list[float]
    seeds: int = 3
    options: dict[str, dict[str, Any]] | None = None
    workers: Workers = field(default_factory=Workers)
    title: str = ""


def run_policy_study(study: PolicyStudy, on_row: Callable[[dict], None] | None = None) -> pd.DataFrame:
    """One row per (policy, rate, seed); `on_row(row)` as each run finishes."""
    return policy_study(study.spec, study.base, study.policies, study.rates, study.seeds, study.num_requests,
                        study.options, on_result=on_row, **study.workers.options())


def policy_report(study: PolicyStudy, table: pd.DataFrame) -> Report:
    """policies.csv, policies_summary.csv and policies.png."""
    report = Report()
    report.table("policies.csv", table)
    # the lines name SLO attainment, or without an SLO (attainment all NaN) normalized latency
    metric = "slo_attainment" if table.slo_attainment.notna().any() else "mean_normalized_latency"
    add_seed_summary(report, table, ["policy", "rate"], "policies_summary.csv", metric, list(METRICS))
    report.figure("policies.png", lambda path: policy_plot(
        table, path, f"{Path(study.spec).name}, {study.num_requests} requests, {study.title}" + seeds_note(study.seeds)))
    report.wrote("policies.csv", "policies.png")
    return report
