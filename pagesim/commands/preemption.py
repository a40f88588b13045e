"""The vLLM paper's Figure 19: swap vs recompute time per block size from the roofline model, then one trace
simulated with each preemption mode at each block size. Writes preemption_micro.csv, preemption_e2e.csv and
preemption.png to --out.
"""

from __future__ import annotations

import argparse

from analysis import preemption
from analysis.report import Columns
from pagesim.argtypes import non_negative_int, out_dir, positive_int, rate, seed
from pagesim.cli_args import check_workload_size, sim_config
from pagesim.report_writer import RowPrinter, write_report
from traces import resolve_trace
from traces.loaders import KNOWN_FORMATS

HELP = "recompute or swap: cost per block size, and end to end (simulated)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    pre = sub.add_parser("preemption", help=HELP, description=__doc__)
    pre.add_argument("--model", default="opt-13b")
    pre.add_argument("--hardware", default="a100-40gb")
    pre.add_argument("--block-sizes", type=positive_int, nargs="+", default=list(preemption.BLOCK_SIZES))
    pre.add_argument("--tokens", type=positive_int, default=1024, help="tokens swapped or recomputed (default 1024)")
    pre.add_argument("--trace", default="sharegpt-like")
    pre.add_argument("--trace-format", choices=KNOWN_FORMATS)
    pre.add_argument("--num-requests", type=non_negative_int, default=1000, help="requests simulated (0: microbenchmark only)")
    pre.add_argument("--rate", type=rate, default=2.0, help="request rate, req/s (default 2)")
    pre.add_argument("--seed", type=seed, default=0)
    pre.add_argument("--out", type=out_dir, required=True)
    pre.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """The microbenchmark (its table written at once), then with --num-requests the trace under each
    mode at each block size."""
    study = preemption.PreemptionStudy(args.model, args.hardware, args.block_sizes, args.tokens)
    check_workload_size(args.trace, args.num_requests)  # before the microbenchmark writes anything
    micro = preemption.run_microbenchmark(study)
    write_report(preemption.micro_report(study, micro), args.out)
    e2e = None
    if args.num_requests:
        trace = resolve_trace(args.trace, num_requests=args.num_requests, rate=args.rate, seed=args.seed,
                              format=args.trace_format)
        print(f"\nend to end: {len(trace)} requests of {trace.name} at {args.rate:g} req/s, vllm")
        rows = RowPrinter(COLUMNS)
        rows.header()
        e2e = preemption.end_to_end(trace, sim_config(args), args.block_sizes, on_row=rows)
    write_report(preemption.preemption_report(study, micro, e2e), args.out)
    return 0


COLUMNS = Columns(("block size", "block_size", ">10"), ("preemption", "preemption", ">11"),
                  ("norm lat", "mean_normalized_latency", ">9.4f"), ("preempted", "preemptions", ">10"))
