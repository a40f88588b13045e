"""What a `vllm bench serve` (or vLLM 0.8 `benchmark_serving.py`) result file does not record: the
server's settings, and, in older files, the end-to-end latency summary.

Server settings (vLLM's own argument names) come from, later ones winning:
1. the result file's own keys (`--metadata tensor_parallel_size=8 ...` when the benchmark was run);
2. a sidecar file beside it, `<result stem>.server.json` (or one named by `--server-settings`): a
   JSON object of `SERVER_KEYS`;
3. command-line options (`--tp`, `--max-num-seqs`, ...: `server_options`).

Older files (vLLM 0.8's benchmark_serving.py) have no `*_e2el_ms` fields: the E2E latency of each
successful request is its TTFT plus the sum of its inter-token latencies (`ttfts`, `itls`, seconds).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

# the server settings a result file may lack, by vLLM's argument names, with their JSON types
SERVER_KEYS: dict[str, type] = {"tensor_parallel_size": int, "max_num_seqs": int, "max_num_batched_tokens": int,
                                "enable_prefix_caching": bool, "max_model_len": int, "gpu_memory_utilization": float,
                                "block_size": int, "hardware": str}
SIDECAR_SUFFIX = ".server.json"


def sidecar_path(result: Path) -> Path:
    return result.with_name(result.stem + SIDECAR_SUFFIX)


def check_settings(obj: Any, where: Path | str) -> dict[str, Any]:
    """A settings file's content: a JSON object of SERVER_KEYS ("gpu" is taken as "hardware");
    anything else is refused naming the file (`where`) and the key."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object of server settings ({', '.join(SERVER_KEYS)})")
    if "gpu" in obj:
        obj = {("hardware" if k == "gpu" else k): v for k, v in obj.items()}
    for key, value in obj.items():
        want = SERVER_KEYS.get(key)
        if want is None:
            raise ValueError(f"{where}: {key}: unknown server setting; known: {', '.join(SERVER_KEYS)}")
        ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
        if want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise ValueError(f"{where}: {key}: expected {want.__name__}, got {value!r}")
        # was: a 0 or -1 here was reported later against the result file, as if it had said so
        if want is int and not 1 <= value < 2**63:
            raise ValueError(f"{where}: {key}: expected an integer >= 1, got {value!r}")
        if want is float and not (math.isfinite(value) and 0 < value <= 1):
            raise ValueError(f"{where}: {key}: expected a fraction in (0, 1], got {value!r}")
        if want is str and not value.strip():
            raise ValueError(f"{where}: {key}: expected a hardware spec's name, got {value!r}")
    return obj


def server_options(tp: int | None = None, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                   prefix_caching: bool | None = None, max_model_len: int | None = None,
                   file_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings given on the command line (a `--server-settings` file's, `check_settings`, first,
    then the options given; None: not given), keyed by SERVER_KEYS."""
    out = dict(file_settings or {})
    given = {"tensor_parallel_size": tp, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
             "enable_prefix_caching": prefix_caching, "max_model_len": max_model_len}
    out.update({k: v for k, v in given.items() if v is not None})
    return out


def with_server_settings(obj: dict[str, Any], sidecar: dict[str, Any], options: dict[str, Any] | None) -> dict[str, Any]:
    """A result object with the sidecar's settings, then `options`, over its own."""
    return {**obj, **sidecar, **(options or {})}


def e2e_from_requests(ttfts: Any, itls: Any, where: str) -> tuple[float, float, float]:
    """(mean, p90, p99) E2E latency in ms of the successful requests (a TTFT > 0) from per-request
    `ttfts` (s) and `itls` (lists of s); malformed lists raise ValueError naming `where`."""
    if not isinstance(ttfts, list) or not isinstance(itls, list) or len(ttfts) != len(itls):
        raise ValueError(f"{where}: ttfts and itls: expected two lists of the same length (one entry per request)")
    e2e = []
    for i, (t, gaps) in enumerate(zip(ttfts, itls)):
        if not isinstance(t, (int, float)) or not isinstance(gaps, list) or not all(
                isinstance(g, (int, float)) and math.isfinite(g) for g in gaps):
            raise ValueError(f"{where}: ttfts[{i}] / itls[{i}]: expected a number and a list of numbers")
        if t > 0:
            e2e.append(1e3 * (t + sum(gaps)))
    if not e2e:
        raise ValueError(f"{where}: ttfts: no successful request (every TTFT is 0)")
    p90, p99 = np.percentile(e2e, [90, 99])
    return float(np.mean(e2e)), float(p90), float(p99)
