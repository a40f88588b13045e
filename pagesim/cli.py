"""The `pagesim` command line: composition root wiring traces, policies, sim, backend, analysis."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from analysis.report import replica_table, summary_table
from pagesim import cli_args, generate, live, profiling
from pagesim.argtypes import fraction, non_negative_int, out_dir, positive_int, rate
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
    sweep,
    validate,
)
from pagesim.commands.trace import add_trace_parser
from pagesim.report_writer import write_run
from pagesim.serve import add_serve_parser
from sim.specs import HARDWARE, MODELS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagesim",
        description="LLM-serving policy workbench on paged KV-cache memory: simulate policies over "
                    "traces, run them live on a real model, and compare.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = sub.add_parser("simulate", help="simulate a trace under a policy (SimPy, cost model)",
                         description="Simulate serving a trace; writes requests.csv, iterations.parquet "
                                     "and summary.json to --out.")
    cli_args.add_workload_args(sim)
    cli_args.add_policy_args(sim)
    h = sim.add_argument_group("model and hardware")
    h.add_argument("--model", default="opt-13b", help=f"model: {', '.join(MODELS)}, a HF config.json, a folder with "
                                                     "one, or a HF id found in --models-dir (default opt-13b)")
    h.add_argument("--hardware", default="a100-40gb", help=f"GPU spec: {', '.join(HARDWARE)}, or a hardware JSON file "
                                                          "(default a100-40gb)")
    h.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (default 1)")
    h.add_argument("--gpu-memory-utilization", type=fraction, default=0.9)
    h.add_argument("--num-gpu-blocks", type=positive_int, help="override the derived KV capacity (blocks)")
    h.add_argument("--num-cpu-blocks", type=non_negative_int, help="override the swap space (blocks; default 4 GiB)")
    h.add_argument("--cost-model", choices=("roofline", "profiled"), default="roofline",
                   help="roofline (analytic, from --model and --hardware) or profiled (fitted, needs --profile)")
    h.add_argument("--profile", help="a profile file from `pagesim profile`, or a shipped profile's name "
                                     "(implies --cost-model profiled)")
    h.add_argument("--calibration", help="price iterations with the calibrated roofline: a calibration file from "
                                         "`pagesim calibrate`, or a shipped one's name (vllm-v1-h100)")
    cli_args.add_replica_args(sim)
    o = cli_args.add_output_args(sim)
    o.add_argument("--no-skip-ahead", action="store_true", help="step every iteration (slower, same results)")
    o.add_argument("--debug", action="store_true", help="check block and request conservation every iteration")
    sim.set_defaults(func=cmd_simulate)

    demo = sub.add_parser("demo", help="a quick tour: vllm vs orca-oracle on a sharegpt-like trace")
    demo.add_argument("--num-requests", type=positive_int, default=600)
    demo.add_argument("--rate", type=rate, default=1.5)
    demo.add_argument("--out", type=out_dir, default="runs/demo")
    demo.set_defaults(func=cmd_demo)

    # every other command's parser and run function live in its own module (pagesim/commands/, and
    # pagesim/{live,profiling,generate,serve}.py), each adding its own; registered in the order
    # `pagesim --help` lists them
    for add_parser in (live.add_parser, profiling.add_parser, validate.add_parser, generate.add_parser,
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
    from pathlib import Path

    from specs import load_hardware, resolve_model_name
    from specs.catalogue import catalogue_name
    model = getattr(args, "model", None)
    if isinstance(model, str) and model:
        # raises, naming the file and field or what was tried
        resolved = resolve_model_name(model, list(getattr(args, "models_dir", None) or []))
        if not Path(model).exists() and catalogue_name(model) is None:  # a HF id: its config, or a variant's
            args.model = resolved
    hardware = getattr(args, "hardware", None)
    if isinstance(hardware, str) and hardware:
        load_hardware(hardware)


def cmd_simulate(args: argparse.Namespace) -> int:
    from sim.run import run_simulation
    if args.transfer_bandwidth is not None and not args.disaggregate:  # else ignored without a word
        raise ValueError("--transfer-bandwidth is the prefill -> decode KV link: it applies with --disaggregate only")
    cfg = cli_args.sim_config(args)  # first: a bad setting fails before the trace is read
    trace = cli_args.load_workload(args)
    result = run_simulation(cfg, trace, progress=not args.quiet)
    out = write_run(args.out, result.requests, result.iterations, result.summary)
    print(summary_table({cfg.policy: result.summary}))
    if cfg.replicas > 1:
        print("\n" + replica_table(result.summary))
    if cfg.disaggregate:
        d = result.summary["disaggregated"]
        print(f"\ndisaggregated: {d['prefill_replicas']} prefill + {d['decode_replicas']} decode replicas, KV link "
              f"{d['transfer_bandwidth'] / 1e9:g} GB/s; {d['transfers']:,} transfers, mean {d['transfer_s']['mean'] * 1e3:.2f} ms "
              f"(max {d['transfer_s']['max'] * 1e3:.2f}); {d['decode_recomputed_tokens']:,} prompt tokens recomputed on "
              f"decode replicas")
    print(f"\nwrote {out}/requests.csv, iterations.parquet, summary.json")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from sim.run import run_simulation
    from traces import resolve_trace
    cli_args.check_workload_size("sharegpt-like", args.num_requests)
    trace = resolve_trace("sharegpt-like", num_requests=args.num_requests, rate=args.rate, seed=0)
    print(f"pagesim demo: {len(trace)} sharegpt-like requests (synthetic, fitted to the vLLM paper's "
          f"ShareGPT statistics), Poisson at {args.rate} req/s, OPT-13B on one A100-40GB\n")
    summaries = {}
    for policy in ("vllm", "orca-oracle"):
        result = run_simulation(cli_args.sim_config(args, policy=policy), trace, progress=True)  # the defaults otherwise
        write_run(f"{args.out}/{policy}", result.requests, result.iterations, result.summary)
        summaries[policy] = result.summary
    print(summary_table(summaries))
    print(f"\nper-request and per-iteration tables in {args.out}/<policy>/; try `pagesim simulate --help`")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _resolve_specs(args)
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # bad input, or a file that cannot be read or written
        print(f"pagesim {args.command}: error: {exc}", file=sys.stderr)  # as argparse words its errors
        return 2


if __name__ == "__main__":
    sys.exit(main())
