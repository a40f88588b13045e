"""`pagesim serve --emulate` measured through its endpoint, by a client that streams like
inference-perf (the client of ../shared/calibration/vllm-h100): token-id prompts sent at the stage's
arrival times, `ignore_eos`, `max_tokens` = the stage's output length, one stream per request.

fidelity: for each stage, the client-measured TTFT, time per output token ((mean E2E - mean TTFT) /
  (output - 1)) and E2E of the emulated server (Llama-2-7B on H100, calibration vllm-v1-h100, the
  stage's engine settings) beside `pagesim simulate` of the same requests (with the calibration's
  client terms, which the emulator reproduces: sim/calibrated.py, pagesim/emulate.py) and beside
  the real vLLM measurement, over --duration seconds of each stage's arrivals after a warm-up.
  Warm-up (`warm_up_requests`): a shared-prefix stage repeats one cycle of num_groups x
  prompts_per_group prompts for minutes (a 600 s stage at 5 req/s: 30 cycles), so what vLLM measured
  is a warm prefix cache; the first cycle meets a cold one (engine TTFT ~16.6 ms instead of ~10.7
  on codegen#0). The first --warm-up-cycles cycles are served and simulated but left out of the
  figures, the rule `pagesim calibrate` applies to its truncated stages (analysis/calibrate.py,
  simulate_ref). Window (`steady_window`): --duration seconds of arrivals after the warm-up, doubled
  while `pagesim simulate` over it is further than --steady-tolerance from `pagesim simulate` of the
  whole measured stage (the `sim stage` column) on mean TTFT, TPOT or E2E, up to --max-duration: a
  stage near the engine's limit fills its batch over a minute or more. A window that does not get
  there is flagged NOT STEADY: its emulate vs vLLM says nothing, its emulate vs simulate still does.
capacity: the requests of one stage at rising constant rates, in real time (time scale 1); the p99
  token-release lag the server measured (summary.json), against 5 ms and 10% of the median
  iteration's time, the mean number of requests running (streams open at once), the requests whose
  connection failed, and how late the client sent its requests (median, wall ms: a client that
  cannot keep up offers less than the rate).

    python -m benchmarks.bench_emulate fidelity [--stages codegen#0 general#0] [--duration 30] [--max-duration 120]
        [--steady-tolerance 0.02] [--warm-up-cycles 1]
    python -m benchmarks.bench_emulate capacity [--stage general#0] [--rates 5 10 20 40] [--duration 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MEASUREMENTS = Path(__file__).resolve().parents[1] / ".." / "shared" / "calibration" / "vllm-h100" / "measurements.json"
CALIBRATION = "vllm-v1-h100"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stage(name: str):
    """(experiment, stage) by '[experiment suffix-]workload#index': 'codegen#0' is Llama-2-7B's
    (the issue's model), 'codellama-34b-tp2-codegen#0' another experiment's."""
    from analysis.measurement_files import load_measurements

    workload, _, index = name.partition("#")
    found = [e for e in load_measurements(MEASUREMENTS) if e.name.endswith("-" + workload)]
    if len(found) > 1:
        found = [e for e in found if "-llama-2-7b-" in e.name]
    if len(found) != 1 or (index and not index.isdigit()):
        raise SystemExit(f"--stages: no single stage {name!r} in {MEASUREMENTS}")
    exp = found[0]
    if int(index or 0) >= len(exp.stages):
        raise SystemExit(f"--stages: {name!r}: {exp.name} has {len(exp.stages)} stages")
    return exp, exp.stages[int(index or 0)]


def _server_args(cfg, port: int, out: Path, time_scale: float) -> list[str]:
    args = [sys.executable, "-m", "pagesim", "serve", "--emulate", "--model", cfg.model, "--hardware", cfg.hardware,
            "--tp", str(cfg.tp), "--calibration", CALIBRATION, "--policy", cfg.policy,
            "--block-size", str(cfg.block_size), "--max-num-seqs", str(cfg.max_num_seqs),
            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization), "--seed", str(cfg.seed),
            "--time-scale", str(time_scale), "--port", str(port), "--out", str(out)]
    if cfg.chunked_prefill:
        args.append("--chunked-prefill")
    if cfg.prefix_caching:
        args.append("--prefix-caching")
    return args


def _start(args: list[str], port: int) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.3)
        if proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"the emulated server did not start: {proc.stdout.read()}")


async def _one(client, base: str, model: str, prompt: list[int], max_tokens: int, at: float) -> dict:
    """One streamed request at `at`; its client-side times, or {"error": why} (a connection the
    server dropped or reset counts as a failed request, as a load generator counts it)."""
    import httpx

    try:
        return await _stream_one(client, base, model, prompt, max_tokens, at)
    except httpx.TransportError as e:
        return {"error": f"{type(e).__name__}: {e}"}


async def _stream_one(client, base: str, model: str, prompt: list[int], max_tokens: int, at: float) -> dict:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if json.loads(line[6:])["choices"]:
                tokens += 1
                first = first if first is not None else now
                last = now
    return {"ttft": first - t0, "e2e": last - t0, "tokens": tokens, "late_s": t0 - at}


async def _drive(base: str, model: str, prompts: list[list[int]], outputs: list[int], arrivals: np.ndarray,
                 time_scale: float) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter() + 0.5
        jobs = [_one(client, base, model, p, o, t0 + (a - arrivals[0]) / time_scale)
                for p, o, a in zip(prompts, outputs, arrivals)]
        return await asyncio.gather(*jobs)


def _prompts(trace, cfg) -> list[list[int]]:
    """Token ids for the stage's prompts: equal prefix hashes give equal tokens (prefix caching
    finds what the simulator finds)."""
    from backend.replay import synthetic_prompt_ids
    from sim.run import requests_from_trace
    from sim.specs import get_model

    model = get_model(cfg.model)
    return [synthetic_prompt_ids(r, model.vocab_size, cfg.seed) for r in requests_from_trace(trace, model.max_position)]


def warm_up_requests(exp, stage, cycles: int) -> int:
    """The requests of `cycles` prompt cycles of a shared-prefix stage (num_groups x
    prompts_per_group each: every distinct prompt once, so that the prefix cache holds what it holds
    in the stage's steady state); 0 for a stage without a cycle (its own recorded requests)."""
    if cycles < 0:
        raise ValueError(f"--warm-up-cycles: expected a count >= 0, got {cycles}")
    w = exp.workload
    return cycles * w.num_groups * w.prompts_per_group if w is not None else 0


def client_metrics(records: list[dict], time_scale: float, skip: int = 0) -> dict[str, float]:
    """TTFT, E2E and time per output token as the client measured them, in engine seconds, over the
    successful requests after the first `skip` (records in arrival order)."""
    ok = [r for r in records[skip:] if "error" not in r]
    if not ok:
        raise ValueError(f"no successful request after the first {skip} of {len(records)}")
    ttft = np.array([r["ttft"] for r in ok]) * time_scale
    e2e = np.array([r["e2e"] for r in ok]) * time_scale
    out = float(np.mean([r["tokens"] for r in ok]))
    return {"ttft_mean": float(ttft.mean()), "ttft_p90": float(np.percentile(ttft, 90)),
            "e2e_mean": float(e2e.mean()), "e2e_p90": float(np.percentile(e2e, 90)),
            "e2e_p99": float(np.percentile(e2e, 99)), "tpot": float((e2e.mean() - ttft.mean()) / (out - 1))}


def run_emulated(cfg, trace, time_scale: float, allow_errors: bool = False,
                 skip: int = 0) -> tuple[dict, dict, list[dict]]:
    """Serve the trace through an emulated server: (client metrics in engine seconds over the
    requests that succeeded after the first `skip`, the server's summary.json, per-request client
    records). A failed request ends the run unless `allow_errors`."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = _start(_server_args(cfg, port, Path(tmp) / "run", time_scale), port)
        try:
            records = asyncio.run(_drive(f"http://127.0.0.1:{port}", cfg.model, _prompts(trace, cfg),
                                         trace.output_len.tolist(), trace.arrival, time_scale))
        finally:
            proc.send_signal(signal.SIGTERM)
            log, _ = proc.communicate(timeout=120)
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        import pandas as pd

        iterations = pd.read_parquet(Path(tmp) / "run" / "iterations.parquet")
        requests = pd.read_csv(Path(tmp) / "run" / "requests.csv").sort_values("arrival").iloc[skip:]
        summary["server_ttft_mean"] = float((requests.first_token_time - requests.arrival).mean())
        summary["median_step_s"] = float(iterations.duration.median()) if len(iterations) else 0.0
        summary["mean_running"] = float(iterations.running.mean()) if len(iterations) else 0.0
        summary["log_tail"] = log[-600:]
    errors = [r["error"] for r in records if "error" in r]
    if errors and not allow_errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    summary["client_errors"] = errors
    return client_metrics(records, time_scale, skip), summary, records


def simulate_window(exp, stage, cfg, duration_s: float, skip: int):
    """`pagesim simulate` of the stage's first `duration_s` seconds of arrivals, latencies over the
    requests after the first `skip` (as run_emulated measures them): (trace, StageResult)."""
    import dataclasses

    from analysis.measurements import client_terms, stage_result, stage_workload
    from sim.run import build_cost_model, run_simulation

    t0 = time.perf_counter()
    trace = stage_workload(exp, stage, seed=cfg.seed, max_duration_s=duration_s)
    model = build_cost_model(cfg)
    res = run_simulation(dataclasses.replace(cfg, seed=cfg.seed), trace, model)
    return trace, stage_result(exp, stage, trace, res, client_terms(model), t0, skip=skip)


STEADY_METRICS = ("ttft_mean", "tpot", "e2e_mean")  # the three


def steady_window(exp, stage, cfg, skip: int, whole: dict[str, float], args: argparse.Namespace):
    """The measured window after the warm-up: --duration seconds, doubled until `pagesim simulate`
    over it is within --steady-tolerance of `pagesim simulate` over the whole measured stage on
    STEADY_METRICS (a load near the engine's limit fills its batch over minutes), at most
    --max-duration. (duration, trace, StageResult over it, whether it reached the tolerance)."""
    duration = args.duration
    while True:
        trace, sim = simulate_window(exp, stage, cfg, skip / stage.rate + duration, skip)
        steady = all(abs(sim.predicted[m] / whole[m] - 1) <= args.steady_tolerance for m in STEADY_METRICS)
        if steady or 2 * duration > args.max_duration or skip / stage.rate + duration >= stage.duration_s:
            return duration, trace, sim, steady
        duration *= 2


def fidelity(args: argparse.Namespace) -> None:
    from analysis.measurements import simulate_stage, stage_config

    rows = []
    for name in args.stages:
        exp, stage = _stage(name)
        cfg = stage_config(exp, stage, calibration=CALIBRATION)
        skip = warm_up_requests(exp, stage, args.warm_up_cycles)
        warm_s = skip / stage.rate
        whole = simulate_stage(exp, stage, cfg, seed=cfg.seed)
        duration, trace, sim, steady = steady_window(exp, stage, cfg, skip, whole.predicted, args)
        emu, summary, _ = run_emulated(cfg, trace, args.time_scale, allow_errors=True, skip=skip)
        lag = summary["release_lag"]
        print(f"\n{name}: rate {stage.rate:g} req/s, {len(trace)} requests ({warm_s + duration:g} s of arrivals: "
              f"the first {skip} ({warm_s:g} s, {args.warm_up_cycles} prompt cycles) warm the prefix cache and are "
              f"left out), time scale {args.time_scale:g}; release lag p50 {lag['p50_s'] * 1e3:.2f} ms, p99 "
              f"{lag['p99_s'] * 1e3:.2f} ms, late {lag['behind']}/{lag['releases']}; output lag "
              f"{summary['output_lag_steps']:.3f} steps")
        if summary["client_errors"]:  # counted, not hidden: the figures are over the requests that succeeded
            print(f"FAILED: {len(summary['client_errors'])} requests, e.g. {summary['client_errors'][0]}")
        if not steady:
            print(f"NOT STEADY: simulate over {duration:g} s differs from simulate over the whole stage by more than "
                  f"{args.steady_tolerance:.0%}; emulate vs vLLM is not a fair comparison here, emulate vs simulate is")
        done = sim.requests[sim.requests.status == "finished"]
        sim_ttft = float((done.first_token_time - done.arrival).mean())
        print(f"server-side mean TTFT (engine only, no client terms): emulate {summary['server_ttft_mean'] * 1e3:.2f} "
              f"ms, simulate {sim_ttft * 1e3:.2f} ms")
        print(f"{'metric':10} {'vLLM':>9} {'sim stage':>9} {'simulate':>9} {'emulate':>9} {'vs vLLM':>8} {'vs sim':>8}"
              f" {'sim vs vLLM':>11}")
        for m in ("ttft_mean", "ttft_p90", "tpot", "e2e_mean", "e2e_p90", "e2e_p99"):
            real, s, e, w = sim.measured.get(m), sim.predicted[m], emu[m], whole.predicted[m]
            vs_real = (e - real) / real if real else float("nan")
            sim_real = (s - real) / real if real else float("nan")
            print(f"{m:10} {real * 1e3 if real else float('nan'):9.2f} {w * 1e3:9.2f} {s * 1e3:9.2f} {e * 1e3:9.2f} "
                  f"{vs_real:+8.1%} {(e - s) / s:+8.1%} {sim_real:+11.1%}   (ms)")
            rows.append({"stage": name, "metric": m, "vllm": real, "simulate_stage": w, "simulate": s, "emulate": e,
                         "window_s": duration, "steady": steady})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def capacity(args: argparse.Namespace) -> None:
    from analysis.measurements import stage_config, stage_workload
    from traces import apply_arrivals

    exp, stage = _stage(args.stage)
    cfg = stage_config(exp, stage, calibration=CALIBRATION)
    print(f"{args.stage} requests at rising constant rates, {args.duration:g} s of arrivals each, in real time; "
          "the server's own release lag (ms)")
    print(f"{'rate':>6} {'streams':>8} {'step p50':>9} {'lag p50':>8} {'lag p99':>8} {'max':>8} {'late':>7} "
          f"{'failed':>6} {'sent late':>9} ok")
    for rate in args.rates:
        base = stage_workload(exp, stage, seed=cfg.seed, max_duration_s=args.duration * rate / stage.rate)
        trace = apply_arrivals(base, rate=rate, seed=cfg.seed)  # the constant arrivals, rescaled
        _, summary, records = run_emulated(cfg, trace, 1.0, allow_errors=True)
        late = float(np.median([r["late_s"] for r in records if "late_s" in r] or [0.0]))
        lag, step = summary["release_lag"], summary["median_step_s"]
        failed = summary["client_errors"]
        ok = lag["p99_s"] < 5e-3 and lag["p99_s"] < 0.1 * step and not failed
        print(f"{rate:6g} {summary['mean_running']:8.1f} {step * 1e3:9.2f} {lag['p50_s'] * 1e3:8.2f} "
              f"{lag['p99_s'] * 1e3:8.2f} {lag['max_s'] * 1e3:8.2f} {lag['behind'] / max(lag['releases'], 1):7.1%} "
              f"{len(failed):6d} {late * 1e3:9.2f} {'yes' if ok else 'no'}" + (f"  (e.g. {failed[0]})" if failed else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("fidelity")
    f.add_argument("--stages", nargs="+", default=["codegen#0", "general#0"])
    f.add_argument("--duration", type=float, default=30.0,
                   help="seconds of each stage's arrivals measured after the warm-up, at least (default 30)")
    f.add_argument("--steady-tolerance", type=float, default=0.02,
                   help="the window is doubled until simulate over it is this close to simulate over the whole "
                        "stage (TTFT, TPOT, E2E means; default 0.02)")
    f.add_argument("--max-duration", type=float, default=120.0,
                   help="the longest window, seconds of arrivals after the warm-up (default 120)")
    f.add_argument("--warm-up-cycles", type=int, default=1,
                   help="prompt cycles served first and left out of the figures (default 1; 0: a cold cache)")
    f.add_argument("--time-scale", type=float, default=1.0)
    f.add_argument("--json", help="write the rows here")
    c = sub.add_parser("capacity")
    c.add_argument("--stage", default="general#0")
    c.add_argument("--rates", type=float, nargs="+", default=[5, 10, 20, 40])
    c.add_argument("--duration", type=float, default=20.0)
    args = p.parse_args(argv)
    (fidelity if args.mode == "fidelity" else capacity)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
