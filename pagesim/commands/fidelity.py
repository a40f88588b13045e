"""Simulate every stage of the measured experiments (the vllm-h100 measurements.json format, `vllm bench serve
--save-result` files, pagesim run folders, per-request run folders) and print measured vs predicted TTFT
mean/p90, E2E mean/p90/p99 and time per output token with the error of each, and the median and mean
absolute error. Writes fidelity.csv, fidelity.json and fidelity.png to --out; each per-request run is also
compared request by request and over time (request_runs/<n>/, request_runs.json).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from analysis import fidelity
from pagesim.argtypes import out_dir, positive_float, positive_int, seed
from pagesim.cli_args import add_executor_args, add_server_args, server_settings, workers
from pagesim.report_writer import write_report

HELP = "simulate measured serving runs and report the simulator's error on each"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("fidelity", help=HELP, description=__doc__)
    p.add_argument("--measurements", nargs="+", required=True, metavar="FILE",
                   help="measurement files, pagesim run folders or per-request run folders")
    p.add_argument("--calibration", help="a calibration file or shipped name (default: the roofline cost model)")
    p.add_argument("--hardware", help=f"GPU spec to simulate on (default: each experiment's own, else "
                                      f"{fidelity.DEFAULT_HARDWARE})")
    p.add_argument("--models-dir", action="append", metavar="DIR",
                   help="folder of HF config.json files for model ids (repeatable; default ../shared/models beside "
                        "the repository and the working directory)")
    p.add_argument("--max-duration", type=positive_float, metavar="S",
                   help="count only S seconds of each stage's arrivals (default: the whole stage); a stage that "
                        "cycles its prompts has its first cycle simulated before them and left out")
    p.add_argument("--seed", type=seed, default=0)
    add_server_args(p)
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="simulations run at once in worker processes (default 1; the results are the same)")
    add_executor_args(p)
    p.add_argument("--out", type=out_dir, default="runs/fidelity", help="output folder (default runs/fidelity)")
    p.set_defaults(func=command)
    return p


def command(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    plan = fidelity.plan_fidelity(fidelity.FidelityStudy(args.measurements, args.models_dir, args.calibration,
                                                         args.hardware, args.max_duration, args.seed, workers(args),
                                                         server_settings(args)))
    write_report(plan.intro(), None)
    outcome = fidelity.run_fidelity(plan)
    write_report(fidelity.fidelity_report(plan, outcome, time.perf_counter() - t0), args.out)
    return 0
