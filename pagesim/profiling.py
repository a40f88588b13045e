"""`pagesim profile`: calibration, step 1 (wiring). A grid of batch compositions timed on a real
model (backend.profiler), or the iterations of earlier live runs (sim.profiled), fitted to the
profiled cost model and written as a profile file with its fit plot. torch is imported only when a
grid is timed."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.plots import profile_fit_plot
from pagesim.argtypes import out_file, positive_int, seed
from pagesim.cli_args import add_device_args, require_backend
from sim.profiled import make_profile, measurements_from_runs, save_profile


def add_parser(sub: argparse._SubParsersAction) -> None:
    prof = sub.add_parser("profile", help="time a grid of batch compositions on a real model and fit a cost model",
                          description="Calibration, step 1: run a grid of iterations (decodes, prefills with and "
                                      "without a cached prefix, mixed, swaps, copies) on a real model, fit the "
                                      "profiled cost model, and write a profile file (JSON) plus a fit plot.")
    prof.add_argument("--model", default="smollm2-135m",
                      help="smollm2-135m (real weights), a HF directory, a config.json, a catalogue name or a HF id in "
                        "--models-dir (random weights)")
    add_device_args(prof)
    prof.add_argument("--block-size", type=positive_int, default=16)
    prof.add_argument("--grid", choices=("default", "quick"), default="default",
                      help="default (35 points, about 2 minutes for SmolLM2 on 2 CPU cores) or quick (a dozen tiny ones, for smoke tests)")
    prof.add_argument("--reps", type=positive_int, help="timed repetitions per point (median kept; default 3)")
    prof.add_argument("--block-sizes", type=positive_int, nargs="+", default=[], metavar="BS",
                      help="also time every decode point at these block sizes, so that the fit can price "
                           "KV blocks apart from tokens (what makes small blocks slow)")
    prof.add_argument("--seed", type=seed, default=0)
    prof.add_argument("--from-run", nargs="+", metavar="DIR",
                      help="fit to the iterations of earlier `pagesim live` runs instead of running a grid "
                           "(their measured step times, scheduling included)")
    prof.add_argument("--out", required=True, type=out_file,  # checked now, not after minutes of profiling
                      help="profile file to write (.json); the fit plot goes beside it")
    prof.add_argument("--quiet", action="store_true")
    prof.set_defaults(func=command)


@dataclass
class Profiled:
    """A written profile: its fit, the profile file and the plot beside it, and what was measured."""

    fit: dict[str, Any]
    path: Path
    plot: Path
    meta: dict[str, Any]
    skipped: list[str] = dataclasses.field(default_factory=list)  # grid points the device could not run


def command(args: argparse.Namespace) -> int:
    if args.from_run:
        print_from_runs(run_from_runs(args))
        return 0
    print_grid(args, run_grid(args, on_start=lambda text: print(text)))
    return 0


def run_from_runs(args: argparse.Namespace) -> Profiled:
    """`--from-run`: a profile fitted to live runs' iteration tables."""

    measurements, meta = measurements_from_runs(args.from_run, args.block_size)
    return write_profile(measurements, meta, args)


def print_from_runs(p: Profiled) -> None:
    print(f"fitted to {p.fit['num_points']} live iterations of {len(p.meta['runs'])} run(s): mean error "
          f"{p.fit['mape']:.1%}, held-out (5-fold) {p.fit['cv_mape']:.1%}")
    print(f"wrote {p.path} and {p.plot}")


def run_grid(args: argparse.Namespace, on_start=None) -> Profiled:
    """The grid timed on the model and fitted; `on_start(line)` says what is about to be timed."""
    live = require_backend()
    # deferred: the backend imports torch
    from backend.model_runner import ModelRunner
    from backend.profiler import ProfileGrid, environment, profile_model

    grid = ProfileGrid.quick() if args.grid == "quick" else ProfileGrid()
    if args.reps is not None:
        if args.reps < 1:
            raise ValueError(f"--reps: must be >= 1, got {args.reps}")
        grid = dataclasses.replace(grid, reps=args.reps)
    if any(bs < 1 for bs in args.block_sizes):
        raise ValueError(f"--block-sizes: must be >= 1, got {args.block_sizes}")
    grid = dataclasses.replace(grid, block_sizes=tuple(args.block_sizes))
    points = grid.points()
    model = live.load_model(args.model, seed=args.seed)
    gpu_blocks, cpu_blocks = grid.blocks_needed(args.block_size)
    runner = ModelRunner(model.config, model.weights, args.device, attention=args.attention, block_size=args.block_size,
                         num_gpu_blocks=gpu_blocks, num_cpu_blocks=cpu_blocks)
    extra = sorted(set(grid.block_sizes) - {args.block_size})
    again = f" (decodes also at block sizes {', '.join(map(str, extra))})" if extra else ""
    if on_start is not None:
        on_start(f"profile: {len(points)} points on {args.model} ({runner.dtype}, {args.device}){again}, "
                 f"{grid.reps} timed reps each, then {grid.serve_requests} requests served")
    bar = None
    if not args.quiet:
        from tqdm import tqdm
        bar = tqdm(total=len(points) + bool(grid.serve_requests), unit="point", desc="profiling", leave=False)

    def show(i: int, total: int, m: dict) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{m['label']}: {m['time_s'] * 1e3:.1f} ms", refresh=False)

    run = profile_model(runner, grid, seed=args.seed, on_point=show)
    if bar is not None:
        bar.close()
    profiled = write_profile(run.measurements, environment(runner, model.config.name or args.model), args)
    profiled.skipped = list(run.skipped)
    return profiled


def print_grid(args: argparse.Namespace, p: Profiled) -> None:
    fit = p.fit
    for why in p.skipped:
        print(f"skipped {why}")
    print("fitted step model (seconds per unit):")
    for k, v in fit["coef"].items():
        print(f"  {k:<24} {v:.4g}")
    print(f"fit error over {fit['num_points']} points: mean {fit['mape']:.1%}, max {fit['max_ape']:.1%}, "
          f"held-out (5-fold) mean {fit['cv_mape']:.1%}")
    if "served_mape" in fit:
        print(f"served iterations alone: mean {fit['served_mape']:.1%}, held-out {fit['served_cv_mape']:.1%}")
    print(f"wrote {p.path} and {p.plot}; simulate with `pagesim simulate --model <spec> --profile {p.path}`")


def write_profile(measurements: list[dict], meta: dict, args: argparse.Namespace) -> Profiled:
    """Fit, write the profile file and its fit plot beside it."""

    meta.update(created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="pagesim " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["profile"] else "pagesim profile")
    profile = make_profile(measurements, args.block_size, meta)
    path = save_profile(profile, args.out)
    return Profiled(profile["fit"], path, profile_fit_plot(profile, Path(path).with_suffix(".png")), meta)
