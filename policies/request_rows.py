"""A row per request, in one form for simulation and live runs: finished requests' rows gathered from
their groups (`RequestRows`, which a simulated replica fills as the run goes) and the request table
built from them (`request_frame`, `rows_frame`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import numpy as np
import pandas as pd

from policies.iteration_log import float64_array, int64_array
from policies.request import SequenceGroup

_STATUS = ["finished", "aborted", "rejected"]  # request_frame's status values
# what RequestRows gathers from each group: numbers (int64, float64) and text (kept as codes); the
# table's other columns are derived from these (`_request_columns`)
_GATHERED_INTS: Final = ("request_id", "prompt_len", "output_len", "requested_output_len", "n", "beam_width",
                         "num_preemptions", "prefix_hit_tokens", "status", "priority")
_GATHERED_FLOATS: Final = ("arrival", "first_scheduled", "first_token_time", "finish_time", "slo_ttft", "slo_tpot")
_GATHERED_TEXTS: Final = ("reject_reason", "client")


class RequestRows:
    """Finished requests' rows as columns, gathered from their groups while a run still holds them:
    what the request table is built from.

    Invariant: `frame()` equals `request_frame` of every group added, in the order added, bit for
    bit (request_frame is the frame of a fresh store of its groups: one code path). The numbers
    are kept as numpy chunks, one per `add` (C numbers: `int64_array`, `float64_array`, no Python object per
    value); the two text columns as codes into their distinct values in order of first appearance.

    `take` adds groups and then lets them go: each group's lists of sequences are emptied (a group
    and its sequences refer to each other, and a simulated run pauses the cyclic collector:
    sim.cluster gc_paused), so that dropping a group frees it at once by reference counting, and
    the list handed over (a scheduler's `done`) is emptied. `chunk`: how many finished groups a
    simulated replica lets accumulate before it hands them over (sim.engine Replica.hand_over):
    enough that the numpy calls per chunk cost nothing per row, few enough that the heap the
    groups take stays small and is reused."""

    def __init__(self, chunk: int = 1024) -> None:
        if chunk < 1:
            raise ValueError(f"RequestRows: chunk must be >= 1, got {chunk}")
        self.chunk = chunk
        self.rows = 0
        self._parts: dict[str, list[np.ndarray]] = {c: [] for c in _GATHERED_INTS + _GATHERED_FLOATS
                                                    + _GATHERED_TEXTS}
        self._codes: dict[str, dict[str, int]] = {c: {} for c in _GATHERED_TEXTS}  # value -> its code

    def add(self, groups: list[SequenceGroup]) -> None:
        """Append the rows of `groups` (finished, rejected or aborted), in their order: each column's
        values gathered in one pass over the groups, read by numpy in one call."""
        if not groups:
            return
        nan = float("nan")
        ids, arrival, prompt, out, requested, n, beam = [], [], [], [], [], [], []
        first, finish, scheduled, preemptions, hits, status, reason = [], [], [], [], [], [], []
        client, priority, slo_ttft, slo_tpot = [], [], [], []
        reasons, clients = self._codes["reject_reason"], self._codes["client"]
        for g in groups:
            r = g.request
            ids.append(r.request_id)
            arrival.append(r.arrival)
            prompt.append(r.prompt_len)
            out.append(g.output_len)
            # what was asked for (a trace's output length, else max_tokens): a rejected row generated 0
            requested.append(r.max_output)
            n.append(r.sampling.n)
            beam.append(r.sampling.beam_width)
            done = g.rejected is None
            # the first token only of a finished or aborted request (a rejected one has none)
            first.append(nan if g.first_token_time is None or not (done or g.aborted) else g.first_token_time)
            finish.append(nan if g.finish_time is None else g.finish_time)
            scheduled.append(nan if g.first_scheduled is None else g.first_scheduled)
            preemptions.append(g.num_preemptions)
            hits.append(g.prefix_hit_tokens)
            status.append(0 if done else 1 if g.aborted else 2)
            reason.append(reasons.setdefault(g.rejected or "", len(reasons)))
            client.append(clients.setdefault(r.client, len(clients)))
            priority.append(r.priority)
            slo_ttft.append(nan if r.slo_ttft is None else r.slo_ttft)
            slo_tpot.append(nan if r.slo_tpot is None else r.slo_tpot)
        parts = self._parts
        for c, ints in zip(_GATHERED_INTS + _GATHERED_TEXTS, (ids, prompt, out, requested, n, beam, preemptions,
                                                              hits, status, priority, reason, client)):
            parts[c].append(int64_array(ints))
        for c, floats in zip(_GATHERED_FLOATS, (arrival, scheduled, first, finish, slo_ttft, slo_tpot)):
            parts[c].append(float64_array(floats))
        self.rows += len(groups)

    def take(self, groups: list[SequenceGroup]) -> None:
        """`add` the groups, then let them go: their cycles broken, the list emptied."""
        self.add(groups)
        for g in groups:
            g.seqs.clear()
            g.finished_seqs.clear()
        groups.clear()

    def frame(self, replica: np.ndarray | None = None) -> pd.DataFrame:
        """The request table of the rows added (request_frame's; `replica`: each row's replica, in
        the order added)."""
        return rows_frame([self], replica)


def request_frame(groups: Iterable[SequenceGroup], replica: np.ndarray | None = None) -> pd.DataFrame:
    """One row per request, ordered by request id. status: "finished", "rejected" (by the
    scheduler; reject_reason says why) or "aborted" (ended from outside, e.g. its client left; the
    reason in reject_reason). An aborted row keeps what happened before the abort: its first token
    time and TTFT when it got one, and output_len, the tokens it was given; latencies that need a
    finish (tpot, e2e, normalized) are NaN for every row that did not finish. `replica`, when given,
    holds each group's replica (in the order of `groups`): a last `replica` column.

    The groups' values are gathered by a RequestRows (in the order given) and framed by it: the
    rows then put in id order by one stable numpy sort of their ids (no key call per group); text
    columns are built from their few distinct values (`_text`)."""
    rows = RequestRows()
    rows.add(list(groups))
    return rows.frame(replica)


def rows_frame(stores: list[RequestRows], replica: np.ndarray | None = None) -> pd.DataFrame:
    """One request table of the rows of `stores`: request_frame of all their groups, store after
    store (`replica`: each row's replica, in that order). The rows are put in id order by one
    stable numpy sort of the ids; each column's chunks are then joined into one scratch array and
    taken from it in that order (one new array per column); a text column's codes are first
    mapped to one list of distinct values (in order of first appearance over the stores)."""
    ids = _joined([p for s in stores for p in s._parts["request_id"]], np.int64)
    if replica is not None and len(replica) != len(ids):
        raise ValueError(f"request_frame: {len(replica)} replicas for {len(ids)} groups")
    order = _id_order(ids)
    scratch = np.empty(0 if order is None else len(ids), dtype=np.int64)  # room for a column's joined chunks
    numbers = {"request_id": ids if order is None else ids[order]}
    for c in _GATHERED_INTS[1:]:  # all but the ids, taken above
        numbers[c] = _in_order([p for s in stores for p in s._parts[c]], order, scratch, np.int64)
    for c in _GATHERED_FLOATS:
        numbers[c] = _in_order([p for s in stores for p in s._parts[c]], order, scratch.view(np.float64), np.float64)
    texts: dict[str, tuple[list[str], np.ndarray]] = {}
    for c in _GATHERED_TEXTS:
        index: dict[str, int] = {}
        parts: list[np.ndarray] = []
        for s in stores:
            mapped = int64_array([index.setdefault(v, len(index)) for v in s._codes[c]])  # a store's code -> the run's
            for p in s._parts[c]:
                parts.append(mapped[p])
        texts[c] = (list(index), _in_order(parts, order, scratch, np.int64))
    if replica is not None:
        replica = np.asarray(replica, dtype=np.int64)
        if order is not None:
            replica = replica[order]
    return _request_columns(numbers, texts, replica)


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    """One array of `parts`, in order (the part itself when there is one)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _in_order(parts: list[np.ndarray], order: np.ndarray | None, scratch: np.ndarray, dtype: type) -> np.ndarray:
    """A column's chunks joined and taken in `order` (None: as they are); `scratch`: room for the
    joined chunks, of the column's type (`dtype`)."""
    if order is None:
        return _joined(parts, dtype)
    np.concatenate(parts, out=scratch)
    return scratch.take(order)


def _request_columns(numbers: dict[str, np.ndarray], texts: dict[str, tuple[list[str], np.ndarray]],
                     replica: np.ndarray | None) -> pd.DataFrame:
    """The request table (see request_frame) from the gathered columns (`numbers`; `texts`: each
    text column's distinct values and codes) and `replica`, all in id order: the latencies derived."""
    ids = numbers["request_id"]
    nan = float("nan")
    codes = numbers["status"]
    finished = codes == 0
    arrivals, outs, firsts, finishes = numbers["arrival"], numbers["output_len"], numbers["first_token_time"], \
        numbers["finish_time"]
    with np.errstate(divide="ignore", invalid="ignore"):
        e2e = np.where(finished, finishes - arrivals, nan)
        tpot = np.where(finished & (outs > 1), (finishes - firsts) / (outs - 1), nan)
        normalized = np.where(finished & (outs > 0), e2e / outs, nan)
    any_rows = len(ids) > 0
    columns = {
        "request_id": numbers["request_id"],
        "arrival": arrivals,
        "prompt_len": numbers["prompt_len"],
        "output_len": outs,
        "requested_output_len": numbers["requested_output_len"],
        "n": numbers["n"],
        "beam_width": numbers["beam_width"],
        "first_scheduled": numbers["first_scheduled"],
        "first_token_time": firsts,
        "finish_time": finishes,
        "ttft": firsts - arrivals,
        "tpot": tpot,
        "e2e_latency": e2e,
        "normalized_latency": normalized,
        "num_preemptions": numbers["num_preemptions"],
        "prefix_hit_tokens": numbers["prefix_hit_tokens"],
        # an empty table keeps the types it had: status an object column, the text columns empty lists
        "status": _text(_STATUS, codes) if any_rows else np.empty(0, dtype=object),
        "reject_reason": _text(*texts["reject_reason"]) if any_rows else [],
        "client": _text(*texts["client"]) if any_rows else [],
        "priority": numbers["priority"],
        "slo_ttft": numbers["slo_ttft"],
        "slo_tpot": numbers["slo_tpot"],
    }
    if replica is not None:
        columns["replica"] = replica
    return pd.DataFrame(columns, copy=False)  # no consolidating copy (a store's chunks are read-only)


def _id_order(ids: np.ndarray) -> np.ndarray | None:
    """The stable order that sorts `ids` (as sorting the groups by id would), None when they are
    in order already."""
    if len(ids) < 2 or bool((ids[1:] >= ids[:-1]).all()):
        return None
    return np.argsort(ids, kind="stable")


def _text(uniques: list[str], codes: np.ndarray) -> object:
    """The column [uniques[c] for c in codes] (codes not empty), stored as pandas stores a list of
    strings (its str dtype, or object): each distinct string is converted once, not once per row."""
    return pd.Series(uniques).array.take(codes)
