"""`pagesim serve`: an OpenAI-compatible HTTP server over the live engine, or over emulated ones
(--emulate, built by pagesim.emulate) (wiring only).

The model, runner and replica (any policy `pagesim live` runs, with the same options) are built as
`pagesim live` builds them; backend.async_engine.AsyncEngine steps the replica in a thread and
backend.http_api answers HTTP on uvicorn's event loop (backend.http_server: read timeouts, a
bounded shutdown). On SIGTERM / SIGINT the server stops taking requests, drains or aborts those in
flight (--on-shutdown) for at most --shutdown-timeout seconds, then aborts what is left (a second
signal does so at once), and writes requests.csv, iterations.parquet and summary.json to --out, as
`pagesim live` does; the tables are written however the HTTP server ends. --emulate serves its
replicas the same way (one `serve_together` loop, one signal for all; each writes its own tables).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from pagesim.argtypes import non_negative_int, out_dir, positive_float, seed
from pagesim.cli_args import add_live_model_args, add_policy_args, replica_config
from pagesim.emulate import (
    SWITCH_INTERVAL_S,
    add_emulate_args,
    bind_ports,
    build_replicas,
    check_live_args,
    describe,
    replica_facts,
    replica_out,
)
from pagesim.report_writer import write_run
from policies.metrics import summarize


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on a real model, or (--emulate) on a "
                                     "calibrated cost model with no GPU (needs the serve extra)",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics "
                                   "on the live engine (or, with --emulate, on emulated engines) under any policy; "
                                   "the model name in requests is --model. "
                                   "On SIGTERM it drains (or aborts) what is in flight and writes requests.csv, "
                                   "iterations.parquet and summary.json to --out.")
    add_live_model_args(p)
    add_policy_args(p)
    add_emulate_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=non_negative_int, default=8000, help="port (default 8000)")
    s.add_argument("--max-pending", type=non_negative_int, default=0,
                   help="answer 429 when this many requests are already in the server (default 0: queue them all)")
    s.add_argument("--on-shutdown", choices=("drain", "abort"), default="drain",
                   help="on SIGTERM: finish the requests in flight (drain, default) or abort them at once")
    s.add_argument("--shutdown-timeout", type=positive_float, default=20.0,
                   help="seconds the drain may take after SIGTERM before what still runs, reads or streams is "
                        "aborted and the connections closed; a second SIGTERM/SIGINT does that at once "
                        "(default 20, inside the 30 s a Kubernetes pod gets before SIGKILL)")
    s.add_argument("--header-timeout", type=positive_float, default=10.0,
                   help="seconds for a request's line and headers to arrive, else 408 and the connection "
                        "closes (default 10)")
    s.add_argument("--body-timeout", type=positive_float, default=30.0,
                   help="seconds for a request's whole body to arrive once its headers have, else 408 "
                        "(default 30)")
    s.add_argument("--seed", type=seed, default=0, help="seed of the shared sampler and random weights (default 0)")
    s.add_argument("--debug", action="store_true", help="check the block pool after every step and abort")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=out_dir, default="runs/serve", help="where the tables go on shutdown "
                                                                     "(default runs/serve)")
    o.add_argument("--slo-ttft", type=positive_float, help="TTFT SLO in seconds, for goodput")
    o.add_argument("--slo-tpot", type=positive_float, help="TPOT SLO in seconds, for goodput")
    p.set_defaults(func=cmd_serve)


@dataclass
class Front:
    """One engine behind its own port: `pagesim serve` runs one (live) or --replicas (--emulate)."""
    engine: object      # backend.async_engine.AsyncEngine
    api: object         # backend.http_api.OpenAIServer
    metrics: object     # backend.serve_metrics.ServeMetrics
    port: int
    out: str            # where its tables go
    facts: Callable[[], dict]  # what its summary says of the engine (asked once it has stopped)
    close: Callable[[], None] = lambda: None  # once its engine has stopped (an emulator's KV-event publisher)


def cmd_serve(args: argparse.Namespace) -> int:
    try:  # deferred: the HTTP server is an optional extra
        from backend.http_server import http_server, serve_together
    except ImportError as exc:
        raise ValueError(f"pagesim serve needs the serve extra: pip install -e '.[serve]' ({exc})") from exc
    t0 = time.perf_counter()
    if args.emulate:
        fronts, sockets, what = _emulated_fronts(args)
    else:
        check_live_args(args)
        fronts, sockets, what = [_live_front(args)], None, f"{args.model} on {args.device}, policy {args.policy}"
    drain = args.on_shutdown == "drain"
    servers = [http_server(f.api, f.engine, f.metrics, args.host, f.port, drain=drain,
                           shutdown_timeout=args.shutdown_timeout, header_timeout=args.header_timeout)
               for f in fronts]
    # the servers handle SIGINT / SIGTERM while they run; once they have stopped, one more must
    # not kill the process before the tables are written
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    for f in fronts:
        f.engine.start()
    print(f"pagesim serve{' --emulate' if args.emulate else ''}: {what}, ready in {time.perf_counter() - t0:.1f} s; "
          + ", ".join(f"http://{args.host}:{f.port}/v1" for f in fronts), flush=True)
    try:
        serve_together(servers, sockets)
    finally:  # however the HTTP servers ended (even by an exception), the engines stop and the tables are written
        _stop_engines([f.engine for f in fronts], drain, args.shutdown_timeout)
        for f in fronts:
            f.close()
        for s in sockets or ():
            s.close()
        code = max(_write_tables(args, f.engine, f.facts(), f.out) for f in fronts)
    return code


def _live_front(args: argparse.Namespace) -> Front:
    try:
        from backend.http_api import OpenAIServer, ServeOptions
        from backend.serve_metrics import ServeMetrics
    except ImportError as exc:
        raise ValueError(f"pagesim serve needs the serve and backend extras: pip install -e '.[backend,serve]' "
                         f"({exc})") from exc
    args.num_gpu_blocks = 512 if args.num_gpu_blocks is None else args.num_gpu_blocks  # the live defaults
    args.num_cpu_blocks = 512 if args.num_cpu_blocks is None else args.num_cpu_blocks
    engine, tokenizer, max_len = _build_engine(args)
    metrics = ServeMetrics(args.model)
    engine.observer = metrics
    options = ServeOptions(args.model, max_len, args.max_pending, int(time.time()), body_timeout=args.body_timeout)
    api = OpenAIServer(engine, tokenizer, metrics, options)
    kv_tokens = engine.executor.runner.num_gpu_blocks * args.block_size
    return Front(engine, api, metrics, args.port, args.out,
                 lambda: {"mode": "live", "device": args.device, "kv_capacity_tokens": kv_tokens})


def _emulated_fronts(args: argparse.Namespace) -> tuple[list[Front], list[socket.socket], str]:
    """--emulate's replicas on consecutive ports from --port-base (default --port), bound now (a
    taken port is an error naming the flag before anything starts); what the banner says of them."""
    replicas = build_replicas(args)
    base = args.port if args.port_base is None else args.port_base
    sockets = bind_ports(args.host, [base + r.index for r in replicas], "--port" if args.port_base is None
                         else "--port-base")
    fronts = [Front(r.engine, r.api, r.metrics, base + r.index, replica_out(args, r, len(replicas)),
                    partial(replica_facts, args, r, len(replicas)), r.close) for r in replicas]
    # the engine threads wake from their sleeps to release tokens on time; Python hands the GIL over
    # every 5 ms by default, which would be their lag whenever the event loop is busy (this process
    # is the emulator alone, so the setting is ours to make)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return fronts, sockets, describe(args, replicas[0])


def _stop_engines(engines: list, drain: bool, timeout: float) -> None:
    """Stop every engine within about `timeout` seconds (all at once, not one after another):
    drained if it can be, then aborted within as long again."""
    for mode in (drain, False):
        running = [e for e in engines if e.alive]
        for e in running:
            e.shutdown(mode)
        deadline = time.monotonic() + timeout
        for e in running:
            e.stop(mode, timeout=max(deadline - time.monotonic(), 0.0))


def _build_engine(args: argparse.Namespace):
    # deferred: the backend imports torch
    from backend.async_engine import AsyncEngine
    from backend.live_executor import build_live_replica, load_model
    from backend.model_runner import ModelRunner

    config = replica_config(args)  # first: a bad option fails before the model loads
    t0 = time.perf_counter()
    model = load_model(args.model, seed=args.seed)
    loaded = time.perf_counter()
    if model.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; serve needs one (use smollm2-135m)")
    cfg = model.config
    runner = ModelRunner(cfg, model.weights, args.device, attention=args.attention, num_gpu_blocks=config.num_gpu_blocks,
                         num_cpu_blocks=config.num_cpu_blocks, block_size=config.block_size)
    replica = build_live_replica(config, runner, [cfg.eos_token_id], seed=args.seed)  # warms the model up
    # where the start-up time goes (a slow start is the weights' read, or compiling the kernels)
    print(f"pagesim serve: model read in {loaded - t0:.1f} s; cache allocated and warmed up (kernels compiled, "
          f"first steps run) in {time.perf_counter() - loaded:.1f} s", flush=True)
    # the longest request served: the model's context, or what the KV cache holds if less (so that
    # a chat request without max_tokens, given what the context leaves, still fits the cache)
    usable = replica.scheduler.capacity_tokens or runner.num_gpu_blocks * config.block_size
    max_len = min(cfg.max_position, usable)
    return AsyncEngine(replica, model.tokenizer, debug=args.debug), model.tokenizer, max_len


def _write_tables(args: argparse.Namespace, engine, facts: dict, out: str) -> int:
    """Write the run's tables to `out`; `facts`: what the summary says of the engine (mode, device
    or emulated hardware, KV capacity)."""
    sched = engine.scheduler
    problems = []
    if engine.alive:  # still stepping (a step that never ended): the tables are what it had so far
        problems.append("the engine thread did not stop; the tables may miss its last requests")
    try:
        sched.assert_drained()
    except AssertionError as e:
        problems.append(str(e))
    if engine.error:
        problems.append(engine.error.strip().splitlines()[-1])
    req_df, it_df = engine.tables()
    summary = summarize(req_df, it_df, args.slo_ttft, args.slo_tpot)
    summary.update(served="http", model=args.model, wall_time_s=engine.clock(), trace="http", **facts,
                   num_aborted=int((req_df.status == "aborted").sum()),
                   pool_whole=not problems, problems=problems,
                   config={k: v for k, v in vars(args).items() if k != "func"})
    out = write_run(out, req_df, it_df, summary)
    print(f"pagesim serve: {len(req_df)} requests ({summary['num_finished']} finished, {summary['num_aborted']} "
          f"aborted); wrote {out}/requests.csv, iterations.parquet, summary.json", flush=True)
    for p in problems:
        print(f"pagesim serve: error: {p}", flush=True)
    return 1 if problems else 0
