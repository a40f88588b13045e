"""Capacity planning: for each router and rate, the fewest replicas with at least --attainment of the requests
within --slo-ttft and --slo-tpot (doubling, then bisecting). Writes capacity.csv (the answers),
capacity_runs.csv (every configuration simulated) and capacity.png to --out.
"""

from __future__ import annotations

import argparse

from analysis.capacity import CapacityStudy, capacity_report, run_capacity
from analysis.report import Columns
from pagesim import cli_args
from pagesim.argtypes import fraction, out_dir, positive_float, positive_int
from pagesim.report_writer import RowPrinter, print_study
from policies.router import ROUTERS

HELP = "the fewest replicas that serve a trace within latency SLOs (simulated)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    cap = sub.add_parser("capacity", help=HELP, description=__doc__)
    cli_args.add_study_args(cap, "sharegpt-like", [10.0, 20.0, 40.0])
    cli_args.add_seeds_arg(cap)
    cap.add_argument("--routers", nargs="+", default=["least-loaded"], type=cli_args.router_name, metavar="ROUTER",
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
    workload = cli_args.study_workloads(args)
    slo = " and ".join(s for s in (args.slo_ttft and f"TTFT <= {args.slo_ttft:g} s",
                                   args.slo_tpot and f"TPOT <= {args.slo_tpot:g} s") if s)
    return CapacityStudy(workload=workload, base=cli_args.sim_config(args), rates=args.rates,
                         workers=cli_args.workers(args), title=cli_args.study_title(args), seeds=args.seeds,
                         routers=args.routers, attainment=args.attainment, max_replicas=args.max_replicas, slo=slo)


def command(args: argparse.Namespace) -> int:
    s = study(args)
    rows = RowPrinter(COLUMNS.widened("router", args.routers), args.seeds)  # as wide as the longest router named
    return print_study(f"capacity: {len(s.trace)} requests of {s.trace.name} on {s.title}, "
                       f"{s.attainment:.0%} of requests within {s.slo}", rows,
                       lambda rows: capacity_report(run_capacity(s, lambda r: print_answer(s, r), rows)), args.out)


def print_answer(study: CapacityStudy, r: dict) -> None:
    n = r["min_replicas"]
    print(f"  -> {r['router']} at {r['rate']:g} req/s" + (f", seed {r['seed']}" if "seed" in r else "") + ": "
          + (f"{n} replicas ({r['gpus']} GPUs)" if n is not None else f"more than {study.max_replicas} replicas"),
          flush=True)


COLUMNS = Columns(("router", "router", "<16"), ("rate", "rate", ">6g"), ("replicas", "replicas", ">8"),
                  ("in SLO", "slo_attainment", ">7.1%"), ("p90 TTFT", "ttft_p90", ">9.3f"),
                  ("p90 TPOT", "tpot_p90", ">9.4f"), ("wall s", "wall_s", ">7.2f"))
