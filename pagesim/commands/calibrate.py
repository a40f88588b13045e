"""`pagesim calibrate`: the calibrated roofline of a hardware x engine pair fitted to measurements
(analysis.calibrate)."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

from analysis import calibrate as calibration
from analysis.measurement_files import load_measurements
from analysis.measurements import Experiment, StageResult
from analysis.request_runs import format_report, stage_reports
from analysis.transfer import OPERATOR_TERMS, transfer_calibration
from pagesim.argtypes import non_negative_float, out_file, positive_float, positive_int, seed
from pagesim.cli_args import add_server_args, server_settings
from sim.calibrated import Calibration, load_calibration, save_calibration
from sim.specs import get_hardware


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate", help="fit the calibrated roofline of a hardware x engine pair to measurements",
        description="Fit the calibrated roofline's operator terms to kernel times (--operators) and its engine "
                    "terms to measured serving runs by simulating them; write the calibration (JSON), its "
                    "errors in sample and left out, and a predicted-vs-measured plot beside it.")
    p.add_argument("--measurements", nargs="+", help="measurement files or run folders (analysis/measurements.py); "
                                                    "required unless --engine-from")
    p.add_argument("--engine-from", metavar="CALIBRATION",
                   help="a GPU without end-to-end measurements: operator terms from --operators (its kernel "
                        "profiles), the engine and client terms carried from this calibration (file or shipped "
                        "name) of the same engine; nothing is simulated (analysis/transfer.py)")
    p.add_argument("--hardware", required=True, help="the GPU the measurements ran on (a hardware spec name)")
    p.add_argument("--models-dir", action="append", help="folder of config.json files for the measured models")
    p.add_argument("--operators", default=None,
                   help="folder of per-operator kernel times: Vidur's (<gpu>_<model>_mlp.csv, "
                        "<gpu>_dgx_all_reduce.csv) or vLLM layer-wise profiles (profiler/perf/<GPU>/<org>/<model>/"
                        "<variant>/tp<N>/dense.csv, ...); default ../shared/calibration/vidur-operators when it exists")
    p.add_argument("--out", required=True, type=out_file,
                   help="calibration file to write (.json); the plot goes beside it")
    p.add_argument("--name", help="the calibration's name (default: the file's stem)")
    p.add_argument("--leave-one-out", choices=("model", "experiment"), default="model",
                   help="refit without each model (default) or experiment and predict it")
    p.add_argument("--no-leave-one-out", action="store_true", help="skip the left-out fits")
    p.add_argument("--max-duration", type=positive_float, default=40.0,
                   help="seconds of each stage's arrivals counted while fitting (default 40), after a warm-up "
                        "prompt cycle where the stage cycles its prompts, as `pagesim fidelity --max-duration`")
    p.add_argument("--eval-duration", type=non_negative_float, default=300.0,
                   help="seconds of arrivals counted for the reported errors (default 300; 0: whole stages): the "
                        "in-sample predictions are `pagesim fidelity --max-duration` S's (whole stages: its default)")
    p.add_argument("--converge", type=positive_float, metavar="TOL", default=None,
                   help="run the least squares until a step moves the log parameters by under TOL (relative; "
                        "e.g. 1e-3) or the loss by under TOL/10, at most --max-evals steps (then give a larger "
                        "one); default: stop after --max-evals steps")
    p.add_argument("--max-evals", type=positive_int, default=8,
                   help="least-squares steps per fit (default 8; each simulates every stage 1 + parameters times)")
    p.add_argument("--starts", type=positive_int, default=calibration.MultiStart.starts,
                   help="fit from this many starts (the operator fit and priors, then seeded points within a factor "
                        "--spread of them), each coarsely; refine the one with the lowest objective (default "
                        f"{calibration.MultiStart.starts}; 1: one fit from the start)")
    p.add_argument("--spread", type=positive_float, default=calibration.MultiStart.spread,
                   help="the seeded starts lie within this factor of the priors, per term "
                        f"(default {calibration.MultiStart.spread:g}; >= 1)")
    p.add_argument("--coarse-duration", type=positive_float, default=calibration.MultiStart.coarse_duration_s,
                   help="seconds of each stage's arrivals simulated in the coarse fits "
                        f"(default {calibration.MultiStart.coarse_duration_s:g})")
    p.add_argument("--coarse-evals", type=positive_int, default=calibration.MultiStart.coarse_evals,
                   help=f"least-squares steps per coarse fit (default {calibration.MultiStart.coarse_evals})")
    p.add_argument("--coarse-race", type=non_negative_float, default=calibration.MultiStart.race_factor,
                   metavar="FACTOR", help="stop a coarse start whose objective after a step is more than FACTOR times "
                                          "the lowest after the same step and would stay above it after one more "
                                          "step improving as much as its last (default "
                                          f"{calibration.MultiStart.race_factor:g}; 0: every start runs its coarse steps)")
    p.add_argument("--prior-weight", type=non_negative_float, default=calibration.PRIOR_WEIGHT,
                   help="pull of each fitted server term towards its prior (the operator fit's value, else "
                        "CalibrationParams'): residual weight x log(term / prior), next to the log errors "
                        f"(default {calibration.PRIOR_WEIGHT:g}: a factor e costs what one metric 1%% off does; 0: none)")
    p.add_argument("--jobs", type=positive_int, default=2, help="stages simulated at once (worker processes, default 2)")
    p.add_argument("--seed", type=seed, default=0)
    add_server_args(p)
    p.set_defaults(func=command)
    return p


def command(args: argparse.Namespace) -> int:
    if args.engine_from:
        return transfer_command(args)
    if not args.measurements:
        raise ValueError("--measurements: required (or --engine-from CALIBRATION with --operators, for a GPU with "
                         "kernel profiles only)")
    hardware = get_hardware(args.hardware).name
    experiments = load_measurements(args.measurements, args.models_dir, server_settings(args))
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
    if args.spread < 1:
        raise ValueError(f"--spread: a factor >= 1 expected, got {args.spread:g}")
    if 0 < args.coarse_race < 1:
        raise ValueError(f"--coarse-race: 0 or a factor >= 1 expected, got {args.coarse_race:g}")
    multi = calibration.MultiStart(args.starts, args.spread, args.coarse_duration, args.coarse_evals,
                                   race_factor=args.coarse_race)
    prior = calibration.Prior(start, args.prior_weight) if args.prior_weight > 0 else None
    pool = ProcessPoolExecutor(args.jobs) if args.jobs > 1 else None
    try:
        outcome: dict[str, Any] = {}
        params = calibration.fit_multistart(fit_refs, start, hardware, calibration.ENGINE_PARAMS, args.seed,
                                            args.max_duration, args.max_evals, pool, tolerance=args.converge,
                                            outcome=outcome, prior=prior, multi=multi)
        print("fitted: " + ", ".join(f"{n} {getattr(params, n):.4g}" for n in calibration.ENGINE_PARAMS))
        in_sample = calibration.simulate_all(fit_refs, params, hardware, args.seed, eval_s, pool)
        overloaded = calibration.simulate_all(over_refs, params, hardware, args.seed, eval_s, pool)
        loo = None if args.no_leave_one_out else calibration.leave_one_out(
            fit_refs, start, hardware, calibration.ENGINE_PARAMS, args.seed, args.max_duration, eval_s,
            args.max_evals, pool, print, args.converge, prior, multi)
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
                    for p in [*calibration.source_files(args.measurements), *op_report.get("files", [])]],
        "operators": {k: v for k, v in op_report.items() if k != "files"},
        "fit": {"engine_params": list(calibration.ENGINE_PARAMS), "metrics": list(calibration.fit_metrics()),
                "seed": args.seed, "fit_duration_s": args.max_duration, "eval_duration_s": eval_s,
                "least_squares": outcome, "in_sample": ins,
                "overloaded_checks": checks, "leave_one_out": loo, "leave_one_out_by": args.leave_one_out},
        **_provenance(),
    }
    cal = Calibration(params, hardware, args.name or Path(args.out).stem, meta)
    path = save_calibration(cal, args.out)
    plot = calibration.calibration_plot(in_sample, (loo or {}).get("groups"), Path(path).with_suffix(".png"), cal.name)
    _print_errors("in sample", ins["median_abs_error"])
    print_request_runs(experiments, in_sample)
    if loo:
        _print_errors(f"leave one {args.leave_one_out} out", loo["median_abs_error"])
    for c in checks:
        print(f"overloaded {c['stage']}: simulated {'overloaded' if c['predicted_overloaded'] else 'NOT overloaded'}")
    print(f"wrote {path} and {plot}")
    return 0


def print_request_runs(experiments: list[Experiment], results: list[StageResult]) -> None:
    """In-sample per-request runs compared request by request and over time (analysis/request_runs.py)."""
    for report in stage_reports(experiments, results):
        print(format_report(report))


def transfer_command(args: argparse.Namespace) -> int:
    """`calibrate --engine-from`: analysis/transfer.py, with the sources and the kernel fits' errors."""
    if args.measurements:
        raise ValueError("--engine-from: carries a calibration's engine terms instead of fitting them to "
                         "--measurements; give one or the other")
    if not args.operators:
        raise ValueError("--engine-from: needs --operators (the new GPU's kernel profiles)")
    hardware = get_hardware(args.hardware).name
    base = load_calibration(args.engine_from)
    _, report = calibration.operator_params(args.operators, hardware)
    fitted = {k: report[k] for k in OPERATOR_TERMS if k in report}
    cal = transfer_calibration(base, fitted, str(args.operators), hardware, args.name or Path(args.out).stem)
    errors = {k: v for k, v in report.items() if k.endswith("_median_abs_error")}
    cal.meta.update({
        "sources": [{"path": os.path.relpath(p), "sha256": calibration.sha256(p)}
                    for p in [base.source, *report.get("files", [])]],
        "operators": {k: v for k, v in report.items() if k != "files"},
        "errors": {"kernel_fits_median_abs_error": errors,
                   "end_to_end": None, "note": "no end-to-end measurement on this GPU: the carried terms' own errors "
                                               "are those of carried_from"},
        **_provenance(),
    })
    path = save_calibration(cal, args.out)
    for term, where in cal.meta["provenance"].items():
        print(f"{term:<26} {getattr(cal.params, term):<12.4g} {where}")
    print(f"wrote {path}")
    return 0


def _provenance() -> dict[str, str]:
    """The command that made a calibration, pagesim's version and when."""
    return {"command": "pagesim " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["calibrate"] else "pagesim calibrate",
            "pagesim_version": _version(), "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def _print_errors(what: str, med: dict[str, float | None]) -> None:
    print(f"{what}: median |error| " + ", ".join(f"{m} {v:.1%}" for m, v in med.items() if v is not None))


def _version() -> str:
    try:
        return version("pagesim")
    except Exception:  # not installed: the version is unknown, not an error
        return "unknown"
