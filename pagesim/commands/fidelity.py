"""`pagesim fidelity`: measured serving runs simulated, the simulator's error on each (analysis.fidelity)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from analysis.fidelity import (
    DEFAULT_HARDWARE,
    fidelity_figure,
    fidelity_results,
    fidelity_summary,
    format_summary,
    format_table,
    results_table,
    unfit_experiments,
)
from analysis.measurement_files import load_measurements
from pagesim.argtypes import out_dir, positive_float, positive_int, seed
from pagesim.cli_args import add_executor_args


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "fidelity", help="simulate measured serving runs and report the simulator's error on each",
        description="Simulate every stage of the measured experiments (the vllm-h100 measurements.json format, "
                    "`vllm bench serve --save-result` files, pagesim run folders) and print measured vs predicted "
                    "TTFT mean/p90, E2E mean/p90/p99 and time per output token with the error of each, and the "
                    "median and mean absolute error. Writes fidelity.csv, fidelity.json and fidelity.png to --out.")
    p.add_argument("--measurements", nargs="+", required=True, metavar="FILE",
                   help="measurement files or pagesim run folders")
    p.add_argument("--calibration", help="a calibration file or shipped name (default: the roofline cost model)")
    p.add_argument("--hardware", help=f"GPU spec to simulate on (default: each experiment's own, else "
                                      f"{DEFAULT_HARDWARE})")
    p.add_argument("--models-dir", action="append", metavar="DIR",
                   help="folder of HF config.json files for model ids (repeatable; default ../shared/models beside "
                        "the repository and the working directory)")
    p.add_argument("--max-duration", type=positive_float, metavar="S",
                   help="simulate only each stage's first S seconds of arrivals (default: the whole stage)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="simulations run at once in worker processes (default 1; the results are the same)")
    add_executor_args(p)
    p.add_argument("--out", type=out_dir, default="runs/fidelity", help="output folder (default runs/fidelity)")
    p.set_defaults(func=command)
    return p


def command(args: argparse.Namespace) -> int:
    if args.max_duration is not None and not args.max_duration > 0:
        raise ValueError(f"--max-duration must be > 0, got {args.max_duration}")
    t0 = time.perf_counter()
    experiments = load_measurements(args.measurements, args.models_dir)
    n = sum(len(e.stages) for e in experiments)
    cost = f"calibration {args.calibration}" if args.calibration else "the roofline cost model"
    print(f"{len(experiments)} experiments, {n} stages; simulating with {cost}"
          + (f", first {args.max_duration:g} s of each stage" if args.max_duration else ""))
    unsaid = [e.name for e in experiments if not e.hardware]
    if unsaid and not args.hardware:
        print(f"note: {len(unsaid)} experiments do not say their hardware ({', '.join(unsaid[:3])}"
              f"{', ...' if len(unsaid) > 3 else ''}): simulated on {DEFAULT_HARDWARE} (--hardware to choose)")
    unfit = unfit_experiments(experiments, args.calibration, args.hardware)
    for name, why in unfit.items():
        print(f"not simulated: {name}: {why}")
    if len(unfit) == len(experiments):
        raise ValueError("no experiment can be simulated as measured (see the lines above)")
    experiments = [e for e in experiments if e.name not in unfit]
    results = fidelity_results(experiments, args.calibration, args.hardware, args.jobs, args.max_duration, args.seed,
                               executor=args.executor, address=args.ray_address)
    table = results_table(results, experiments)
    summary = fidelity_summary(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "fidelity.csv", index=False)
    wall = time.perf_counter() - t0
    meta = {"measurements": [str(m) for m in args.measurements], "calibration": args.calibration,
            "hardware": args.hardware, "max_duration_s": args.max_duration, "seed": args.seed, "wall_s": wall,
            "not_simulated": unfit}
    (out / "fidelity.json").write_text(json.dumps({**meta, **summary}, indent=1, default=float) + "\n")
    fidelity_figure(table, out / "fidelity.png", f"pagesim fidelity ({cost})")
    print(format_table(table))
    print()
    print(format_summary(summary))
    if unfit:
        print(f"not simulated ({len(unfit)} experiments, in fidelity.json): {', '.join(unfit)}")
    print(f"\n{len(table)} comparisons; wall time {wall:.1f} s; wrote {out}/fidelity.csv, fidelity.json, fidelity.png")
    return 0
