"""`pagesim calibrate`: the calibrated roofline of a hardware x engine pair fitted to measurements
(analysis.calibrate)."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from concurrent.futures import ProcessPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

from analysis import calibrate as calibration
from analysis.measurement_files import load_measurements
from pagesim.argtypes import non_negative_float, out_file, positive_float, positive_int, seed
from sim.calibrated import Calibration, save_calibration
from sim.specs import get_hardware


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate", help="fit the calibrated roofline of a hardware x engine pair to measurements",
        description="Fit the calibrated roofline's operator terms to kernel times (--operators) and its engine "
                    "terms to measured serving runs by simulating them; write the calibration (JSON), its "
                    "errors in sample and left out, and a predicted-vs-measured plot beside it.")
    p.add_argument("--measurements", nargs="+", required=True, help="measurement files (analysis/measurements.py)")
    p.add_argument("--hardware", required=True, help="the GPU the measurements ran on (a hardware spec name)")
    p.add_argument("--models-dir", action="append", help="folder of config.json files for the measured models")
    p.add_argument("--operators", default=None,
                   help="folder of per-operator kernel times (<gpu>_<model>_mlp.csv, <gpu>_dgx_all_reduce.csv); "
                        "default ../shared/calibration/vidur-operators when it exists")
    p.add_argument("--out", required=True, type=out_file,
                   help="calibration file to write (.json); the plot goes beside it")
    p.add_argument("--name", help="the calibration's name (default: the file's stem)")
    p.add_argument("--leave-one-out", choices=("model", "experiment"), default="model",
                   help="refit without each model (default) or experiment and predict it")
    p.add_argument("--no-leave-one-out", action="store_true", help="skip the left-out fits")
    p.add_argument("--max-duration", type=positive_float, default=40.0,
                   help="seconds of each stage's arrivals simulated while fitting (default 40)")
    p.add_argument("--eval-duration", type=non_negative_float, default=300.0,
                   help="seconds of arrivals simulated for the reported errors (default 300; 0: whole stages)")
    p.add_argument("--max-evals", type=positive_int, default=8,
                   help="least-squares steps per fit (default 8; each simulates every stage 1 + parameters times)")
    p.add_argument("--jobs", type=positive_int, default=2, help="stages simulated at once (worker processes, default 2)")
    p.add_argument("--seed", type=seed, default=0)
    p.set_defaults(func=command)
    return p


def command(args: argparse.Namespace) -> int:
    hardware = get_hardware(args.hardware).name
    experiments = load_measurements(args.measurements, args.models_dir)
    operators = args.operators
    default_ops = Path("../shared/calibration/vidur-operators")
    if operators is None and default_ops.is_dir():
        operators = str(default_ops)
    start, op_report = calibration.operator_params(operators, hardware)
    print(f"operator terms from {operators or 'priors'}: " + ", ".join(
        f"{k} {v:.3g}" for k, v in op_report.items() if isinstance(v, float)))
    fit_refs, over_refs = calibration.split_stages(experiments, args.leave_one_out)
    print(f"{len(fit_refs)} stages to fit, {len(over_refs)} overloaded to check")
    eval_s = args.eval_duration or None
    pool = ProcessPoolExecutor(args.jobs) if args.jobs > 1 else None
    try:
        params = calibration.fit_engine(fit_refs, start, hardware, calibration.ENGINE_PARAMS, args.seed,
                                        args.max_duration, args.max_evals, pool)
        print("fitted: " + ", ".join(f"{n} {getattr(params, n):.4g}" for n in calibration.ENGINE_PARAMS))
        in_sample = calibration.simulate_all(fit_refs, params, hardware, args.seed, eval_s, pool)
        overloaded = calibration.simulate_all(over_refs, params, hardware, args.seed, eval_s, pool)
        loo = None if args.no_leave_one_out else calibration.leave_one_out(
            fit_refs, start, hardware, calibration.ENGINE_PARAMS, args.seed, args.max_duration, eval_s,
            args.max_evals, pool, print)
    finally:
        if pool is not None:
            pool.shutdown()
    ins = calibration.error_table(in_sample)
    checks = [{"stage": f"{r.experiment}#{r.stage}", "rate": r.rate, "measured_ttft_mean": r.measured.get("ttft_mean"),
               "predicted_ttft_mean": r.predicted.get("ttft_mean"), "predicted_throughput": r.predicted_throughput,
               "predicted_overloaded": r.predicted_overloaded}
              for r in overloaded]
    meta = {
        "engine": calibration.engine_description(experiments),
        "sources": [{"path": str(p), "sha256": calibration.sha256(p)}
                    for p in [*args.measurements, *op_report.get("files", [])]],
        "operators": {k: v for k, v in op_report.items() if k != "files"},
        "fit": {"engine_params": list(calibration.ENGINE_PARAMS), "metrics": list(calibration.FIT_METRICS),
                "seed": args.seed,
                "fit_duration_s": args.max_duration, "eval_duration_s": eval_s, "in_sample": ins,
                "overloaded_checks": checks, "leave_one_out": loo, "leave_one_out_by": args.leave_one_out},
        "command": "pagesim " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["calibrate"] else "pagesim calibrate",
        "pagesim_version": _version(), "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    cal = Calibration(params, hardware, args.name or Path(args.out).stem, meta)
    path = save_calibration(cal, args.out)
    plot = calibration.calibration_plot(in_sample, (loo or {}).get("groups"), Path(path).with_suffix(".png"), cal.name)
    _print_errors("in sample", ins["median_abs_error"])
    if loo:
        _print_errors(f"leave one {args.leave_one_out} out", loo["median_abs_error"])
    for c in checks:
        print(f"overloaded {c['stage']}: simulated {'overloaded' if c['predicted_overloaded'] else 'NOT overloaded'}")
    print(f"wrote {path} and {plot}")
    return 0


def _print_errors(what: str, med: dict[str, float | None]) -> None:
    print(f"{what}: median |error| " + ", ".join(f"{m} {v:.1%}" for m, v in med.items() if v is not None))


def _version() -> str:
    try:
        return version("pagesim")
    except Exception:  # not installed: the version is unknown, not an error
        return "unknown"
