"""`pagesim sweep`: several policies over several request rates (analysis.sweep)."""

from __future__ import annotations

import argparse

from analysis.report import Columns
from analysis.seeds import seed_cell
from analysis.sweep import SweepStudy, run_sweep, sweep_report
from pagesim.argtypes import out_dir, positive_float, positive_int
from pagesim.cli_args import (
    add_replica_args,
    add_seeds_arg,
    add_study_args,
    sim_config,
    study_title,
    study_workloads,
    workers,
)
from pagesim.report_writer import write_report
from policies.registry import POLICIES


def add_parser(sub: argparse._SubParsersAction) -> None:
    sw = sub.add_parser("sweep", help="simulate several policies over several request rates and plot",
                        description="Throughput-latency curves: writes sweep.csv, latency_vs_rate.png and "
                                    "memory_breakdown.png to --out.")
    add_study_args(sw, "sharegpt-like", [0.5, 1.0, 1.5, 2.0, 2.5])
    add_seeds_arg(sw)
    sw.add_argument("--policies", nargs="+", default=["vllm", "orca-oracle", "orca-pow2", "orca-max"],
                    choices=list(POLICIES))
    sw.add_argument("--tp", type=positive_int, default=1)
    sw.add_argument("--max-num-seqs", type=positive_int, default=256)
    sw.add_argument("--max-num-batched-tokens", type=positive_int, default=4096)
    sw.add_argument("--n", type=positive_int)
    sw.add_argument("--beam-width", type=positive_int)
    paged = sw.add_argument_group("vllm options (the contiguous baselines run without them)")
    paged.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    paged.add_argument("--chunked-prefill", action="store_true")
    paged.add_argument("--prefix-caching", action="store_true")
    add_replica_args(sw)
    sw.add_argument("--latency-limit", type=positive_float, default=1.0,
                    help="normalized latency (s/token) for the max-sustainable-rate line (default 1.0)")
    sw.add_argument("--out", type=out_dir, required=True)
    sw.set_defaults(func=command)


def study(args: argparse.Namespace) -> SweepStudy:
    workload, trace = study_workloads(args)
    return SweepStudy(workload, trace, sim_config(args), args.policies, args.rates, args.latency_limit, workers(args),
                      study_title(args), args.seeds)


def command(args: argparse.Namespace) -> int:
    s = study(args)
    print_header(args, s)
    write_report(sweep_report(run_sweep(s, on_row=print_row)), args.out)
    return 0


def print_header(args: argparse.Namespace, study: SweepStudy) -> None:
    replicas = f"{study.base.replicas} replicas ({args.router}) of " if study.base.replicas > 1 else ""
    print(f"sweep: {len(study.trace)} requests of {study.trace.name}, {replicas}{study.title}")
    vllm_opts = [o for o, on in (("--chunked-prefill", args.chunked_prefill), ("--prefix-caching", args.prefix_caching),
                                 (f"--preemption {args.preemption}", args.preemption != "recompute")) if on]
    if vllm_opts:
        print(f"{' '.join(vllm_opts)}: vllm runs only")
    print(COLUMNS.header() + (f" {'seed':>5}" if args.seeds > 1 else ""))


COLUMNS = Columns(("policy", "policy", "<12"), ("rate", "rate", ">6.2f"), ("req/s", "throughput", ">7.3f"),
                  ("norm lat", "mean_normalized_latency", ">9.4f"), ("p90 TTFT", "ttft_p90", ">9.2f"),
                  ("preempt", "preemptions", ">8"), ("wall s", "wall_s", ">7.2f"))


def print_row(r: dict) -> None:
    print(COLUMNS.row(r) + seed_cell(r), flush=True)
