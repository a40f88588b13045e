"""`pagesim policies`: scheduling policies compared over rates and seeds (analysis.policy_study)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from analysis import policy_study
from analysis.policy_study import PolicyStudy, policy_report, run_policy_study
from pagesim.argtypes import out_dir, positive_float, positive_int, rate
from pagesim.cli_args import add_executor_args, study_title, workers
from pagesim.report_writer import write_report
from policies.registry import parse_policy_args, resolve_policy
from sim.run import SimConfig
from traces.workloads import SYNTHETIC


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`pagesim policies`, with its own arguments."""
    p = sub.add_parser("policies", help="compare scheduling policies over rates and seeds: latency, SLOs, fairness",
                       description=policy_study.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="multi-client",
                   help=f"a trace file, or a synthetic workload: {', '.join(SYNTHETIC)} (default multi-client)")
    p.add_argument("--num-requests", type=positive_int, default=1000, help="requests per run (default 1000)")
    p.add_argument("--policies", nargs="+", default=["vllm", "priority", "sjf", "vtc", "edf"],
                   help="registry names or package.module:Class (default: vllm priority sjf vtc edf)")
    p.add_argument("--policy-arg", action="append", metavar="POLICY.KEY=VALUE", dest="policy_args",
                   help="an option of one policy, e.g. sjf.aging=2 or edf.slo_ttft=1 (repeatable)")
    p.add_argument("--rates", type=rate, nargs="+", required=True, help="request rates, req/s")
    p.add_argument("--seeds", type=positive_int, default=3, help="seeds per (policy, rate) (default 3)")
    p.add_argument("--jobs", type=positive_int, default=1, help="worker processes (default 1)")
    add_executor_args(p)
    p.add_argument("--model", default="opt-13b", help="catalogue name, config.json or HF id (default opt-13b)")
    p.add_argument("--hardware", default="a100-40gb", help="name or hardware JSON file (default a100-40gb)")
    p.add_argument("--calibration", help="price iterations with a calibration (file or shipped name)")
    p.add_argument("--num-gpu-blocks", type=positive_int, help="override the derived KV capacity (blocks)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=4096)
    p.add_argument("--chunked-prefill", action="store_true")
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--slo-ttft", type=positive_float, help="TTFT SLO (s) for requests without their own SLO class")
    p.add_argument("--slo-tpot", type=positive_float, help="TPOT SLO (s) for requests without their own SLO class")
    p.add_argument("--out", type=out_dir, required=True, help="output folder")
    p.set_defaults(func=command)


def split_policy_args(items: list[str] | None, policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`policy.key=value` items grouped by policy (the policy must be one of those compared)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        name, dot, rest = item.partition(".")
        if not dot or name not in policies:
            raise ValueError(f"--policy-arg {item!r}: expected POLICY.KEY=VALUE with POLICY one of "
                             f"{', '.join(policies)}")
        out.setdefault(name, {}).update(parse_policy_args([rest]))
    return out


def study(args: argparse.Namespace) -> PolicyStudy:
    if args.seeds < 1 or args.num_requests < 1 or args.jobs < 1 or min(args.rates) <= 0:
        raise ValueError("--seeds, --num-requests and --jobs must be >= 1 and every rate > 0")
    for name in args.policies:
        resolve_policy(name)  # an unknown name fails here, before the command prints its header
    options = split_policy_args(args.policy_args, args.policies)
    base = SimConfig(model=args.model, hardware=args.hardware, num_gpu_blocks=args.num_gpu_blocks,
                     chunked_prefill=args.chunked_prefill, prefix_caching=args.prefix_caching,
                     max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, calibration=args.calibration)
    return PolicyStudy(args.trace, args.num_requests, base, args.policies, args.rates, args.seeds, options,
                       workers(args), study_title(args))


def command(args: argparse.Namespace) -> int:
    s = study(args)
    print(f"policies: {args.num_requests} requests of {args.trace} x {len(args.rates)} rates x {args.seeds} seeds, "
          f"{', '.join(args.policies)}, {s.title}")
    print(f"{'policy':<12} {'rate':>6} {'seed':>4} {'req/s':>7} {'norm lat':>9} {'TTFT p90':>9} {'SLO ok':>7} "
          f"{'Jain':>6} {'wall s':>7}")
    write_report(policy_report(s, run_policy_study(s, on_row=print_row)), args.out)
    return 0


def print_row(r: dict) -> None:
    print(f"{r['policy'][:12]:<12} {r['rate']:>6.2f} {r['seed']:>4} {r['throughput']:>7.3f} "
          f"{r['mean_normalized_latency']:>9.4f} {r['ttft_p90']:>9.3f} {r['slo_attainment']:>7.1%} "
          f"{r['jain_service']:>6.3f} {r['wall_s']:>7.2f}", flush=True)
