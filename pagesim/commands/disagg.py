"""Serve one trace on --gpus GPUs colocated and split into prefill and decode replicas (every split, or
--splits), at each rate. Writes disagg.csv and disagg.png (P90 TTFT, P90 TPOT, normalized latency against
rate) to --out.
"""

from __future__ import annotations

import argparse

from analysis.disagg import DisaggStudy, disagg_report, parse_splits, run_disagg, setups
from analysis.report import Columns
from pagesim import cli_args
from pagesim.argtypes import out_dir, positive_float, positive_int
from pagesim.report_writer import RowPrinter, print_study

HELP = "colocated or disaggregated prefill/decode on the same GPUs (simulated)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    dg = sub.add_parser("disagg", help=HELP, description=__doc__)
    cli_args.add_study_args(dg, "sharegpt-like", [4.0, 8.0, 12.0])
    dg.set_defaults(model="llama-3-8b", hardware="a100-80gb")
    dg.add_argument("--gpus", type=positive_int, default=4, help="GPUs in every setup (default 4)")
    dg.add_argument("--splits", nargs="+", metavar="P+D", help="prefill+decode splits to try (default: all)")
    dg.add_argument("--router", default="least-loaded", type=cli_args.router_name, metavar="ROUTER",
                    help="router over the colocated replicas and over the prefill replicas (default least-loaded)")
    dg.add_argument("--transfer-bandwidth", type=cli_args.gigabytes_per_s, metavar="GB/S",
                    help="KV link (default: NVLink)")
    dg.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    dg.add_argument("--chunked-prefill", action="store_true", help="chunked prefill in every replica")
    dg.add_argument("--slo-ttft", type=positive_float)
    dg.add_argument("--slo-tpot", type=positive_float)
    dg.add_argument("--out", type=out_dir, required=True)
    dg.set_defaults(func=command)


def study(args: argparse.Namespace) -> DisaggStudy:
    splits = parse_splits(args.splits)
    setups(args.gpus, splits)  # checks the splits before any run
    return DisaggStudy(workload=cli_args.study_trace(args), base=cli_args.sim_config(args), rates=args.rates,
                       workers=cli_args.workers(args), title=cli_args.study_title(args), gpus=args.gpus, splits=splits)


def command(args: argparse.Namespace) -> int:
    s = study(args)
    return print_study(f"disagg: {len(s.trace)} requests of {s.trace.name}, {s.gpus} GPUs of {s.title}: "
                       f"{', '.join(s.names)}", RowPrinter(COLUMNS),
                       lambda rows: disagg_report(run_disagg(s, on_row=rows)), args.out)


COLUMNS = Columns(("setup", "setup", "<10"), ("rate", "rate", ">6g"), ("p90 TTFT", "ttft_p90", ">9.3f"),
                  ("p90 TPOT", "tpot_p90", ">9.4f"), ("norm lat", "mean_normalized_latency", ">9.4f"),
                  ("req/s", "throughput", ">7.3f"), ("wall s", "wall_s", ">7.2f"))
