"""The summary of a run, in one form for simulation and live runs: throughput, latency percentiles,
normalized latency, goodput, KV utilization (`summarize`), and the per-client and windowed figures
the studies read."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final, Protocol

import numpy as np
import pandas as pd

from policies.client_latency import has_client_latencies


def latency_column(requests: pd.DataFrame, name: str) -> str:
    """The column SLOs and headline figures judge latency `name` (ttft, tpot, e2e_latency,
    normalized_latency) by: the client's (client_<name>) when the run has client latencies, else the
    server's."""
    client = f"client_{name}"
    return client if client in requests.columns else name


def meets_slo(requests: pd.DataFrame, slo_ttft: float | None = None, slo_tpot: float | None = None) -> pd.Series:
    """Per request: finished within its own SLO class (columns slo_ttft / slo_tpot where set), else
    within the run's SLOs (None: no target). Judged on the client's latencies when the table has
    them (`latency_column`)."""
    ok = requests.status == "finished"
    for col, default in (("ttft", slo_ttft), ("tpot", slo_tpot)):
        target = requests[f"slo_{col}"] if f"slo_{col}" in requests else pd.Series(np.nan, index=requests.index)
        if default is not None:
            target = target.fillna(default)
        has = target.notna()
        value = requests[latency_column(requests, col)]
        met = (value <= target) | (value.isna() if col == "tpot" else False)
        ok &= ~has | met
    return ok


def jain_index(x: np.ndarray) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all equal, 1/n when one takes all."""
    x = np.asarray(x, dtype=float)
    return float(x.sum() ** 2 / (len(x) * (x ** 2).sum())) if len(x) and (x ** 2).sum() > 0 else float("nan")


def per_client(requests: pd.DataFrame, slo_ttft: float | None = None, slo_tpot: float | None = None,
               input_weight: float = 1.0, output_weight: float = 2.0, windows: int = 20) -> tuple[pd.DataFrame, dict]:
    """One row per client (requests, finished, rejected, SLO attainment, goodput, service received
    as input_weight * prompt + output_weight * output tokens of its finished requests, latencies),
    and the fairness figures over `windows` equal slices of the run (`service_in_windows`): in each
    slice where two or more clients are backlogged (a request of theirs waits in the queue), Jain's
    index over the service each received there (`jain_service`: the mean over such slices; NaN when
    no slice has two) and the largest difference between two of them (`max_service_gap`). Fairness
    of service is what a fair scheduler (VTC) equalizes among clients that compete for the engine;
    totals over the run would measure demand instead, equal under every policy. Latencies are the
    client's when the table has them."""
    ttft, e2e = latency_column(requests, "ttft"), latency_column(requests, "e2e_latency")
    # object dtype first: a trace without clients reads back as an all-NaN float column, which
    # pandas will not fill with a string
    r = requests.assign(client=requests.client.astype(object).fillna("").astype(str) if "client" in requests else "")
    ok = meets_slo(r, slo_ttft, slo_tpot)
    fin = r.status == "finished"
    service = np.where(fin, input_weight * r.prompt_len + output_weight * r.output_len, 0.0)
    r = r.assign(_ok=ok, _fin=fin, _service=service)
    start = float(r.arrival.min()) if len(r) else 0.0
    end = float(r.finish_time[fin].max()) if fin.any() else start
    span = max(end - start, 1e-12)
    rows = []
    for client, g in r.groupby("client", sort=True):
        done = g[g._fin]
        rows.append({"client": client, "requests": len(g), "finished": int(g._fin.sum()),
                     "rejected": int((~g._fin).sum()), "slo_attainment": float(g._ok.mean()),
                     "goodput": float(g._ok.sum()) / span, "service": float(g._service.sum()),
                     "ttft_mean": float(done[ttft].mean()) if len(done) else float("nan"),
                     "e2e_mean": float(done[e2e].mean()) if len(done) else float("nan")})
    table = pd.DataFrame(rows)
    jains, gap = [], 0.0
    if len(table) > 1 and fin.any():
        edges = np.linspace(start, end, windows + 1)
        got, backlogged = service_in_windows(r[fin], edges, input_weight, output_weight), backlog_in_windows(r, edges)
        for w in range(windows):
            competing = backlogged.columns[backlogged.iloc[w].to_numpy()]
            if len(competing) < 2:
                continue
            share = got.iloc[w].reindex(competing, fill_value=0.0).to_numpy()
            jains.append(jain_index(share) if share.sum() > 0 else 1.0)
            gap = max(gap, float(share.max() - share.min()))
    fairness = {"clients": len(table), "jain_service": float(np.mean(jains)) if jains else float("nan"),
                "max_service_gap": gap}
    return table, fairness


def service_in_windows(done: pd.DataFrame, edges: np.ndarray, input_weight: float = 1.0,
                       output_weight: float = 2.0) -> pd.DataFrame:
    """Service each client received in each slice [edges[w], edges[w+1]) (rows: slices, columns:
    clients), from finished requests: the prompt at its first token, the output spread evenly over
    the time from its first token to its finish."""
    first, finish = done.first_token_time.to_numpy(float), done.finish_time.to_numpy(float)
    lo, hi = edges[:-1][:, None], edges[1:][:, None]
    span = finish - first
    overlap = np.clip(np.minimum(hi, finish) - np.maximum(lo, first), 0.0, None)
    last = np.arange(len(lo)) == len(lo) - 1  # the last slice is closed: a finish at the end lands in it
    at_once = ((first >= lo) & ((first < hi) | last[:, None])).astype(float)
    decode_share = np.where(span > 0, overlap / np.where(span > 0, span, 1.0),
                            ((finish >= lo) & ((finish < hi) | last[:, None])).astype(float))
    per_request = (input_weight * done.prompt_len.to_numpy(float) * at_once
                   + output_weight * done.output_len.to_numpy(float) * decode_share)
    return pd.DataFrame(per_request, columns=done.client.to_numpy()).T.groupby(level=0).sum().T


def backlog_in_windows(requests: pd.DataFrame, edges: np.ndarray) -> pd.DataFrame:
    """Whether each client had a request waiting in the queue (arrived, not yet scheduled) during
    each slice (rows: slices, columns: clients, booleans)."""
    arrival = requests.arrival.to_numpy(float)
    scheduled = requests.first_scheduled.fillna(np.inf).to_numpy(float)
    waits = (arrival[None, :] < edges[1:][:, None]) & (scheduled[None, :] > edges[:-1][:, None]) & (scheduled > arrival)
    return pd.DataFrame(waits, columns=requests.client.to_numpy()).T.groupby(level=0).any().T


_PERCENTILES: Final = np.array([0.5, 0.9, 0.99]) * 100.0  # p50, p90, p99, as Series.quantile passes them on


def _stats(x: pd.Series) -> dict[str, float]:
    """Mean, p50, p90 and p99 of a float column's values (NaN skipped), the same bits as
    Series.mean() and Series.quantile() give (a sum over the count; numpy's linear percentiles of
    q * 100), in one pass over the values and one partition instead of four pandas calls."""
    v = x.to_numpy(dtype=np.float64)
    v = v[~np.isnan(v)]
    if not len(v):
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p50, p90, p99 = np.percentile(v, _PERCENTILES).tolist()
    return {"mean": float(v.sum() / len(v)), "p50": p50, "p90": p90, "p99": p99}


_KV_COLUMNS = ("kv_token_states", "kv_reserved", "kv_internal_frag", "kv_external_frag", "kv_free")
SUMMARY_COLUMNS = ("duration", "num_seqs", *_KV_COLUMNS)  # the iteration columns summarize reads


class ColumnBlocks(Protocol):
    """An iteration table that keeps its columns in blocks of rows (sim.iteration_table's)."""

    def __len__(self) -> int: ...

    def column(self, c: str) -> np.ndarray: ...

    def blocks(self, names: Iterable[str]) -> Iterable[tuple[np.ndarray, ...]]: ...


def _blocks(iterations: pd.DataFrame | ColumnBlocks, names: tuple[str, ...]) -> Iterable[tuple[np.ndarray, ...]]:
    """Columns `names` of the iteration table in blocks of the same rows (a frame: one block)."""
    if isinstance(iterations, pd.DataFrame):
        return [tuple(iterations[c].to_numpy() for c in names)]
    return iterations.blocks(names)


def _column(iterations: pd.DataFrame | ColumnBlocks, c: str) -> np.ndarray:
    return iterations[c].to_numpy() if isinstance(iterations, pd.DataFrame) else iterations.column(c)


def summarize(requests: pd.DataFrame, iterations: pd.DataFrame | ColumnBlocks, slo_ttft: float | None = None,
              slo_tpot: float | None = None) -> dict:
    """The headline numbers. Throughput is over the span from the first arrival to the last
    finish; goodput counts finished requests meeting both SLOs (null when no SLO applies).
    `iterations`: a frame holding (at least) the columns SUMMARY_COLUMNS names, or a table that
    keeps its columns in blocks (a run's: only the durations are built whole)."""
    finished = requests.status == "finished"
    done = requests if finished.all() else requests[finished]  # no copy of a table where all finished
    start = float(requests.arrival.min()) if len(requests) else 0.0
    end = float(done.finish_time.max()) if len(done) else start
    span = max(end - start, 1e-12)
    num_ok = int(meets_slo(done, slo_ttft, slo_tpot).sum())
    has_slo = slo_ttft is not None or slo_tpot is not None or any(
        c in requests and requests[c].notna().any() for c in ("slo_ttft", "slo_tpot"))
    durations = _column(iterations, "duration")
    time_avg = _TimeAverage(durations) if len(durations) and durations.sum() else None
    nan = float("nan")
    token_state_fraction, kv_usage = _kv_time_averages(iterations, time_avg) if time_avg is not None else (nan, nan)
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
        # finished requests within the SLOs per second, and their share of all requests (rejected ones
        # count as missing); null when no SLO applies (none given, no request of an SLO class), where
        # they would only repeat the throughput and the finished fraction
        "goodput": num_ok / span if has_slo else None,
        "slo_attainment": (num_ok / len(requests) if len(requests) else float("nan")) if has_slo else None,
        "finished_fraction": len(done) / len(requests) if len(requests) else float("nan"),
        "slo": {"ttft": slo_ttft, "tpot": slo_tpot},
        "num_preemptions": int(requests.num_preemptions.sum()),
        "num_iterations": len(iterations),
        "mean_batched_seqs": time_avg.of_blocks(_blocks(iterations, ("num_seqs",)), np.copyto)
        if time_avg is not None else 0.0,
        # the vLLM paper's Figure 2 measure: the share of allocated KV slots holding token states
        "kv_token_state_fraction": token_state_fraction,
        "kv_usage": kv_usage,
        "prefix_hit_tokens": int(requests.prefix_hit_tokens.sum()),
        **_client_latency_summary(done),
        **_client_summary(requests, slo_ttft, slo_tpot),
    }


class _TimeAverage:
    """`np.average(x, weights=weights)` of columns given block by block, bit for bit (numpy's: the
    products summed, over the weights' float64 sum). Each column is written into one scratch array
    kept for every call and its products written over it: np.average makes a new one per call (96
    MB at a million requests, each of them pages the process touches for the first time)."""

    def __init__(self, weights: np.ndarray) -> None:
        self.weights = weights
        self.total = weights.sum(dtype=np.float64)
        self.scratch = np.empty(len(weights), dtype=np.float64)

    def of_blocks(self, blocks: Iterable[tuple[np.ndarray, ...]], fill: Callable[..., object]) -> float:
        """The average of the column that `fill(out, *block)` writes block by block into the
        scratch array (each block's rows in turn: a float64 slice of the block's length)."""
        out, at = self.scratch, 0
        for block in blocks:
            n = len(block[0])
            fill(out[at:at + n], *block)
            at += n
        np.multiply(out, self.weights, out=out)  # float64(x) * w is x * w with x cast: the same bits
        return float(out.sum() / self.total)


def _kv_time_averages(iterations: pd.DataFrame | ColumnBlocks, time_avg: _TimeAverage) -> tuple[float, float]:
    """`time_avg` of the share of allocated KV slots holding token states, and of the share of
    the cache allocated (each denominator at least 1). Computed block by block into the scratch
    array (a million-request run has ~12 million iterations: 96 MB a column, and a sub-frame of
    the five KV columns with its temporaries was a gigabyte at the run's peak; a run's table keeps
    them in narrow blocks). The integer counts are below 2**53, so float sums and quotients equal
    the integer ones divided."""
    token_state_fraction = time_avg.of_blocks(_blocks(iterations, _KV_COLUMNS), _token_state_share)
    return token_state_fraction, time_avg.of_blocks(_blocks(iterations, _KV_COLUMNS), _allocated_share)


def _allocated(states: np.ndarray, reserved: np.ndarray, internal: np.ndarray, external: np.ndarray) -> np.ndarray:
    allocated = states.astype(np.int64)  # int64 sums whatever the blocks' types
    allocated += reserved
    allocated += internal
    allocated += external
    return allocated


def _token_state_share(out: np.ndarray, states: np.ndarray, reserved: np.ndarray, internal: np.ndarray,
                       external: np.ndarray, free: np.ndarray) -> None:
    np.maximum(_allocated(states, reserved, internal, external), 1, out=out, dtype=np.float64)
    np.divide(states, out, out=out)


def _allocated_share(out: np.ndarray, states: np.ndarray, reserved: np.ndarray, internal: np.ndarray,
                     external: np.ndarray, free: np.ndarray) -> None:
    allocated = _allocated(states, reserved, internal, external)
    np.add(allocated, free, out=out)  # summed in int64, then cast
    np.maximum(out, 1, out=out)
    np.divide(allocated, out, out=out)


def _client_latency_summary(done: pd.DataFrame) -> dict:
    """The client's latencies beside the server's, when the run has them (a cost model with client
    terms: policies/client_latency.py); and which ones SLO attainment and goodput judged."""
    if not has_client_latencies(done):
        return {}
    return {"client_ttft": _stats(done.client_ttft), "client_tpot": _stats(done.client_tpot),
            "client_e2e_latency": _stats(done.client_e2e_latency),
            "client_normalized_latency": _stats(done.client_normalized_latency),
            "client_mean_normalized_latency": float(done.client_normalized_latency.mean()) if len(done) else float(
                "nan"),
            "latency_basis": "client: ttft, tpot, e2e_latency are the server's; client_* add the cost model's "
                             "client terms; slo_attainment, goodput and per_client use client_*"}


def headline_latency(summary: dict, name: str) -> dict[str, float]:
    """A run summary's stats of latency `name` (ttft, tpot, e2e_latency, normalized_latency) as
    studies report them: the client's when the run has them, else the server's."""
    return summary.get(f"client_{name}", summary[name])


def headline_mean_normalized_latency(summary: dict) -> float:
    """`headline_latency`'s rule for the mean normalized latency."""
    return summary.get("client_mean_normalized_latency", summary["mean_normalized_latency"])


def latency_basis(summary: dict) -> str:
    """'client' when a run summary's headline latencies are the client's, else 'server'."""
    return "client" if "client_ttft" in summary else "server"


def _client_summary(requests: pd.DataFrame, slo_ttft: float | None, slo_tpot: float | None) -> dict:
    """Per-client results and fairness, when the trace names more than one client."""
    if "client" not in requests or requests.client.nunique(dropna=False) < 2:
        return {}  # one value (or none): one client, whatever converting it to text gives
    if requests.client.astype(object).fillna("").astype(str).nunique() < 2:
        return {}
    table, fairness = per_client(requests, slo_ttft, slo_tpot)
    return {"per_client": table.set_index("client").to_dict(orient="index"), "fairness": fairness}
