"""The `pagesim` command line: the composition root. It registers every command (each defined in its own
module under pagesim/), resolves --model and --hardware, and turns bad input into one line."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from pagesim import generate, live, profiling
from pagesim.commands import (
    beams,
    block_size,
    calibrate,
    capacity,
    disagg,
    fidelity,
    policies,
    preemption,
    routing,
    sharing,
    simulate,
    sweep,
    validate,
)
from pagesim.commands.trace import add_trace_parser
from pagesim.serve import add_serve_parser
from specs import load_hardware, resolve_model_name
from specs.catalogue import catalogue_name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagesim",
        description="LLM-serving policy workbench on paged KV-cache memory: simulate policies over "
                    "traces, run them live on a real model, and compare.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # every command's parser and run function live in its own module (pagesim/commands/, and
    # pagesim/{live,profiling,generate,serve}.py), each adding its own; registered in the order
    # `pagesim --help` lists them
    for add_parser in (simulate.add_parser, live.add_parser, profiling.add_parser, validate.add_parser, generate.add_parser,
                       add_serve_parser, sweep.add_parser, sharing.add_parser, routing.add_parser, capacity.add_parser,
                       disagg.add_parser, block_size.add_parser, preemption.add_parser, beams.add_parser,
                       fidelity.add_parser, add_trace_parser, calibrate.add_parser, policies.add_parser):
        add_parser(sub)
    for p in sub.choices.values():  # every command that takes --model can look up HF ids
        if "--model" in p._option_string_actions:
            p.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                           help="a folder of HF configs (<name>.json or <name>/config.json) where a HF id given "
                                "as --model is looked up (repeatable)")
    return parser


def _resolve_specs(args: argparse.Namespace) -> None:
    """Load --model and --hardware before any work, so a bad one fails in one line; a HF id found in
    --models-dir (or beside the path given) becomes that config file's path, a variant's id the name
    that finds it again (`resolve_model_name`)."""
    model = getattr(args, "model", None)
    if isinstance(model, str) and model:
        # raises, naming the file and field or what was tried
        resolved = resolve_model_name(model, list(getattr(args, "models_dir", None) or []))
        entry = catalogue_name(model)
        if not Path(model).exists() and entry is None:  # a HF id: its config, or a variant's
            args.model = resolved
        elif entry not in (None, model):  # an alias: runs record the name it stands for
            args.model = _say_resolved("model", model, entry)
    hardware = getattr(args, "hardware", None)
    if isinstance(hardware, str) and hardware:
        spec = load_hardware(hardware)
        if not Path(hardware).exists() and spec.name != hardware:
            args.hardware = _say_resolved("hardware", hardware, spec.name)


def _say_resolved(what: str, given: str, name: str) -> str:
    print(f"pagesim: {what} {given!r} is {name}", file=sys.stderr)
    return name


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():  # restores Python's own printing when the command returns
        warnings.showwarning = _one_line_warning(args.command)
        try:
            _resolve_specs(args)
            return int(args.func(args) or 0)
        except (ValueError, OSError) as exc:  # bad input, or a file that cannot be read or written
            print(f"pagesim {args.command}: error: {exc}", file=sys.stderr)  # as argparse words its errors
            return 2


def _one_line_warning(command: str):
    """A warning printed as one line in the tool's voice (`pagesim simulate: warning: ...`), without
    Python's category, source file and line."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"pagesim {command}: warning: {message}", file=file or sys.stderr)
    return show


if __name__ == "__main__":
    sys.exit(main())
