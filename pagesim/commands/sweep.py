"""Throughput-latency curves: writes sweep.csv, latency_vs_rate.png and memory_breakdown.png to --out.
"""

from __future__ import annotations

import argparse

from analysis.report import Columns
from analysis.sweep import SweepStudy, run_sweep, sweep_report
from pagesim import cli_args
from pagesim.argtypes import out_dir, positive_float, positive_int
from pagesim.report_writer import RowPrinter, print_study
from policies.registry import POLICIES

HELP = "simulate several policies over several request rates and plot"


def add_parser(sub: argparse._SubParsersAction) -> None:
    sw = sub.add_parser("sweep", help=HELP, description=__doc__)
    cli_args.add_study_args(sw, "sharegpt-like", [0.5, 1.0, 1.5, 2.0, 2.5])
    cli_args.add_seeds_arg(sw)
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
    cli_args.add_replica_args(sw)
    sw.add_argument("--latency-limit", type=positive_float, default=1.0,
                    help="normalized latency (s/token) for the max-sustainable-rate line (default 1.0)")
    sw.add_argument("--out", type=out_dir, required=True)
    sw.set_defaults(func=command)


def study(args: argparse.Namespace) -> SweepStudy:
    workload = cli_args.study_workloads(args)
    return SweepStudy(workload=workload, base=cli_args.sim_config(args), rates=args.rates,
                      workers=cli_args.workers(args), title=cli_args.study_title(args), seeds=args.seeds,
                      policies=args.policies, latency_limit=args.latency_limit)


def command(args: argparse.Namespace) -> int:
    s = study(args)
    return print_study(title(args, s), RowPrinter(COLUMNS, args.seeds),
                       lambda rows: sweep_report(run_sweep(s, on_row=rows)), args.out)


def title(args: argparse.Namespace, study: SweepStudy) -> str:
    """What is swept, and the vllm options the baselines run without."""
    replicas = f"{study.base.replicas} replicas ({args.router}) of " if study.base.replicas > 1 else ""
    lines = [f"sweep: {len(study.trace)} requests of {study.trace.name}, {replicas}{study.title}"]
    vllm_opts = [o for o, on in (("--chunked-prefill", args.chunked_prefill), ("--prefix-caching", args.prefix_caching),
                                 (f"--preemption {args.preemption}", args.preemption != "recompute")) if on]
    if vllm_opts:
        lines.append(f"{' '.join(vllm_opts)}: vllm runs only")
    return "\n".join(lines)


COLUMNS = Columns(("policy", "policy", "<12"), ("rate", "rate", ">6.2f"), ("req/s", "throughput", ">7.3f"),
                  ("norm lat", "mean_normalized_latency", ">9.4f"), ("p90 TTFT", "ttft_p90", ">9.2f"),
                  ("preempt", "preemptions", ">8"), ("wall s", "wall_s", ">7.2f"))
