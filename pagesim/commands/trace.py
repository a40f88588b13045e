"""``trace`` subcommands: ``trace generate`` writes a synthetic trace, ``trace info`` summarises one.

The main CLI calls ``add_trace_parser(subparsers)``; each leaf parser sets ``func`` to a handler
that takes the parsed namespace and returns a process exit code (0 ok, 1 bad input, 2 bad usage).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from traces.arrivals import apply_arrivals
from traces.loaders import KNOWN_FORMATS, TraceFormatError, load_trace
from traces.workloads import SYNTHETIC, make_synthetic

# Options that only some kinds take: kind -> generator keyword arguments it accepts.
KIND_OPTIONS: dict[str, tuple[str, ...]] = {
    "fixed": ("prompt_len", "output_len"),
    "shared-prefix": ("num_prefixes", "prefix_len", "suffix_len", "output_len", "hash_block_size"),
    "grouped-prefix": ("num_groups", "prompts_per_group", "system_prompt_len", "question_len", "output_len",
                       "hash_block_size"),
}
ALL_KIND_OPTIONS = ("prompt_len", "output_len", "num_prefixes", "prefix_len", "suffix_len", "hash_block_size",
                    "num_groups", "prompts_per_group", "system_prompt_len", "question_len")


def add_trace_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``trace generate`` and ``trace info`` under ``subparsers``; return the ``trace`` parser."""
    trace = subparsers.add_parser("trace", help="generate or inspect request traces")
    sub = trace.add_subparsers(dest="trace_command", required=True)
    _add_generate(sub)
    _add_info(sub)
    return trace


def _add_generate(sub: Any) -> None:
    gen = sub.add_parser("generate", help="write a synthetic trace (.csv or .parquet)")
    gen.add_argument("--kind", required=True, choices=sorted(SYNTHETIC), help="synthetic workload")
    gen.add_argument("--num-requests", type=int, required=True)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--rate", type=float, help="requests/s; without it the trace has no timestamps")
    gen.add_argument("--burstiness", type=float,
                     help="inter-arrival CV (Gamma); 1 = Poisson, 0 = constant (evenly spaced at 1/rate)")
    gen.add_argument("--out", required=True, help="output file, .csv or .parquet")
    kinds = gen.add_argument_group("kind-specific options (fixed, shared-prefix, grouped-prefix)")
    kinds.add_argument("--prompt-len", type=int, help="fixed")
    kinds.add_argument("--output-len", type=int, help="fixed, shared-prefix, grouped-prefix")
    kinds.add_argument("--num-prefixes", type=int, help="shared-prefix: distinct prefixes")
    kinds.add_argument("--prefix-len", type=int, help="shared-prefix: tokens per prefix")
    kinds.add_argument("--suffix-len", type=int, help="shared-prefix: private tokens per request")
    kinds.add_argument("--hash-block-size", type=int, help="shared-prefix, grouped-prefix: tokens per hash block")
    kinds.add_argument("--num-groups", type=int, help="grouped-prefix: groups, each with its own system prompt")
    kinds.add_argument("--prompts-per-group", type=int, help="grouped-prefix: prompts (questions) per group")
    kinds.add_argument("--system-prompt-len", type=int, help="grouped-prefix: tokens per system prompt")
    kinds.add_argument("--question-len", type=int, help="grouped-prefix: tokens per question")
    gen.set_defaults(func=run_generate)


def _add_info(sub: Any) -> None:
    info = sub.add_parser("info", help="summarise a trace file")
    info.add_argument("file")
    info.add_argument("--trace-format", choices=KNOWN_FORMATS, help="default: detect")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(func=run_info)


def _error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def run_generate(args: argparse.Namespace) -> int:
    """Handler of ``trace generate``."""
    given = {k: getattr(args, k) for k in ALL_KIND_OPTIONS if getattr(args, k, None) is not None}
    allowed = KIND_OPTIONS.get(args.kind, ())
    extra = sorted(set(given) - set(allowed))
    if extra:
        flags = ", ".join("--" + k.replace("_", "-") for k in extra)
        return _error(f"{flags} not used by --kind {args.kind}", 2)
    if not 0 <= args.seed < 2**32:
        return _error(f"--seed: must be an integer in [0, 2**32), got {args.seed}", 2)
    if args.num_requests < 1:  # 0 wrote a header-only file that no loader accepts
        return _error(f"--num-requests: must be an integer >= 1, got {args.num_requests}", 2)
    blocked = next((p for p in Path(args.out).parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        return _error(f"--out: {args.out} is inside {blocked}, an existing file", 2)
    try:
        trace = make_synthetic(args.kind, args.num_requests, seed=args.seed, **given)
        if args.rate is not None or args.burstiness is not None:
            trace = apply_arrivals(trace, rate=args.rate, burstiness=args.burstiness, seed=args.seed)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # as every other --out: made when missing
        path = trace.save(args.out)
    except (ValueError, OSError) as exc:
        return _error(str(exc), 1)
    except MemoryError as exc:  # numpy says how much it could not allocate
        return _error(f"--num-requests {args.num_requests:,}: too large for this machine's memory ({exc})", 1)
    print(f"wrote {len(trace)} {args.kind} requests {_timing(args.rate, trace.has_timestamps)} to {path}")
    return 0


def _timing(rate: float | None, has_timestamps: bool) -> str:
    """How the written trace is timed; a kind may draw its own timestamps without --rate
    (multi-client, at 1 req/s in total)."""
    if not has_timestamps:
        return "without timestamps"
    return "with its own timestamps" if rate is None else f"at {rate:g} req/s"


def run_info(args: argparse.Namespace) -> int:
    """Handler of ``trace info``."""
    try:
        trace = load_trace(args.file, format=args.trace_format)
    except (TraceFormatError, OSError) as exc:
        return _error(str(exc), 1)
    # no row to serve leaves the length statistics NaN, which is not JSON: shown as null and "-"
    info = {k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in {"source": trace.source, **trace.info()}.items()}
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_info(info: dict[str, Any]) -> str:
    """A readable table of ``Trace.info()`` output."""
    rows = [
        ("trace", info.get("name", "")),
        ("source", info.get("source", "")),
        ("requests", f"{info['num_requests']:,}"),
    ]
    if info.get("rejected"):
        rows.append(("rejected", f"{info['rejected']:,} requests that cannot be served (e.g. zero tokens)"))
    if info["has_timestamps"]:
        rows += [
            ("duration", f"{_num(info['duration_s'])} s"),
            ("mean rate", f"{_num(info['mean_rate'], 3)} req/s"),
            ("inter-arrival CV", _num(info["interarrival_cv"], 2)),
        ]
    else:
        rows.append(("timestamps", "none (give a rate to replay)"))
    if "prefix_reuse" in info:
        rows.append(("prefix reuse", f"{100 * info['prefix_reuse']:.1f} % of blocks (hash block {info['hash_block_size']})"))
    lines = [f"{key:<17}{value}" for key, value in rows]
    lines += ["", f"{'tokens':<8}" + "".join(f"{c:>10}" for c in ("mean", "p50", "p90", "p99", "max"))]
    for kind in ("prompt", "output"):
        cells = [_num(info[f"{kind}_{c}"], 1 if c == "mean" else 0) for c in ("mean", "p50", "p90", "p99", "max")]
        lines.append(f"{kind:<8}" + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)
