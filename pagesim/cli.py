"""The `pagesim` command line: composition root wiring traces, policies, sim, backend, analysis."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from analysis.report import summary_table
from policies.metrics import write_run
from policies.registry import POLICIES
from sim.specs import HARDWARE, MODELS
from traces.cli import add_trace_parser
from traces.loaders import KNOWN_FORMATS
from traces.synthetic import SYNTHETIC


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default="sharegpt-like",
                   help=f"a trace file, or a synthetic workload: {', '.join(SYNTHETIC)} (default: sharegpt-like)")
    g.add_argument("--trace-format", choices=KNOWN_FORMATS, help="file format (default: detect from columns)")
    g.add_argument("--num-requests", type=int, help="use the first N requests (synthetic default: 1000)")
    g.add_argument("--rate", type=float, help="mean arrival rate, req/s (Poisson; rescales a timestamped trace)")
    g.add_argument("--burstiness", type=float, help="inter-arrival coefficient of variation (Gamma arrivals)")
    g.add_argument("--n", type=int, help="parallel samples per request (overrides the trace)")
    g.add_argument("--beam-width", type=int, help="beam width per request (overrides the trace)")
    g.add_argument("--seed", type=int, default=0, help="seed for every random choice (default 0)")


def add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("policy")
    g.add_argument("--policy", default="vllm", choices=list(POLICIES), help="scheduling policy (default vllm)")
    g.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    g.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=4096)
    g.add_argument("--chunked-prefill", action="store_true")
    g.add_argument("--prefix-caching", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagesim",
        description="LLM-serving policy workbench on paged KV-cache memory: simulate policies over "
                    "traces, run them live on a real model, and compare.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = sub.add_parser("simulate", help="simulate a trace under a policy (SimPy, cost model)",
                         description="Simulate serving a trace; writes requests.csv, iterations.parquet "
                                     "and summary.json to --out.")
    add_workload_args(sim)
    add_policy_args(sim)
    h = sim.add_argument_group("model and hardware")
    h.add_argument("--model", default="opt-13b", help=f"model spec: {', '.join(MODELS)} (default opt-13b)")
    h.add_argument("--hardware", default="a100-40gb", help=f"GPU spec: {', '.join(HARDWARE)} (default a100-40gb)")
    h.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    h.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    h.add_argument("--num-gpu-blocks", type=int, help="override the derived KV capacity (blocks)")
    o = sim.add_argument_group("output")
    o.add_argument("--slo-ttft", type=float, help="TTFT SLO in seconds, for goodput")
    o.add_argument("--slo-tpot", type=float, help="TPOT SLO in seconds, for goodput")
    o.add_argument("--out", required=True, help="output directory")
    o.add_argument("--no-skip-ahead", action="store_true", help="step every iteration (slower, same results)")
    o.add_argument("--debug", action="store_true", help="check block and request conservation every iteration")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    sim.set_defaults(func=cmd_simulate)

    demo = sub.add_parser("demo", help="a quick tour: vllm vs orca-oracle on a sharegpt-like trace")
    demo.add_argument("--num-requests", type=int, default=600)
    demo.add_argument("--rate", type=float, default=1.5)
    demo.add_argument("--out", default="runs/demo")
    demo.set_defaults(func=cmd_demo)

    add_trace_parser(sub)
    return parser


def _sim_config(args: argparse.Namespace, policy: str | None = None):
    from sim.run import SimConfig
    return SimConfig(model=args.model, hardware=args.hardware, tp=args.tp, policy=policy or args.policy,
                     block_size=args.block_size, preemption=args.preemption, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, chunked_prefill=args.chunked_prefill,
                     prefix_caching=args.prefix_caching, gpu_memory_utilization=args.gpu_memory_utilization,
                     num_gpu_blocks=args.num_gpu_blocks, n=args.n, beam_width=args.beam_width, seed=args.seed,
                     slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, fast_forward=not args.no_skip_ahead,
                     debug=args.debug)


def _load_workload(args: argparse.Namespace):
    from traces import resolve_trace
    return resolve_trace(args.trace, num_requests=args.num_requests, rate=args.rate,
                         burstiness=args.burstiness, seed=args.seed, format=args.trace_format)


def cmd_simulate(args: argparse.Namespace) -> int:
    from sim.run import run_simulation
    trace = _load_workload(args)
    cfg = _sim_config(args)
    result = run_simulation(cfg, trace, progress=not args.quiet)
    out = write_run(args.out, result.requests, result.iterations, result.summary)
    print(summary_table({cfg.policy: result.summary}))
    print(f"\nwrote {out}/requests.csv, iterations.parquet, summary.json")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from sim.run import SimConfig, run_simulation
    from traces import resolve_trace
    trace = resolve_trace("sharegpt-like", num_requests=args.num_requests, rate=args.rate, seed=0)
    print(f"pagesim demo: {len(trace)} sharegpt-like requests (synthetic, fitted to the vLLM paper's "
          f"ShareGPT statistics), Poisson at {args.rate} req/s, OPT-13B on one A100-40GB\n")
    summaries = {}
    for policy in ("vllm", "orca-oracle"):
        result = run_simulation(SimConfig(policy=policy), trace, progress=True)
        write_run(f"{args.out}/{policy}", result.requests, result.iterations, result.summary)
        summaries[policy] = result.summary
    print(summary_table(summaries))
    print(f"\nper-request and per-iteration tables in {args.out}/<policy>/; try `pagesim simulate --help`")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagesim: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
