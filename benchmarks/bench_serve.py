"""`pagesim serve` under a bounded load on loopback: C concurrent streaming clients send R rounds of N
short completions each (SmolLM2-135M on CPU, random token-id prompts, EOS ignored), then SIGTERM.

Checks, not just figures: every request is answered exactly once (one [DONE], max_tokens token
events, a finish reason), the server's engine ended as many requests as were sent (/metrics), no
KV block is left in use after each round and the pool is whole at shutdown (summary.json
pool_whole, checked after every step with --debug), and the server's resident memory after each
round (it should stay flat: finished requests keep only their table row).

    python -m benchmarks.bench_serve [--clients 64] [--requests 160] [--rounds 2] [--max-tokens 12]
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

MODEL = "smollm2-135m"


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(client, base: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    first, events, done, reasons, ids = None, 0, 0, [], set()
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": (await r.aread()).decode()[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 200, "error": chunk["error"]["message"]}
            ids.add(chunk["id"])
            for ch in chunk["choices"]:
                events += 1
                first = first or time.perf_counter()
                if ch["finish_reason"]:
                    reasons.append(ch["finish_reason"])
    end = time.perf_counter()
    return {"status": 200, "ttft": first - t0, "e2e": end - t0, "events": events, "done": done,
            "reasons": reasons, "ids": ids}


async def _round(base: str, clients: int, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    import httpx

    todo = list(enumerate(prompts))
    results: dict[int, dict] = {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker() -> None:
            while todo:
                i, p = todo.pop()
                results[i] = await _one(client, base, p, max_tokens)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return [results[i] for i in range(len(prompts))]


def _metrics(base: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=160, help="requests per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    out_dir = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pagesim", "serve", "--model", MODEL, "--port", str(port),
                             "--debug", "--out", str(out_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    import httpx

    deadline = time.time() + 600
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"server did not start: {proc.stdout.read()}")
        time.sleep(0.5)
    figures = {"clients": args.clients, "requests_per_round": args.requests, "max_tokens": args.max_tokens,
               "rss_mib_ready": _rss_mib(proc.pid), "rounds": []}
    problems: list[str] = []
    sent = 0
    try:
        for k in range(args.rounds):
            prompts = [rng.integers(300, 40000, int(rng.integers(16, 65))).tolist() for _ in range(args.requests)]
            t0 = time.perf_counter()
            res = asyncio.run(_round(base, args.clients, prompts, args.max_tokens))
            wall = time.perf_counter() - t0
            sent += len(prompts)
            ok = [r for r in res if "error" not in r]
            bad = [r for r in res if "error" in r]
            once = all(r["done"] == 1 and r["events"] == args.max_tokens and r["reasons"] == ["length"]
                       and len(r["ids"]) == 1 for r in ok)
            ids = [next(iter(r["ids"])) for r in ok]
            m = _metrics(base)
            ended = m["vllm:request_success_total"] + m["pagesim:requests_aborted_total"] + \
                m["pagesim:requests_rejected_total"]
            rnd = {"round": k, "wall_s": wall, "ok": len(ok), "errors": len(bad), "answered_once": once,
                   "unique_ids": len(set(ids)) == len(ids), "engine_ended": int(ended), "sent_so_far": sent,
                   "req_per_s": len(ok) / wall, "out_tok_per_s": len(ok) * args.max_tokens / wall,
                   "ttft_p50_s": float(np.median([r["ttft"] for r in ok])),
                   "ttft_p90_s": float(np.percentile([r["ttft"] for r in ok], 90)),
                   "e2e_p50_s": float(np.median([r["e2e"] for r in ok])),
                   "kv_usage_after": m["vllm:kv_cache_usage_perc"], "running_after": m["vllm:num_requests_running"],
                   "rss_mib_after": _rss_mib(proc.pid)}
            figures["rounds"].append(rnd)
            print(json.dumps(rnd), flush=True)
            if bad or not once or not rnd["unique_ids"] or ended != sent or rnd["kv_usage_after"] != 0:
                problems.append(f"round {k}: {len(bad)} errors {bad[:2]}, answered once {once}, ended {ended} of "
                                f"{sent}, kv usage after {rnd['kv_usage_after']}")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(300)
    summary = json.loads((out_dir / "summary.json").read_text())
    import pandas as pd

    rows = pd.read_csv(out_dir / "requests.csv")
    figures.update(exit_code=code, pool_whole=summary["pool_whole"], table_rows=len(rows), sent=sent,
                   server_ttft_p50_s=float(rows.ttft.median()), server_tpot_p50_s=float(rows.tpot.median()))
    if code != 0 or not summary["pool_whole"] or len(rows) != sent:
        problems.append(f"shutdown: exit {code}, pool whole {summary['pool_whole']}, {len(rows)} rows for {sent}")
    print(json.dumps({k: v for k, v in figures.items() if k != "rounds"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    for p in problems:
        print(f"FAIL: {p}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
