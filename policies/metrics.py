"""Metrics in one form for simulation and live runs (both executors import this, so it lives with
the shared contract in policies/): a row per request, a row per iteration, and a summary
(throughput, latency percentiles, normalized latency, goodput, KV utilization)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from policies.memory import MemoryBreakdown
from policies.plan import StepComposition
from policies.request import SequenceGroup

ITERATION_COLUMNS = (
    "start", "duration", "num_seqs", "prefill_tokens", "decode_tokens", "context_tokens",
    "num_preempted", "swap_in_blocks", "swap_out_blocks", "waiting", "running",
    "kv_token_states", "kv_reserved", "kv_internal_frag", "kv_external_frag", "kv_free",
    "prefix_hits",
)


class IterationLog:
    """Per-iteration records in one growing float64 table (cap x columns; the integer columns are
    exact up to 2^53 and cast back when the frame is built). Single rows are buffered as tuples
    and written in blocks, so millions of rows stay cheap; columns missing from `add_many` stay 0."""

    _FLOAT_COLUMNS = ("start", "duration")

    def __init__(self, capacity: int = 4096) -> None:
        self._table = np.zeros((capacity, len(ITERATION_COLUMNS)))
        self._index = {c: i for i, c in enumerate(ITERATION_COLUMNS)}
        self._pending: list[tuple] = []
        self._written = 0
        self.rows = 0

    def add(self, start: float, duration: float, c: StepComposition, num_preempted: int,
            waiting: int, running: int, mem: MemoryBreakdown, prefix_hits: int) -> None:
        self._pending.append((start, duration, c.num_prefill_seqs + c.num_decode_seqs, c.prefill_tokens,
                              c.num_decode_seqs, c.decode_context_tokens + c.prefill_context_tokens,
                              num_preempted, c.swap_in_blocks, c.swap_out_blocks, waiting, running,
                              mem.token_states, mem.reserved, mem.internal_frag, mem.external_frag, mem.free,
                              prefix_hits))
        self.rows += 1

    def _reserve(self, n: int) -> int:
        """Room for n more rows; returns the first free row."""
        pos = self._written
        if pos + n > len(self._table):
            grown = np.zeros((max(2 * len(self._table), pos + n), len(ITERATION_COLUMNS)))
            grown[:pos] = self._table[:pos]
            self._table = grown
        self._written = pos + n
        return pos

    def _flush(self) -> None:
        if self._pending:
            pos = self._reserve(len(self._pending))
            self._table[pos:self._written] = self._pending
            self._pending = []

    def add_many(self, columns: dict[str, np.ndarray]) -> None:
        self._flush()
        k = len(columns["start"])
        pos = self._reserve(k)
        table, index = self._table, self._index
        for col, values in columns.items():
            table[pos:pos + k, index[col]] = values
        self.rows += k

    def frame(self) -> pd.DataFrame:
        self._flush()
        rows = self._table[:self._written]
        data = {"iteration": np.arange(self._written)}
        for col, i in self._index.items():
            data[col] = rows[:, i].copy() if col in self._FLOAT_COLUMNS else rows[:, i].astype(np.int64)
        return pd.DataFrame(data)


def request_frame(groups: Iterable[SequenceGroup]) -> pd.DataFrame:
    """One row per request, finished or rejected, ordered by request id."""
    rows = []
    for g in groups:
        r = g.request
        out = g.output_len
        done = g.rejected is None
        ttft = g.first_token_time - r.arrival if done and g.first_token_time is not None else np.nan
        e2e = g.finish_time - r.arrival if done else np.nan
        tpot = (g.finish_time - g.first_token_time) / (out - 1) if done and out > 1 else np.nan
        rows.append((r.request_id, r.arrival, r.prompt_len, out, r.sampling.n, r.sampling.beam_width,
                     g.first_scheduled, g.first_token_time if done else np.nan, g.finish_time, ttft, tpot, e2e,
                     e2e / out if done and out else np.nan, g.num_preemptions, g.prefix_hit_tokens,
                     "finished" if done else "rejected", g.rejected or ""))
    cols = ["request_id", "arrival", "prompt_len", "output_len", "n", "beam_width", "first_scheduled",
            "first_token_time", "finish_time", "ttft", "tpot", "e2e_latency", "normalized_latency",
            "num_preemptions", "prefix_hit_tokens", "status", "reject_reason"]
    return pd.DataFrame(rows, columns=cols).sort_values("request_id").reset_index(drop=True)


def _stats(x: pd.Series) -> dict[str, float]:
    x = x.dropna()
    if x.empty:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    return {"mean": float(x.mean()), "p50": float(x.quantile(0.5)), "p90": float(x.quantile(0.9)),
            "p99": float(x.quantile(0.99))}


def summarize(requests: pd.DataFrame, iterations: pd.DataFrame, slo_ttft: float | None = None,
              slo_tpot: float | None = None) -> dict:
    """The headline numbers. Throughput is over the span from the first arrival to the last
    finish; goodput counts finished requests meeting both SLOs (when given)."""
    done = requests[requests.status == "finished"]
    start = float(requests.arrival.min()) if len(requests) else 0.0
    end = float(done.finish_time.max()) if len(done) else start
    span = max(end - start, 1e-12)
    ok = done
    if slo_ttft is not None:
        ok = ok[ok.ttft <= slo_ttft]
    if slo_tpot is not None:
        ok = ok[(ok.tpot <= slo_tpot) | ok.tpot.isna()]
    busy = float(iterations.duration.sum()) if len(iterations) else 0.0
    weights = iterations.duration if busy else None
    kv = iterations[["kv_token_states", "kv_reserved", "kv_internal_frag", "kv_external_frag", "kv_free"]]
    allocated = kv.iloc[:, :4].sum(axis=1)
    total = allocated + kv.kv_free

    def time_avg(x: pd.Series) -> float:
        return float(np.average(x, weights=weights)) if busy else float("nan")

    return {
        "num_requests": len(requests),
        "num_finished": len(done),
        "num_rejected": int((requests.status == "rejected").sum()),
        "duration_s": span,
        "request_throughput": len(done) / span,
        "output_token_throughput": float(done.output_len.sum()) / span,
        "total_token_throughput": float(done.output_len.sum() + done.prompt_len.sum()) / span,
        "ttft": _stats(done.ttft),
        "tpot": _stats(done.tpot),
        "e2e_latency": _stats(done.e2e_latency),
        "normalized_latency": _stats(done.normalized_latency),
        "mean_normalized_latency": float(done.normalized_latency.mean()) if len(done) else float("nan"),
        "goodput": len(ok) / span,
        "slo": {"ttft": slo_ttft, "tpot": slo_tpot},
        "num_preemptions": int(requests.num_preemptions.sum()),
        "num_iterations": len(iterations),
        "mean_batched_seqs": time_avg(iterations.num_seqs) if busy else 0.0,
        # the vLLM paper's Figure 2 measure: the share of allocated KV slots holding token states
        "kv_token_state_fraction": time_avg(kv.kv_token_states / allocated.clip(lower=1)),
        "kv_usage": time_avg(allocated / total.clip(lower=1)),
        "prefix_hit_tokens": int(requests.prefix_hit_tokens.sum()),
    }


def write_run(out_dir: str | Path, requests: pd.DataFrame, iterations: pd.DataFrame, summary: dict) -> Path:
    """Write requests.csv, iterations.parquet and summary.json into out_dir (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    requests.to_csv(out / "requests.csv", index=False)
    iterations.to_parquet(out / "iterations.parquet", index=False)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_jsonable) + "\n")
    return out


def _jsonable(x: object) -> object:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
