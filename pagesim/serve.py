"""`pagesim serve`: an OpenAI-compatible HTTP server over the live engine (wiring only).

The model, runner, scheduler (any policy `pagesim live` runs, with the same options) and executor
are built as `pagesim live` builds them; backend.server.AsyncEngine steps them in a thread and
backend.http_api answers HTTP on uvicorn's event loop. On SIGTERM / SIGINT the server stops taking
requests, drains or aborts those in flight (--on-shutdown), and writes requests.csv,
iterations.parquet and summary.json to --out, as `pagesim live` does.
"""

from __future__ import annotations

import argparse
import signal
import time


def add_serve_parser(sub) -> None:
    from analysis.cli_args import add_live_model_args, add_policy_args
    from pagesim.argtypes import non_negative_int, out_dir, positive_float, seed

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on a real model (needs the serve extra)",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics "
                                   "on the live engine under any policy; the model name in requests is --model. "
                                   "On SIGTERM it drains (or aborts) what is in flight and writes requests.csv, "
                                   "iterations.parquet and summary.json to --out.")
    add_live_model_args(p)
    add_policy_args(p)
    from pagesim.emulate import add_emulate_args
    add_emulate_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=non_negative_int, default=8000, help="port (default 8000)")
    s.add_argument("--max-pending", type=non_negative_int, default=0,
                   help="answer 429 when this many requests are already in the server (default 0: queue them all)")
    s.add_argument("--on-shutdown", choices=("drain", "abort"), default="drain",
                   help="on SIGTERM: finish the requests in flight (drain, default) or abort them at once")
    s.add_argument("--seed", type=seed, default=0, help="seed of the shared sampler and random weights (default 0)")
    s.add_argument("--debug", action="store_true", help="check the block pool after every step and abort")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=out_dir, default="runs/serve", help="where the tables go on shutdown "
                                                                     "(default runs/serve)")
    o.add_argument("--slo-ttft", type=positive_float, help="TTFT SLO in seconds, for goodput")
    o.add_argument("--slo-tpot", type=positive_float, help="TPOT SLO in seconds, for goodput")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from pagesim.emulate import check_live_args, cmd_emulate
    if args.emulate:
        return cmd_emulate(args, _write_tables)  # the same tables, with the emulated engine's facts
    check_live_args(args)
    args.num_gpu_blocks = 512 if args.num_gpu_blocks is None else args.num_gpu_blocks  # the live defaults
    args.num_cpu_blocks = 512 if args.num_cpu_blocks is None else args.num_cpu_blocks
    try:
        import uvicorn

        from backend.http_api import OpenAIServer, ServeOptions
        from backend.serve_metrics import ServeMetrics
    except ImportError as exc:
        raise ValueError(f"pagesim serve needs the serve and backend extras: pip install -e '.[backend,serve]' "
                         f"({exc})") from exc

    t0 = time.perf_counter()
    engine, tokenizer, max_len = _build_engine(args)
    metrics = ServeMetrics(args.model)
    engine.observer = metrics
    api = OpenAIServer(engine, tokenizer, metrics, ServeOptions(args.model, max_len, args.max_pending, int(time.time())))
    drain = args.on_shutdown == "drain"

    def on_signal() -> None:
        api.draining = True
        engine.shutdown(drain)

    server = _server(uvicorn.Config(api.app(), host=args.host, port=args.port, log_level="warning",
                                    access_log=False), on_signal)
    # uvicorn re-raises the shutdown signal once it has stopped, to the handler found before it ran:
    # make that one a no-op, so that the tables are still written and the exit is clean
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    engine.start()
    print(f"pagesim serve: {args.model} on {args.device}, policy {args.policy}, ready in "
          f"{time.perf_counter() - t0:.1f} s; http://{args.host}:{args.port}/v1", flush=True)
    try:
        server.run()
    finally:
        engine.stop(drain)
    return _write_tables(args, engine)


def _server(config, on_signal):
    """uvicorn's Server, calling `on_signal` first when a shutdown signal arrives (so the engine
    drains or aborts while uvicorn waits for the connections in flight)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            on_signal()
            super().handle_exit(sig, frame)

    return Server(config)


def _build_engine(args: argparse.Namespace):
    from backend.live import LiveExecutor, load_model
    from backend.model_runner import ModelRunner
    from backend.server import AsyncEngine
    from policies.registry import is_paged, make_scheduler, parse_policy_args, scheduler_options

    model = load_model(args.model, seed=args.seed)
    if model.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; serve needs one (use smollm2-135m)")
    cfg = model.config
    runner = ModelRunner(cfg, model.weights, args.device, attention=args.attention, num_gpu_blocks=args.num_gpu_blocks,
                         num_cpu_blocks=args.num_cpu_blocks, block_size=args.block_size)
    kw = scheduler_options(args.policy, args.max_num_seqs, args.max_num_batched_tokens, args.preemption,
                           args.chunked_prefill, args.prefix_caching, args.num_cpu_blocks)
    if not is_paged(args.policy):
        kw["alloc_unit"] = args.block_size  # contiguous chunks must map onto the cache's blocks
    options = parse_policy_args(getattr(args, "policy_args", None))
    sched = make_scheduler(args.policy, runner.num_gpu_blocks, args.block_size, policy_options=options,
                           slo_ttft=args.slo_ttft, **kw)
    sched.max_model_len = cfg.max_position
    executor = LiveExecutor(sched, runner, [cfg.eos_token_id], seed=args.seed)  # warms the model up
    # the longest request served: the model's context, or what the KV cache holds if less (so that
    # a chat request without max_tokens, given what the context leaves, still fits the cache)
    usable = sched.capacity_tokens or runner.num_gpu_blocks * args.block_size
    max_len = min(cfg.max_position, usable)
    return AsyncEngine(sched, executor, model.tokenizer, debug=args.debug), model.tokenizer, max_len


def _write_tables(args: argparse.Namespace, engine, facts: dict | None = None, out: str | None = None) -> int:
    """Write the run's tables to `out` (default --out); `facts`: what the summary says of the engine
    (default: the live engine's mode, device and KV capacity)."""
    from policies.metrics import summarize, write_run

    sched = engine.scheduler
    problems = []
    try:
        sched.assert_drained()
    except AssertionError as e:
        problems.append(str(e))
    if engine.error:
        problems.append(engine.error.strip().splitlines()[-1])
    req_df, it_df = engine.tables()
    summary = summarize(req_df, it_df, args.slo_ttft, args.slo_tpot)
    if facts is None:
        facts = {"mode": "live", "device": args.device,
                 "kv_capacity_tokens": engine.executor.runner.num_gpu_blocks * args.block_size}
    summary.update(served="http", model=args.model, wall_time_s=engine.clock(), trace="http", **facts,
                   num_aborted=int(req_df.reject_reason.str.startswith("aborted").sum()) if len(req_df) else 0,
                   pool_whole=not problems, problems=problems,
                   config={k: v for k, v in vars(args).items() if k != "func"})
    out = write_run(out or args.out, req_df, it_df, summary)
    print(f"pagesim serve: {len(req_df)} requests ({summary['num_finished']} finished, {summary['num_aborted']} "
          f"aborted); wrote {out}/requests.csv, iterations.parquet, summary.json", flush=True)
    for p in problems:
        print(f"pagesim serve: error: {p}", flush=True)
    return 1 if problems else 0
