"""`pagesim live`: a trace replayed on a real model under a policy (wiring; the serve loop is
backend.replay.serve, driven by backend.replay.serve_trace). torch is imported when the command runs."""

from __future__ import annotations

import argparse

from analysis.report import summary_table
from pagesim.cli_args import (
    add_live_model_args,
    add_output_args,
    add_policy_args,
    add_workload_args,
    live_options,
    load_workload,
    require_backend,
    warn_if_busy,
)
from pagesim.report_writer import write_run


def add_parser(sub: argparse._SubParsersAction) -> None:
    live = sub.add_parser("live", help="replay a trace live on a real model (needs the backend extra)",
                          description="Serve a trace on a real model with the same policies; writes the same "
                                      "requests.csv, iterations.parquet and summary.json as simulate.")
    add_workload_args(live)
    add_policy_args(live)
    add_live_model_args(live)
    live.add_argument("--no-realtime", action="store_true",
                      help="queue every request at once instead of replaying arrivals")
    add_output_args(live)
    live.set_defaults(func=command)


def run(args: argparse.Namespace):
    """Serve the workload on the real model under the policy options; (requests, iterations, summary)."""
    trace = load_workload(args)  # a bad workload fails before torch loads
    require_backend()
    from backend.replay import serve_trace  # deferred: the backend imports torch

    load = warn_if_busy("pagesim live")

    req_df, it_df, summary = serve_trace(live_options(args), trace, args.n, args.beam_width,
                                         realtime=not args.no_realtime, progress=not args.quiet)
    summary.update(trace=trace.name, machine_load=load, config={k: v for k, v in vars(args).items() if k != "func"})
    return req_df, it_df, summary


def command(args: argparse.Namespace) -> int:
    req_df, it_df, summary = run(args)
    out = write_run(args.out, req_df, it_df, summary)
    print(summary_table({f"{args.policy} (live)": summary}))
    print(f"\nwrote {out}/requests.csv, iterations.parquet, summary.json")
    return 0
