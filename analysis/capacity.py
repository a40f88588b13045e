"""Capacity planning: the fewest replicas that serve a trace at a rate within latency SLOs.

A configuration meets the SLOs when at least `attainment` of all requests (rejected ones count as
missing) finish with TTFT <= slo_ttft and TPOT <= slo_tpot, the attainment measure of DistServe and
Vidur's configuration search. The search doubles the replica count until the SLOs are met, then
bisects between the last miss and the first hit; it assumes that adding a replica never hurts
(true of the routers here up to noise) and reports every configuration it simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.cli_args import (
    add_seeds_arg,
    add_study_args,
    router_name,
    sim_config,
    study_title,
    study_workloads,
)
from analysis.parallel import executor_options, run_tasks
from analysis.report import Columns
from analysis.seeds import rate_line, seed_cell, seeded, seeds_note, write_seed_summary
from pagesim.argtypes import fraction, out_dir, positive_float, positive_int
from policies.metrics import headline_latency, headline_mean_normalized_latency
from policies.router import ROUTERS
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
    tasks, tags = [], []
    for rate in rates:
        for seed, workload in runs:
            timed = apply_arrivals(workload, rate=rate, seed=seed)
            for router in routers:
                tasks.append((timed, dataclasses.replace(base, router=router, seed=seed), attainment, max_replicas))
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


def capacity_plot(answers: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """Fewest replicas meeting the SLOs against request rate, one line per router (with a seed
    column: the mean over seeds and a 95% CI band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for router, g in answers.groupby("router", sort=False):
        rate_line(ax, g.astype({"min_replicas": float}), "min_replicas", router)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("fewest replicas meeting the SLOs")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# ---- the command: `pagesim capacity` ----

def add_parser(sub: argparse._SubParsersAction) -> None:
    cap = sub.add_parser("capacity", help="the fewest replicas that serve a trace within latency SLOs (simulated)",
                         description="Capacity planning: for each router and rate, the fewest replicas with at least "
                                     "--attainment of the requests within --slo-ttft and --slo-tpot (doubling, then "
                                     "bisecting). Writes capacity.csv (the answers), capacity_runs.csv (every "
                                     "configuration simulated) and capacity.png to --out.")
    add_study_args(cap, "sharegpt-like", [10.0, 20.0, 40.0])
    add_seeds_arg(cap)
    cap.add_argument("--routers", nargs="+", default=["least-loaded"], type=router_name, metavar="ROUTER",
                     help=f"routers to plan for: {', '.join(ROUTERS)}, or package.module:Class (default least-loaded)")
    cap.add_argument("--slo-ttft", type=positive_float, help="TTFT SLO, seconds")
    cap.add_argument("--slo-tpot", type=positive_float, help="TPOT SLO, seconds")
    cap.add_argument("--attainment", type=fraction, default=0.9, help="share of requests within the SLOs (default 0.9)")
    cap.add_argument("--max-replicas", type=positive_int, default=64)
    cap.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree of each replica (GPUs = replicas x tp)")
    cap.add_argument("--prefix-caching", action="store_true")
    cap.add_argument("--chunked-prefill", action="store_true")
    cap.add_argument("--max-num-batched-tokens", type=positive_int, default=4096)
    cap.add_argument("--out", type=out_dir, required=True)
    cap.set_defaults(func=command)


@dataclass
class CapacityStudy:
    """A capacity search as its arguments define it: the workload (one trace, or one per seed), its
    first trace, and the configuration (with the SLOs) every search starts from."""

    workload: Trace | list[Trace]
    trace: Trace
    base: SimConfig


@dataclass
class CapacityTables:
    study: CapacityStudy
    answers: pd.DataFrame  # one row per (router, rate[, seed]): the fewest replicas meeting the SLOs
    tried: pd.DataFrame    # every configuration simulated


def prepare(args: argparse.Namespace) -> CapacityStudy:
    if args.slo_ttft is None and args.slo_tpot is None:
        raise ValueError("--slo-ttft and/or --slo-tpot: capacity is the fewest replicas meeting an SLO")
    workload, trace = study_workloads(args)
    return CapacityStudy(workload, trace, sim_config(args))


def run(args: argparse.Namespace, study: CapacityStudy | None = None,
        on_result: Callable[[dict], None] | None = None,
        on_run: Callable[[dict], None] | None = None) -> CapacityTables:
    """The capacity tables; `on_run(row)` for each configuration simulated, `on_result(row)` for
    each answer."""
    study = study or prepare(args)
    answers, tried = capacity_table(study.workload, study.base, args.routers, args.rates, args.attainment,
                                    args.max_replicas, on_result=on_result, on_run=on_run, jobs=args.jobs,
                                    **executor_options(args))
    return CapacityTables(study, answers, tried)


def command(args: argparse.Namespace) -> int:
    study = prepare(args)
    cols = columns(args)
    print_header(args, study, cols)
    write_report(args, run(args, study, on_result=lambda r: print_answer(args, r), on_run=lambda r: print_row(r, cols)))
    return 0


def _slo(args: argparse.Namespace) -> str:
    return " and ".join(s for s in (args.slo_ttft and f"TTFT <= {args.slo_ttft:g} s",
                                    args.slo_tpot and f"TPOT <= {args.slo_tpot:g} s") if s)


def print_header(args: argparse.Namespace, study: CapacityStudy, cols: Columns) -> None:
    print(f"capacity: {len(study.trace)} requests of {study.trace.name} on {study_title(args)}, "
          f"{args.attainment:.0%} of requests within {_slo(args)}")
    print(cols.header() + (f" {'seed':>5}" if args.seeds > 1 else ""))


COLUMNS = Columns(("router", "router", "<16"), ("rate", "rate", ">6g"), ("replicas", "replicas", ">8"),
                  ("in SLO", "slo_attainment", ">7.1%"), ("p90 TTFT", "ttft_p90", ">9.3f"),
                  ("p90 TPOT", "tpot_p90", ">9.4f"), ("wall s", "wall_s", ">7.2f"))


def columns(args: argparse.Namespace) -> Columns:
    """The table's columns, the router column as wide as the longest router named."""
    return COLUMNS.widened("router", args.routers)


def print_row(r: dict, cols: Columns) -> None:
    print(cols.row(r) + seed_cell(r), flush=True)


def print_answer(args: argparse.Namespace, r: dict) -> None:
    n = r["min_replicas"]
    print(f"  -> {r['router']} at {r['rate']:g} req/s" + (f", seed {r['seed']}" if "seed" in r else "") + ": "
          + (f"{n} replicas ({r['gpus']} GPUs)" if n is not None else f"more than {args.max_replicas} replicas"),
          flush=True)


def write_report(args: argparse.Namespace, result: CapacityTables) -> None:
    """capacity.csv, capacity_runs.csv (and capacity_summary.csv with seeds), capacity.png."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.answers.to_csv(out / "capacity.csv", index=False)
    result.tried.to_csv(out / "capacity_runs.csv", index=False)
    write_seed_summary(result.answers, ["router", "rate"], out / "capacity_summary.csv", "min_replicas")
    capacity_plot(result.answers, out / "capacity.png",
                  f"{result.study.trace.name}, {study_title(args)}, {_slo(args)}" + seeds_note(args.seeds))
    print(f"wrote {out}/capacity.csv, capacity_runs.csv, capacity.png")
