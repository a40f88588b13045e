"""`pagesim simulate` (a trace under a policy, simulated) and `pagesim demo` (a quick tour)."""

from __future__ import annotations

import argparse

from analysis.report import rejection_lines, replica_table, summary_table
from pagesim import cli_args
from pagesim.argtypes import fraction, non_negative_int, out_dir, positive_int, rate
from pagesim.report_writer import write_run
from sim.run import run_simulation
from sim.specs import HARDWARE, MODELS
from traces import resolve_trace


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    o.add_argument("--debug", action="store_true",
                   help="check block and request conservation every iteration, and simulate the run twice, "
                        "stepping and skipping ahead: a plug-in policy or router that breaks its contract is "
                        "named with the decision that differed, or with the stale sequence field it read "
                        "(twice as slow)")
    sim.set_defaults(func=command)

    demo = sub.add_parser("demo", help="a quick tour: vllm vs orca-oracle on a sharegpt-like trace")
    demo.add_argument("--num-requests", type=positive_int, default=600)
    demo.add_argument("--rate", type=rate, default=1.5)
    demo.add_argument("--out", type=out_dir, default="runs/demo")
    demo.set_defaults(func=demo_command)


def command(args: argparse.Namespace) -> int:
    if args.transfer_bandwidth is not None and not args.disaggregate:  # else ignored without a word
        raise ValueError("--transfer-bandwidth is the prefill -> decode KV link: it applies with --disaggregate only")
    cfg = cli_args.sim_config(args)  # first: a bad setting fails before the trace is read
    trace = cli_args.load_workload(args)
    result = run_simulation(cfg, trace, progress=not args.quiet)
    out = write_run(args.out, result.requests, result.iterations, result.summary)
    print(summary_table({cfg.policy: result.summary}))
    for line in rejection_lines(result.requests):
        print(line)
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


def demo_command(args: argparse.Namespace) -> int:
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
