"""The vLLM paper's Figure 15 measure: blocks saved by sharing / blocks without sharing, time-averaged, for
each width and rate (policy vllm).
"""

from __future__ import annotations

import argparse

from analysis.report import Columns
from analysis.sharing import SharingStudy, run_sharing, sharing_report
from pagesim.argtypes import out_dir, positive_float, positive_int
from pagesim.cli_args import add_study_args, sim_config, study_title, study_trace, workers
from pagesim.report_writer import RowPrinter, print_study

HELP = "memory saved by block sharing under parallel sampling and beam search"


def add_parser(sub: argparse._SubParsersAction) -> None:
    sh = sub.add_parser("sharing", help=HELP, description=__doc__)
    add_study_args(sh, "alpaca-like", [10.0])
    sh.add_argument("--n", type=positive_int, nargs="*", default=[2, 4, 6], help="parallel sampling widths (default 2 4 6)")
    sh.add_argument("--beam-width", type=positive_int, nargs="*", default=[2, 4, 6], help="beam widths (default 2 4 6)")
    sh.add_argument("--beam-decay", type=positive_float, nargs="+", default=[0.5],
                    help="q of the simulated beam rule (parents picked ~ q^rank; measure it with `pagesim beams`): "
                         "one value, or one per --beam-width (default 0.5)")
    sh.add_argument("--beam-picks", help="a measured pick table (`pagesim beams --out`) for the widths it covers, "
                                         "instead of the q^rank rule")
    sh.add_argument("--out", type=out_dir, help="write sharing.csv here")
    sh.set_defaults(func=command)


def study(args: argparse.Namespace) -> SharingStudy:
    widths = [("n", k) for k in args.n] + [("beam", k) for k in args.beam_width]
    if not widths or any(k < 2 for _, k in widths):
        raise ValueError("--n and --beam-width take widths >= 2 (at least one in all)")
    if len(args.beam_decay) not in (1, len(args.beam_width)):
        raise ValueError(f"--beam-decay: give one value or one per --beam-width ({len(args.beam_width)}), "
                         f"got {len(args.beam_decay)}")
    decay = dict(zip(args.beam_width, args.beam_decay * len(args.beam_width)))
    trace = study_trace(args)
    # --n and --beam-width are lists of widths here, not the config's per-request override
    base = sim_config(args, n=None, beam_width=None, beam_rank_decay=args.beam_decay[0])
    return SharingStudy(workload=trace, base=base, rates=args.rates, workers=workers(args), widths=widths,
                        decay=decay)


def command(args: argparse.Namespace) -> int:
    s = study(args)
    title = f"sharing: {len(s.trace)} requests of {s.trace.name}, {study_title(args)}, block size {args.block_size}"
    return print_study(title, RowPrinter(COLUMNS), lambda rows: sharing_report(run_sharing(s, on_row=rows)), args.out)


COLUMNS = Columns(("decoding", "decoding", "<18"), ("width", "width", ">5"), ("rate", "rate", ">6.2f"),
                  ("saving", "saving", ">7.1%"), ("req/s", "throughput", ">7.3f"),
                  ("norm lat", "mean_normalized_latency", ">9.4f"), ("preempt", "preemptions", ">8"))
