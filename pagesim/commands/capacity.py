"""`pagesim capacity`: the fewest replicas that serve a trace within latency SLOs (analysis.capacity)."""

from __future__ import annotations

import argparse

from analysis.capacity import CapacityStudy, capacity_report, run_capacity
from analysis.report import Columns
from analysis.seeds import seed_cell
from pagesim.argtypes import fraction, out_dir, positive_float, positive_int
from pagesim.cli_args import (
    add_seeds_arg,
    add_study_args,
    router_name,
    sim_config,
    study_title,
    study_workloads,
    workers,
)
from pagesim.report_writer import write_report
from policies.router import ROUTERS


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


def study(args: argparse.Namespace) -> CapacityStudy:
    if args.slo_ttft is None and args.slo_tpot is None:
        raise ValueError("--slo-ttft and/or --slo-tpot: capacity is the fewest replicas meeting an SLO")
    workload, trace = study_workloads(args)
    slo = " and ".join(s for s in (args.slo_ttft and f"TTFT <= {args.slo_ttft:g} s",
                                   args.slo_tpot and f"TPOT <= {args.slo_tpot:g} s") if s)
    return CapacityStudy(workload, trace, sim_config(args), args.routers, args.rates, args.attainment,
                         args.max_replicas, workers(args), study_title(args), args.seeds, slo)


def command(args: argparse.Namespace) -> int:
    s = study(args)
    cols = COLUMNS.widened("router", args.routers)  # as wide as the longest router named
    print(f"capacity: {len(s.trace)} requests of {s.trace.name} on {s.title}, "
          f"{s.attainment:.0%} of requests within {s.slo}")
    print(cols.header() + (f" {'seed':>5}" if args.seeds > 1 else ""))
    result = run_capacity(s, on_result=lambda r: print_answer(s, r),
                          on_run=lambda r: print(cols.row(r) + seed_cell(r), flush=True))
    write_report(capacity_report(result), args.out)
    return 0


COLUMNS = Columns(("router", "router", "<16"), ("rate", "rate", ">6g"), ("replicas", "replicas", ">8"),
                  ("in SLO", "slo_attainment", ">7.1%"), ("p90 TTFT", "ttft_p90", ">9.3f"),
                  ("p90 TPOT", "tpot_p90", ">9.4f"), ("wall s", "wall_s", ">7.2f"))


def print_answer(study: CapacityStudy, r: dict) -> None:
    n = r["min_replicas"]
    print(f"  -> {r['router']} at {r['rate']:g} req/s" + (f", seed {r['seed']}" if "seed" in r else "") + ": "
          + (f"{n} replicas ({r['gpus']} GPUs)" if n is not None else f"more than {study.max_replicas} replicas"),
          flush=True)
