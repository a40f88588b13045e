"""Calibration, last step: serve a trace live on a real model and simulate it with a profiled cost model (same
policy, cache size and arrivals); writes live/ and sim/ runs, validation.csv, validation.json and
validation.png. Serves the first 32 requests unless --num-requests says otherwise. Before serving, it times
a few of the profile's grid points: when this machine runs more than --reprofile-threshold away from the
profile, it re-times the profile's grid here, re-fits it (OUT/profile.json) and simulates with that.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from analysis.benchmark_results import guidellm_requests
from analysis.validate import Validation, run_validation, validation_table
from pagesim import cli_args
from pagesim.argtypes import non_negative_float, positive_int
from pagesim.report_writer import write_run

HELP = "replay one trace live and in simulation; report the simulator's error"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`pagesim validate`: its arguments (the workload, policy and live model ones from pagesim.cli_args)."""
    val = subparsers.add_parser("validate", help=HELP, description=__doc__)
    cli_args.add_workload_args(val)
    cli_args.add_policy_args(val)
    cli_args.add_live_model_args(val)
    val.set_defaults(num_requests=32)  # every request is served live, in real time: keep the default small
    val.add_argument("--profile", required=True, help="profile file (or shipped profile name) for the simulator")
    val.add_argument("--live-run", help="reuse this earlier `pagesim live` or `pagesim serve` output directory instead "
                                        "of serving again (the workload it served is read from its summary.json), "
                                        "or a guidellm result file (its requests and client latencies); the "
                                        "workload options are then unused")
    r = val.add_argument_group("re-profiling (a profile describes the machine it was measured on)")
    r.add_argument("--reprofile-threshold", type=non_negative_float, default=0.1, metavar="FRACTION",
                   help="re-profile when this machine's speed is more than this far from the profile's (default 0.1)")
    r.add_argument("--no-reprofile", action="store_true", help="simulate with the given profile as it is")
    r.add_argument("--reprofile-reps", type=positive_int, default=2,
                   help="timed repetitions per grid point when re-profiling (default 2)")
    cli_args.add_output_args(val)
    val.set_defaults(func=command)
    return val


def command(args: argparse.Namespace) -> int:
    if args.live_run and Path(args.live_run).is_file():  # a benchmark tool's result file: its requests are the trace
        trace = guidellm_requests(args.live_run)[0]
    elif args.live_run:  # an earlier live run: the workload it served, from its summary
        trace = cli_args.load_workload(_with_workload_of(args, Path(args.live_run)))
    else:
        trace = cli_args.load_workload(args)
    # the live run's policy, cache size and workload options, priced by --profile (required here)
    cfg = cli_args.sim_config(args)
    if not args.live_run:
        cli_args.require_backend()  # a clear message without the backend extra
    v = run_validation(trace, cfg, args.out, cli_args.live_options(args), args.live_run,
                       None if args.no_reprofile else args.reprofile_threshold, args.reprofile_reps,
                       progress=not args.quiet, config={k: x for k, x in vars(args).items() if k != "func"},
                       write_run=write_run)
    print_validation(v, reused=bool(args.live_run))
    print(f"wrote {args.out}/validation.csv, validation.json, validation.png, sim/"
          + ("" if args.live_run else ", live/") + (", profile.json" if v.reprofile.adopted and not args.live_run else ""))
    return 0


WORKLOAD_OPTIONS = ("trace", "trace_format", "num_requests", "rate", "burstiness", "n", "beam_width", "seed")


def _with_workload_of(args: argparse.Namespace, run: Path) -> argparse.Namespace:
    """`args` with the workload options of the live run in `run` (its summary.json's config, as
    `pagesim live`, `serve` and `validate` record it): the simulation replays what was served."""
    summary = run / "summary.json"
    if not summary.is_file():
        raise ValueError(f"--live-run {run}: no summary.json there (a `pagesim live` or `validate` run folder)")
    config = json.loads(summary.read_text()).get("config") or {}
    missing = [k for k in ("trace", "rate") if k not in config]
    if missing:
        raise ValueError(f"--live-run {run}: summary.json's config does not record the workload ({', '.join(missing)})")
    return argparse.Namespace(**{**vars(args), **{k: config[k] for k in WORKLOAD_OPTIONS if k in config}})


def print_validation(v: Validation, reused: bool = False) -> None:
    """The terminal report of a validation: the table, the headline errors, the machine speed and
    what was done about it."""
    summary, drift, d = v.summary, v.summary["machine_speed"], v.reprofile
    print(validation_table(v.table))
    print(f"\nmean absolute error over these rows: {summary['mape']:.1%}")
    if reused and d.adopted:
        print(f"simulated with {d.path}, the profile re-fitted with that live run (its machine ran {d.speed:.2f}x "
              f"the step times of {d.given})")
    if v.given is not None:
        g = summary["given_profile_validation"]
        print(f"with the given profile {d.given} instead: mean absolute error {g['mape']:.1%}, max "
              f"{g['max_abs_error']:.1%} (validation_given_profile.csv)")
    if drift.get("before") is not None:
        print(f"machine speed against the profile (profile grid points re-timed, time now / then): "
              f"{drift['before']:.2f} before the live run, {drift['after']:.2f} after")
        if max(abs(drift["before"] - 1), abs(drift["after"] - 1)) > 0.1:
            print("warning: this machine runs more than 10% away from when the profile was measured"
                  + ("; re-profile (pagesim profile, or validate without --no-reprofile) for a fair comparison"
                     if not d.adopted else " (it drifted during or after the re-profile)"))
    if summary["speed_adjusted"]:
        a = summary["speed_adjusted"]
        print(f"with every simulated step scaled by that speed (x{a['factor']:.3f}, geometric mean): "
              f"mean absolute error {a['mape']:.1%}, max {a['max_abs_error']:.1%} "
              "(validation_speed_adjusted.csv; a sensitivity check: it corrects only a drift that holds "
              "through the live run)")
    if v.steps:
        s = v.steps
        print(f"step times, profile vs {s['iterations']} live iterations: mean |error| {s['mape']:.1%} "
              f"(bias {s['bias']:+.1%}); decode-only {s['decode_mape']:.1%}, with prompt tokens "
              f"{s['prompt_mape']:.1%}")
