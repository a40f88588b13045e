"""What a client measures beyond the server: the client terms of a cost model, applied to a run's tables.

A client-side latency (an HTTP benchmark's TTFT and E2E) holds more than the engine's own times: a
fixed add (HTTP, tokenization, the first chunk), an optional per-output-token add (streaming), and
an output lag: a token reaches the client `output_lag_steps` engine iterations after the iteration
that produced it (an engine that sends a step's outputs while the next step runs), so the lag costs
whatever those iterations take, and nothing once the engine is idle.

A cost model that carries such terms (a calibrated one) says so through `CostModel.client_terms`;
the run applies them once, where its request table is made (`with_client_latencies`), so that every
run and study sees the same client columns. Lives in policies/ beside metrics.py because simulated
runs, live comparisons and analysis all read the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

# the request table's client columns, each the client's view of a server column of the same table
CLIENT_COLUMNS = {"client_ttft": "ttft", "client_tpot": "tpot", "client_e2e_latency": "e2e_latency",
                  "client_normalized_latency": "normalized_latency"}


@dataclass(frozen=True)
class ClientTerms:
    """A fixed add to TTFT (and so to E2E), a per-output-token add (after the first token) to E2E,
    and an output lag in engine iterations (see the module docstring). All >= 0."""

    ttft_s: float = 0.0
    per_output_token_s: float = 0.0
    output_lag_steps: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ttft_s", "per_output_token_s", "output_lag_steps"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"client terms: {name} must be a finite number >= 0, got {v!r}")


def lagged_times(times: np.ndarray, iterations: pd.DataFrame, lag_steps: float) -> np.ndarray:
    """When tokens produced at `times` (each the end of an iteration) are sent, `lag_steps` iterations
    later: the end of the n-th following iteration, plus the fraction f of the one after it
    (lag = n + f). Only back-to-back iterations count: once the engine is idle it has nothing to
    overlap with, so whatever is still owed is sent at once. One replica's iterations."""
    times = np.asarray(times, dtype=np.float64)
    if lag_steps <= 0 or not len(times) or iterations.empty:
        return times
    start = iterations.start.to_numpy(np.float64)
    order = np.argsort(start, kind="stable")
    start = start[order]
    end = start + iterations.duration.to_numpy(np.float64)[order]
    # iteration i + 1 continues a busy period when it starts where i ended (float slack of 1 ns)
    joined = np.append(start[1:] <= end[:-1] + 1e-9, False)
    at = np.searchsorted(end, times - 1e-9, side="left")  # the iteration that produced each token
    sent = times.copy()
    whole, frac = int(lag_steps), lag_steps - int(lag_steps)
    live = at < len(end)
    for m in range(whole + (frac > 0)):
        nxt = at + 1
        live &= nxt < len(end)
        live[live] &= joined[at[live]]
        if not live.any():  # every token sent: a lag beyond the busy period (1e308 steps) ends here
            break
        share = 1.0 if m < whole else frac
        idx = np.where(live, nxt, 0)
        sent = np.where(live, sent + share * (end[idx] - sent), sent)
        at = np.where(live, nxt, at)
    return sent


def sent_times(times: np.ndarray, iterations: pd.DataFrame, lag_steps: float,
               replica: np.ndarray | None = None) -> np.ndarray:
    """`lagged_times` over the iterations of the replica that made each token: `replica[i]` names
    time i's replica in the iterations' `replica` column (None, or no such column: one replica)."""
    times = np.asarray(times, dtype=np.float64)
    if lag_steps <= 0:
        return times
    if replica is None or "replica" not in iterations.columns:
        return lagged_times(times, iterations, lag_steps)
    out = times.copy()
    for r, its in iterations.groupby("replica"):
        mine = replica == r
        out[mine] = lagged_times(times[mine], its, lag_steps)
    return out


def client_timestamps(requests: pd.DataFrame, iterations: pd.DataFrame | None,
                      lag_steps: float) -> tuple[np.ndarray, np.ndarray]:
    """(first token, last token) per row of `requests` as sent to the client after the output lag
    (NaN where the server has none), each over its own replica's iterations (the table's replica
    column, when it has one)."""
    replica = requests.replica.to_numpy() if "replica" in requests.columns else None
    return sent_pair(requests.first_token_time.to_numpy(np.float64), requests.finish_time.to_numpy(np.float64),
                     iterations, lag_steps, replica)


def sent_pair(first: np.ndarray, last: np.ndarray, iterations: pd.DataFrame | None, lag_steps: float,
              replica: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) token times as sent after an output lag of `lag_steps` (`sent_known`); the
    same arrays when there is no lag."""
    if lag_steps <= 0:
        return first, last
    if iterations is None:
        raise ValueError("an output lag needs the run's iteration table")
    return sent_known(first, iterations, lag_steps, replica), sent_known(last, iterations, lag_steps, replica)


def client_ttft_e2e(arrival: np.ndarray, first_sent: np.ndarray, last_sent: np.ndarray, output_len: np.ndarray,
                    terms: ClientTerms) -> tuple[np.ndarray, np.ndarray]:
    """The client's TTFT and E2E of requests from their tokens' send times: the fixed add on both,
    the per-token add (after the first token) on E2E. The one place of this arithmetic, so that the
    request table's client columns and analysis' metrics agree bit for bit."""
    ttft = first_sent - arrival + terms.ttft_s
    e2e = last_sent - arrival + terms.ttft_s + terms.per_output_token_s * np.maximum(output_len - 1, 0)
    return ttft, e2e


def sent_known(times: np.ndarray, iterations: pd.DataFrame, lag_steps: float,
               replica: np.ndarray | None = None) -> np.ndarray:
    """`sent_times` of the times that are not NaN; NaN stays NaN."""
    known = ~np.isnan(times)
    out = times.copy()
    out[known] = sent_times(times[known], iterations, lag_steps, None if replica is None else replica[known])
    return out


def client_columns(requests: pd.DataFrame, first_sent: np.ndarray, last_sent: np.ndarray,
                   terms: ClientTerms) -> pd.DataFrame:
    """`requests` with `CLIENT_COLUMNS` beside the server's latencies, from the first and last tokens'
    send times (`client_timestamps`) and the fixed and per-token adds. Finished rows get all four;
    an aborted row gets `client_ttft` when it produced a first token (as the server's `ttft`), NaN
    for the rest; rejected rows get none."""
    arrival = requests.arrival.to_numpy(np.float64)
    out = requests.output_len.to_numpy(np.float64)
    status = requests.status.to_numpy()
    done = status == "finished"
    # an aborted row that got its first token has a client TTFT (NaN first_sent otherwise), and
    # nothing that needs a finish: its last token never reached the client as a last token
    first_seen = done | (status == "aborted")
    with np.errstate(divide="ignore", invalid="ignore"):
        ttft, e2e = client_ttft_e2e(arrival, first_sent, last_sent, out, terms)
        ttft, e2e = np.where(first_seen, ttft, np.nan), np.where(done, e2e, np.nan)
        columns = {"client_ttft": ttft,
                   "client_tpot": np.where(done & (out > 1), (e2e - ttft) / (out - 1), np.nan),
                   "client_e2e_latency": e2e,
                   "client_normalized_latency": np.where(done & (out > 0), e2e / out, np.nan)}
    return requests.assign(**columns)


CLIENT_ITERATION_COLUMNS = ("start", "duration", "replica")  # what with_client_latencies reads of the iterations


def with_client_latencies(requests: pd.DataFrame, iterations: pd.DataFrame | None,
                          terms: ClientTerms | None) -> pd.DataFrame:
    """`requests` with the client's TTFT, time per output token, E2E and normalized latency
    (`CLIENT_COLUMNS`) beside the server's; unchanged (the same object) when `terms` is None.
    `iterations` needs only the columns CLIENT_ITERATION_COLUMNS names (`replica` where there is one)."""
    if terms is None:
        return requests
    return client_columns(requests, *client_timestamps(requests, iterations, terms.output_lag_steps), terms)


def has_client_latencies(requests: pd.DataFrame) -> bool:
    return "client_ttft" in requests.columns
