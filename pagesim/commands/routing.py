"""Serve one trace with several replicas under each router at each rate; writes routing.csv and routing.png
(TTFT, normalized latency and prefix-cache hits against rate) to --out. The default workload: 200 shared
4,096-token prefixes, more than one replica's cache holds.
"""

from __future__ import annotations

import argparse

from analysis.report import Columns
from analysis.routing import RoutingStudy, routing_report, run_routing
from pagesim import cli_args
from pagesim.argtypes import non_negative_int, out_dir, positive_int
from pagesim.report_writer import RowPrinter, print_study
from policies.router import MATCH_ROUTERS, ROUTERS
from traces import apply_arrivals
from traces.trace import Trace
from traces.workloads import make_synthetic

HELP = "compare routers across replicas over request rates (simulated)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    rt = sub.add_parser("routing", help=HELP, description=__doc__)
    cli_args.add_study_args(rt, "shared-prefix", [4.0, 8.0, 12.0, 16.0, 24.0])
    cli_args.add_seeds_arg(rt)
    rt.set_defaults(model="llama-3.1-8b", hardware="a100-80gb")
    rt.add_argument("--replicas", type=positive_int, default=4, help="replicas (default 4)")
    rt.add_argument("--replica-hardware", nargs="+", metavar="GPU",
                    help="each replica's GPU spec (sets --replicas; default: all on --hardware)")
    rt.add_argument("--routers", nargs="+", default=["round-robin", "least-loaded", "prefix-affinity", "cache-aware"],
                    type=cli_args.router_name, metavar="ROUTER",
                    help=f"routers to compare: {', '.join(ROUTERS)}, or package.module:Class (default: the first four)")
    rt.add_argument("--max-imbalance", type=non_negative_int, help="prefix-affinity's and cache-aware's load cap (default 8)")
    rt.add_argument("--no-prefix-caching", action="store_true", help="turn the replicas' prefix caches off")
    rt.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, help="token budget (default 8192)")
    rt.add_argument("--no-chunked-prefill", action="store_true", help="prefill whole prompts (default: chunked)")
    sp = rt.add_argument_group("the shared-prefix workload (when --trace shared-prefix)")
    sp.add_argument("--num-prefixes", type=positive_int, default=200)
    sp.add_argument("--prefix-len", type=non_negative_int, default=4096)
    sp.add_argument("--suffix-len", type=non_negative_int, default=128)
    sp.add_argument("--output-len", type=positive_int, default=256)
    rt.add_argument("--out", type=out_dir, required=True)
    rt.set_defaults(func=command)


def study(args: argparse.Namespace) -> RoutingStudy:
    def shared_prefix(seed: int) -> Trace:
        return apply_arrivals(make_synthetic("shared-prefix", args.num_requests, seed=seed,
                                             num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
                                             suffix_len=args.suffix_len, output_len=args.output_len),
                              rate=args.rates[0], seed=seed)

    if args.trace == "shared-prefix":
        cli_args.check_workload_size(args.trace, args.num_requests)
    workload = cli_args.study_workloads(args, shared_prefix if args.trace == "shared-prefix" else None)
    opts = {} if args.max_imbalance is None else {"max_imbalance": args.max_imbalance}
    if opts and not set(MATCH_ROUTERS) & set(args.routers):
        raise ValueError(f"--max-imbalance applies to the {' and '.join(MATCH_ROUTERS)} routers, neither in --routers")
    # --replica-hardware sets the count whatever --replicas says (its default is 4, not 1)
    base = cli_args.sim_config(args, replicas=len(args.replica_hardware or ()) or args.replicas,
                      prefix_caching=not args.no_prefix_caching, chunked_prefill=not args.no_chunked_prefill)
    hw = args.replica_hardware
    replicas_of = f"{args.model} on {' + '.join(hw)}" if hw else cli_args.study_title(args)
    return RoutingStudy(workload=workload, base=base, rates=args.rates, workers=cli_args.workers(args),
                        seeds=args.seeds, routers=args.routers, router_options=opts, replicas_of=replicas_of)


def command(args: argparse.Namespace) -> int:
    s = study(args)
    rows = RowPrinter(COLUMNS.widened("router", args.routers), args.seeds)  # as wide as the longest router named
    return print_study(f"routing: {len(s.trace)} requests of {s.trace.name}, {s.base.replicas} replicas of "
                       f"{s.replicas_of}, prefix caching {'off' if args.no_prefix_caching else 'on'}", rows,
                       lambda rows: routing_report(run_routing(s, on_row=rows)), args.out)


COLUMNS = Columns(("router", "router", "<16"), ("rate", "rate", ">6.2f"), ("req/s", "throughput", ">7.3f"),
                  ("TTFT", "ttft_mean", ">8.3f"), ("norm lat", "mean_normalized_latency", ">9.4f"),
                  ("cache hit", "prefix_hit_fraction", ">9.1%"), ("spread", "imbalance", ">7.2f"),
                  ("wall s", "wall_s", ">7.2f"))
