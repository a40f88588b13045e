"""Routers compared: one trace served by several replicas, each router at several request rates
-> a table and curves of TTFT, normalized latency and prefix-cache hits against rate."""

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
    check_workload_size,
    router_name,
    sim_config,
    study_title,
    study_workloads,
)
from analysis.parallel import executor_options, run_tasks
from analysis.plots import rate_panels
from analysis.report import Columns
from analysis.seeds import seed_cell, seeded, seeds_note, write_seed_summary
from analysis.sweep import headline
from pagesim.argtypes import non_negative_int, out_dir, positive_int
from policies.router import MATCH_ROUTERS, ROUTERS
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
    tasks = []
    for rate in rates:
        for seed, workload in runs:
            timed = apply_arrivals(workload, rate=rate, seed=seed)
            for router in routers:
                opts = (router_options or {}) if router in MATCH_ROUTERS else {}
                tasks.append((dataclasses.replace(base, router=router, router_options=opts, seed=seed), timed, rate,
                              tagged))
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


def routing_plot(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """Three panels against request rate, one line per router: mean TTFT, mean normalized latency,
    and the share of prompt tokens served from prefix caches."""
    return rate_panels(table, "router", [("ttft_mean", "mean TTFT (s)", True, None),
                                         ("mean_normalized_latency", "mean normalized latency (s/token)", True, None),
                                         ("prefix_hit_fraction", "prompt tokens from prefix cache", False, (0, 1))],
                       path, title)


# ---- the command: `pagesim routing` ----

def add_parser(sub: argparse._SubParsersAction) -> None:
    rt = sub.add_parser("routing", help="compare routers across replicas over request rates (simulated)",
                        description="Serve one trace with several replicas under each router at each rate; "
                                    "writes routing.csv and routing.png (TTFT, normalized latency and prefix-cache "
                                    "hits against rate) to --out. The default workload: 200 shared 4,096-token "
                                    "prefixes, more than one replica's cache holds.")
    add_study_args(rt, "shared-prefix", [4.0, 8.0, 12.0, 16.0, 24.0])
    add_seeds_arg(rt)
    rt.set_defaults(model="llama-3.1-8b", hardware="a100-80gb")
    rt.add_argument("--replicas", type=positive_int, default=4, help="replicas (default 4)")
    rt.add_argument("--replica-hardware", nargs="+", metavar="GPU",
                    help="each replica's GPU spec (sets --replicas; default: all on --hardware)")
    rt.add_argument("--routers", nargs="+", default=["round-robin", "least-loaded", "prefix-affinity", "cache-aware"],
                    type=router_name, metavar="ROUTER",
                    help=f"routers to compare: {', '.join(ROUTERS)}, or package.module:Class (default: the first four)")
    rt.add_argument("--max-imbalance", type=non_negative_int, help="prefix-affinity's and cache-aware's load cap (default 8)")
    rt.add_argument("--no-prefix-caching", action="store_true", help="turn the replicas' prefix caches off")
    rt.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, help="token budget (default 8192)")
    rt.add_argument("--no-chunked-prefill", action="store_true", help="prefill whole prompts (default: chunked)")
    sp = rt.add_argument_group("the shared-prefix workload (when --trace shared-prefix)")
    sp.add_argument("--num-prefixes", type=positive_int, default=200)
    sp.add_argument("--prefix-len", type=non_negative_int, default=4096)
    sp.add_argument("--suffix-len", type=non_negative_int, default=128)
    sp.add_argument("--output-len", type=positive_int, default=256)
    rt.add_argument("--out", type=out_dir, required=True)
    rt.set_defaults(func=command)


@dataclass
class RoutingStudy:
    """A router study as its arguments define it: the workload (one trace, or one per seed), its
    first trace, the configuration every run starts from, and the matching routers' options."""

    workload: Trace | list[Trace]
    trace: Trace
    base: SimConfig
    router_options: dict


@dataclass
class RoutingTables:
    study: RoutingStudy
    table: pd.DataFrame  # one row per (router, rate[, seed])


def prepare(args: argparse.Namespace) -> RoutingStudy:
    from traces.synthetic import make_synthetic

    def shared_prefix(seed: int) -> Trace:
        return apply_arrivals(make_synthetic("shared-prefix", args.num_requests, seed=seed,
                                             num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
                                             suffix_len=args.suffix_len, output_len=args.output_len),
                              rate=args.rates[0], seed=seed)

    if args.trace == "shared-prefix":
        check_workload_size(args.trace, args.num_requests)
    workload, trace = study_workloads(args, shared_prefix if args.trace == "shared-prefix" else None)
    opts = {} if args.max_imbalance is None else {"max_imbalance": args.max_imbalance}
    if opts and not set(MATCH_ROUTERS) & set(args.routers):
        raise ValueError(f"--max-imbalance applies to the {' and '.join(MATCH_ROUTERS)} routers, neither in --routers")
    # --replica-hardware sets the count whatever --replicas says (its default is 4, not 1)
    base = sim_config(args, replicas=len(args.replica_hardware or ()) or args.replicas,
                      prefix_caching=not args.no_prefix_caching, chunked_prefill=not args.no_chunked_prefill)
    return RoutingStudy(workload, trace, base, opts)


def run(args: argparse.Namespace, study: RoutingStudy | None = None,
        on_row: Callable[[dict], None] | None = None) -> RoutingTables:
    """The router study's table; `on_row(row)` as each run finishes."""
    study = study or prepare(args)
    table = router_sweep(study.workload, study.base, args.routers, args.rates, on_result=on_row,
                         router_options=study.router_options, jobs=args.jobs, **executor_options(args))
    return RoutingTables(study, table)


def command(args: argparse.Namespace) -> int:
    study = prepare(args)
    cols = columns(args)
    print_header(args, study, cols)
    write_report(args, run(args, study, on_row=lambda r: print_row(r, cols)))
    return 0


def _replicas_of(args: argparse.Namespace) -> str:
    hw = args.replica_hardware
    return f"{args.model} on {' + '.join(hw)}" if hw else study_title(args)


def print_header(args: argparse.Namespace, study: RoutingStudy, cols: Columns) -> None:
    print(f"routing: {len(study.trace)} requests of {study.trace.name}, {study.base.replicas} replicas of "
          f"{_replicas_of(args)}, prefix caching {'off' if args.no_prefix_caching else 'on'}")
    print(cols.header() + (f" {'seed':>5}" if args.seeds > 1 else ""))


COLUMNS = Columns(("router", "router", "<16"), ("rate", "rate", ">6.2f"), ("req/s", "throughput", ">7.3f"),
                  ("TTFT", "ttft_mean", ">8.3f"), ("norm lat", "mean_normalized_latency", ">9.4f"),
                  ("cache hit", "prefix_hit_fraction", ">9.1%"), ("spread", "imbalance", ">7.2f"),
                  ("wall s", "wall_s", ">7.2f"))


def columns(args: argparse.Namespace) -> Columns:
    """The table's columns, the router column as wide as the longest router named."""
    return COLUMNS.widened("router", args.routers)


def print_row(r: dict, cols: Columns) -> None:
    print(cols.row(r) + seed_cell(r), flush=True)


def write_report(args: argparse.Namespace, result: RoutingTables) -> None:
    """routing.csv (and routing_summary.csv with seeds), routing.png, and the closing line."""
    table, study = result.table, result.study
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "routing.csv", index=False)
    write_seed_summary(table, ["router", "rate"], out / "routing_summary.csv", "ttft_mean")
    routing_plot(table, out / "routing.png", f"{study.trace.name}, {study.base.replicas} replicas of "
                 f"{_replicas_of(args)}" + seeds_note(args.seeds))
    print(f"wrote {out}/routing.csv, routing.png")
