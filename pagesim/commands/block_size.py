"""The vLLM paper's Figure 18b: mean normalized latency against block size at one or more rates, with what
moves it (internal fragmentation, decode time per sequence). Writes block_size.csv and block_size.png to
--out. Small blocks cost more only under a profile measured at several block sizes (`pagesim profile
--block-sizes`).
"""

from __future__ import annotations

import argparse

from analysis.block_size import BLOCK_SIZES, BlockSizeStudy, block_size_report, run_block_sizes
from analysis.report import Columns
from pagesim.argtypes import out_dir, positive_int
from pagesim.cli_args import add_study_args, sim_config, study_title, study_trace, workers
from pagesim.report_writer import RowPrinter, print_study

HELP = "one trace at each block size, the KV capacity held fixed (simulated)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    bsz = sub.add_parser("block-size", help=HELP, description=__doc__)
    add_study_args(bsz, "sharegpt-like", [2.0])
    bsz.add_argument("--block-sizes", type=positive_int, nargs="+", default=list(BLOCK_SIZES))
    bsz.add_argument("--kv-tokens", type=positive_int, help="KV cache capacity in tokens at every block size (needed with "
                                                   "--profile; default: what --model leaves on --hardware)")
    bsz.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    bsz.add_argument("--out", type=out_dir, required=True)
    bsz.set_defaults(func=command)


def study(args: argparse.Namespace) -> BlockSizeStudy:
    if args.num_gpu_blocks is not None:
        raise ValueError("--num-gpu-blocks: a block-size study holds the capacity in tokens; use --kv-tokens")
    if args.profile and not args.kv_tokens:
        raise ValueError("--kv-tokens: a profiled study needs the KV capacity in tokens (a profile does not say it)")
    return BlockSizeStudy(workload=study_trace(args), base=sim_config(args), rates=args.rates, workers=workers(args),
                          title=study_title(args), block_sizes=args.block_sizes, kv_tokens=args.kv_tokens)


def command(args: argparse.Namespace) -> int:
    s = study(args)
    return print_study(f"block size: {len(s.trace)} requests of {s.trace.name}, {s.title}, "
                       + (f"{s.kv_tokens:,} KV tokens" if s.kv_tokens else "KV capacity from the hardware spec"),
                       RowPrinter(COLUMNS), lambda rows: block_size_report(run_block_sizes(s, on_row=rows)), args.out)


COLUMNS = Columns(("rate", "rate", ">6g"), ("block", "block_size", ">6"), ("blocks", "num_gpu_blocks", ">8,"),
                  ("norm lat", "mean_normalized_latency", ">9.4f"), ("req/s", "throughput", ">7.3f"),
                  ("preempt", "preemptions", ">8"), ("batch", "mean_batched_seqs", ">6.1f"),
                  ("frag", "internal_frag", ">6.1%"), ("ref ms", "reference_decode_ms", ">7.2f"))
