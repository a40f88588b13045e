"""Metrics in one form for simulation and live runs (both executors import this, so it lives with
the shared contract in policies/): a row per request, a row per iteration, and a summary
(throughput, latency percentiles, normalized latency, goodput, KV utilization)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import Final, Protocol

import numpy as np
import pandas as pd

from policies.client_latency import has_client_latencies
from policies.memory import MemoryBreakdown
from policies.plan import RepeatResult, StepComposition
from policies.request import SequenceGroup

ITERATION_COLUMNS = (
    "start", "duration", "num_seqs", "prefill_tokens", "decode_tokens", "context_tokens",
    "num_preempted", "swap_in_blocks", "swap_out_blocks", "waiting", "running",
    "kv_token_states", "kv_reserved", "kv_internal_frag", "kv_external_frag", "kv_free",
    "prefix_hits", "prefill_seqs", "prefill_attn_pairs", "prefill_context_tokens", "copy_blocks",
)
_FLOAT_COLUMNS = ("start", "duration")
_INT_COLUMNS = ITERATION_COLUMNS[2:]
# IterationLog's records, in C numbers, one layout per kind of write, in slots of 8 bytes (a record
# takes _FIELDS slots whatever its kind: a window's leaves its last ones unwritten).
# A row record (`add`'s row, or `add_many`'s k rows of zeros): k > 0, start, duration, the integer
# columns but num_seqs (_ROW_INTS; num_seqs = decode_tokens + prefill_seqs, derived when expanded)
_ROW_INTS: Final = tuple(c for c in _INT_COLUMNS if c != "num_seqs")
_ROW: Final = struct.Struct(f"q2d{len(_ROW_INTS)}q")
_FIELDS: Final = 21  # 3 + len(_ROW_INTS): a literal, so that the compiled kernel folds it
_RECORD_BYTES: Final = 8 * _FIELDS  # a literal for the compiled kernel (_ROW.size is a generic lookup)
# A window record (`add_window`): -steps (< 0: tells it from a row record), start, then what its
# rows do not share with every window (see add_window): num_seqs, context tokens, waiting, token
# states, internal fragmentation and free slots before its first iteration, prefix hits, block
# size, and its last row's running, token states, internal fragmentation and free slots
_WINDOW: Final = struct.Struct("qd12q")
# the two packers, looked up once (a method called by name is looked up on every call)
_PACK_ROW: Final = _ROW.pack_into
_PACK_WINDOW: Final = _WINDOW.pack_into
_W_SEQS, _W_CONTEXT, _W_WAITING, _W_STATES, _W_INTERNAL, _W_FREE, _W_HITS, _W_BLOCK, _W_LAST = range(2, 11)
# the row record's slots a window record's numbers go to (the rest 0) when a block is expanded
_W_INTO_ROW: Final = {"decode_tokens": _W_SEQS, "context_tokens": _W_CONTEXT, "waiting": _W_WAITING,
                      "running": _W_SEQS, "kv_token_states": _W_STATES, "kv_internal_frag": _W_INTERNAL,
                      "kv_free": _W_FREE, "prefix_hits": _W_HITS}
_W_DST: Final = np.array([3 + _ROW_INTS.index(c) for c in _W_INTO_ROW])
_W_SRC: Final = np.array(list(_W_INTO_ROW.values()))
assert _FIELDS == 3 + len(_ROW_INTS) and _ROW.size == _RECORD_BYTES and _WINDOW.size == 8 * (_W_LAST + 4) <= _ROW.size
_NARROW = (np.int8, np.int16, np.int32)  # IterationLog: tried in order when a block is sealed
# (type, its least and greatest value) of each, read once: np.iinfo builds an object per call
_NARROW_RANGES = tuple((t, int(np.iinfo(t).min), int(np.iinfo(t).max)) for t in _NARROW)


class IterationLog:
    """Per-iteration records, one column per field; the frame equals the rows written, in the order
    written (`add`: one row; `add_window`: a paged window's rows; `add_many`: rows given as
    columns), whatever the storage.

    Writing packs C numbers and appends to flat lists, nothing more: every write is a record of k
    rows packed into a byte buffer (struct: no Python object kept per number), in one of two
    layouts of the same size (see _ROW and _WINDOW): a single row's numbers (k = 1), less num_seqs
    (the sum of two others); a window's start and only the numbers its rows do not all share (its
    columns before its first iteration, its block size and its last row's figures, read after its
    finishes); zeros for `add_many`'s rows, written over by the columns given. A window's per-row
    numbers (its ends, durations and the blocks each iteration opened) are appended to flat lists,
    and the rare irregular column (waiting counts that change with arrivals) kept as an override.
    When a staging block reaches `capacity` rows (or is read) its rows are expanded at once with
    numpy, in order (the window records first rewritten in the row layout, then each column
    repeated from the records' numbers, the windows' rows computed from their per-row numbers by
    cumsum and written through one mask: no row placed by index) and sealed: each integer column
    stored in the narrowest integer type that holds its values exactly (most counts fit in one or
    two bytes), floats as they are, so a million-request log holds ~40 bytes a row instead of
    168. Reading widens every column back to float64 / int64. Columns missing from `add_many` stay
    0."""

    def __init__(self, capacity: int = 16384) -> None:
        self._capacity = capacity  # rows in a staging block (a window may overfill it)
        self._sealed: dict[str, list[np.ndarray]] = {c: [] for c in ITERATION_COLUMNS}
        self._base = 0  # rows sealed so far (the staging block's first row)
        self.rows = 0
        # the block's records: a buffer kept from block to block (a record has one row or more: a
        # block holds at most `capacity` of them), left uninitialised (each record is written
        # before it is read, the slots a window's layout leaves out never read; zeroing it would
        # cost as much as packing the records)
        self._room = min(capacity, 65536)  # records the buffer holds (doubled when full)
        self._records = np.empty(self._room * _RECORD_BYTES, dtype=np.uint8)
        self._buffer = self._records.data  # what struct writes into (a memoryview)
        self._count = 0  # records in the block
        self._ends: list[float] = []       # per window row
        self._durations: list[float] = []  # per window row
        self._opened: list[int] = []       # per window row: blocks its iteration opened
        self._waiting: list[tuple[int, list[int]]] = []  # (first row, waiting per row) overrides
        self._dense: list[tuple[int, dict]] = []  # add_many's (first row, columns)

    @classmethod
    def dtype(cls, c: str) -> type:
        return np.float64 if c in _FLOAT_COLUMNS else np.int64

    def _next_record(self) -> int:
        """The byte offset of the block's next record (in a new buffer when the block's is full)."""
        if self._count == self._room:
            self._records = np.concatenate((self._records, np.empty_like(self._records)))
            self._buffer = self._records.data
            self._room *= 2
        self._count += 1
        return (self._count - 1) * _RECORD_BYTES

    def add(self, start: float, duration: float, c: StepComposition, num_preempted: int,
            waiting: int, running: int, mem: MemoryBreakdown, prefix_hits: int) -> None:
        """One row: an iteration of composition `c`."""
        at = self._next_record()  # first: it may replace the buffer
        _PACK_ROW(self._buffer, at, 1, start, duration,
                       c.prefill_tokens, c.num_decode_seqs, c.decode_context_tokens + c.prefill_context_tokens,
                       num_preempted, c.swap_in_blocks, c.swap_out_blocks, waiting, running, mem.token_states,
                       mem.reserved, mem.internal_frag, mem.external_frag, mem.free, prefix_hits,
                       c.num_prefill_seqs, c.prefill_attn_pairs, c.prefill_context_tokens, c.copy_blocks)
        self.rows += 1
        if self.rows - self._base >= self._capacity:
            self._seal()

    def add_window(self, start: float, ends: list[float], durations: list[float], steps: int,
                   res: RepeatResult, waiting: int | list[int], prefix_hits: int) -> None:
        """`steps` rows: the plain decodes of a window begun at `start` whose memory `res` gives (see
        RepeatResult), iteration i ending at ends[i] after durations[i] (both may
        run longer: the rest is not logged here); `waiting`: the queue's length, or one per row;
        `prefix_hits`: the scheduler's count, the same in every row. Row i is: start (`start`, then
        ends[i - 1]), duration, num_seqs = decode_tokens = res.num_seqs, context_tokens
        res.context_tokens + (i + 1) * num_seqs, the memory columns of RepeatResult, waiting,
        prefix_hits, and 0 elsewhere."""
        if steps <= 0:
            return  # no rows
        if len(res.opened) != steps or len(durations) < steps or len(ends) < steps:
            raise ValueError(f"add_window: {steps} steps, but {len(ends)} ends, {len(durations)} durations "
                             f"and {len(res.opened)} opened counts")
        if not isinstance(waiting, int):
            self._waiting.append((self.rows - self._base, waiting))
            waiting = 0
        states0 = res.states0
        at = self._next_record()
        _PACK_WINDOW(self._buffer, at, -steps, start, res.num_seqs, res.context_tokens, waiting, states0,
                          res.allocated0 - states0, res.free0, prefix_hits, res.block_size,
                          res.last_running, res.last_states, res.last_internal, res.last_free)
        if len(durations) == steps:
            self._ends.extend(ends)
            self._durations.extend(durations)
        else:  # a preempting iteration after them, logged on its own
            self._ends.extend(ends[:steps])
            self._durations.extend(durations[:steps])
        self._opened.extend(res.opened)
        self.rows += steps
        if self.rows - self._base >= self._capacity:
            self._seal()

    def add_many(self, columns: dict[str, np.ndarray | list]) -> None:
        """Rows given as columns (each of the same length, or one value for all): a log built
        from columns (tests, tools) rather than from a run."""
        k = len(columns["start"])
        if not k:
            return  # no rows
        self._dense.append((self.rows - self._base, columns))
        at = self._next_record()
        _ROW.pack_into(self._buffer, at, k, *[0] * (_FIELDS - 1))  # zeros, written over
        self.rows += k
        if self.rows - self._base >= self._capacity:
            self._seal()

    def _seal(self, compact: bool = True) -> None:
        """Expand the staging block's rows, store them (compactly unless not `compact`), and start
        an empty block."""
        if self.rows > self._base:
            for c, col in self._expand().items():
                self._sealed[c].append(self._compact(col) if compact else col)
            self._count = 0
            self._ends, self._durations, self._opened = [], [], []
            self._waiting, self._dense = [], []
        self._base = self.rows

    def _expand(self) -> dict[str, np.ndarray]:
        """The staging block's rows as float64 / int64 columns (views of one new array: none of
        the buffer, which the next block reuses)."""
        records = self._records.view(np.int64)[:self._count * _FIELDS].reshape(-1, _FIELDS)
        k = records[:, 0]
        is_window = k < 0
        windows = np.flatnonzero(is_window)
        w = records[windows]  # a copy, in the window layout
        if len(windows):
            k = np.abs(k)
            as_rows = np.zeros((len(windows), _FIELDS), dtype=np.int64)
            as_rows[:, _W_DST] = w[:, _W_SRC]
            records[windows] = as_rows  # the numbers all its rows start from, in the row layout
        # each record's numbers in each of its rows: one copy of rows of a few dozen bytes (a
        # column at a time costs several times the instructions)
        rows = np.repeat(records, k, axis=0)
        times = rows.view(np.float64)
        cols: dict[str, np.ndarray] = {"start": times[:, 1], "duration": times[:, 2]}
        for i, c in enumerate(_ROW_INTS):
            cols[c] = rows[:, 3 + i]
        cols["num_seqs"] = cols["decode_tokens"] + cols["prefill_seqs"]
        if len(windows):
            first = (np.cumsum(k) - k)[windows]  # each window's first row in the block
            self._expand_windows(cols, w, np.repeat(is_window, k), first)
        for p, values in self._waiting:
            cols["waiting"][p:p + len(values)] = values
        for pos, columns in self._dense:
            n = len(columns["start"])
            for c, given in columns.items():
                cols[c][pos:pos + n] = given
        return cols

    def _expand_windows(self, cols: dict[str, np.ndarray], w: np.ndarray, rows: np.ndarray,
                        at: np.ndarray) -> None:
        """Write the windows' rows (`rows`: a mask of them; `at`: each one's first row) from their
        records `w` and their per-row numbers (see add_window and RepeatResult), over the numbers
        every row of a window starts from (its record's): row j (from 1) of a window of num_seqs b
        whose iterations have taken `taken` blocks by its end holds j * b more context tokens and
        token states, taken * block_size fewer free slots and taken * block_size - j * b more
        internal fragmentation; its last row the figures read after its finishes."""
        k = -w[:, 0]
        m = len(self._durations)
        first = np.cumsum(k) - k  # each window's first row among the window rows
        j = np.arange(m) - np.repeat(first, k) + 1  # each row's iteration in its window, from 1
        taken = np.cumsum(_ints(self._opened))  # blocks taken by each row's end, from the first window's start
        taken -= np.repeat(np.concatenate(([0], taken))[first], k)  # from its window's start
        # the growth on every row of the block (0 off the windows): two masked writes, then whole
        # columns added to (the masked writes cost several times a whole column's arithmetic)
        grown = np.zeros(len(rows), dtype=np.int64)
        grown[rows] = np.repeat(w[:, _W_SEQS], k) * j
        slots = np.zeros(len(rows), dtype=np.int64)
        slots[rows] = taken * np.repeat(w[:, _W_BLOCK], k)
        cols["context_tokens"] += grown
        cols["kv_token_states"] += grown
        cols["kv_internal_frag"] += slots - grown
        cols["kv_free"] -= slots
        last = at + k - 1
        for c, f in zip(("running", "kv_token_states", "kv_internal_frag", "kv_free"), range(_W_LAST, _W_LAST + 4)):
            cols[c][last] = w[:, f]
        ends = _floats(self._ends)
        starts = np.empty(m)
        starts[1:] = ends[:-1]
        starts[first] = w.view(np.float64)[:, 1]
        cols["start"][rows] = starts
        cols["duration"][rows] = _floats(self._durations)

    @classmethod
    def _compact(cls, col: np.ndarray) -> np.ndarray:
        """`col` in the narrowest type that holds every value exactly, contiguous (a copy when
        narrowed or a view: a kept view would keep its whole block's numbers alive)."""
        if col.dtype.kind == "i" and len(col):
            lo, hi = int(col.min()), int(col.max())
            for t, least, greatest in _NARROW_RANGES:
                if least <= lo and hi <= greatest:
                    return col.astype(t)
        return np.ascontiguousarray(col)

    def parts(self, c: str) -> list[np.ndarray]:
        """Column `c` in pieces, oldest first (each may be narrower than the column's type). Seals
        the staging block: reading expands what was written."""
        self._seal()
        return list(self._sealed[c]) or [np.zeros(0, dtype=self.dtype(c))]  # an empty log: one empty piece

    def pop_parts(self, c: str) -> list[np.ndarray]:
        """`parts(c)`, handed over: the log drops column `c` (and takes no more rows), so that a
        spent log's table is built a column at a time without the whole log beside it. Its last
        block stays wide: it is widened at once (compacting it would cost more than it saves)."""
        self._seal(compact=False)
        return self._sealed.pop(c) or [np.zeros(0, dtype=self.dtype(c))]

    def column(self, c: str) -> np.ndarray:
        """Column `c` in full, as float64 / int64 (a copy, not a view of the log)."""
        return np.concatenate(self.parts(c), dtype=self.dtype(c))

    def frame(self) -> pd.DataFrame:
        data = {"iteration": np.arange(self.rows)}
        data.update((c, self.column(c)) for c in ITERATION_COLUMNS)
        return pd.DataFrame(data, copy=False)


def _ints(values: list[int]) -> np.ndarray:
    """A flat list of Python ints as int64 (read-only), converted in C: struct reads each int
    directly, where np.fromiter / np.array convert element by element through numpy's generic
    packing (about four times the instructions)."""
    return np.frombuffer(struct.pack(f"{len(values)}q", *values), dtype=np.int64)


def _floats(values: list[float]) -> np.ndarray:
    """A flat list of Python floats as float64 (read-only), the same values bit for bit (see _ints)."""
    return np.frombuffer(struct.pack(f"{len(values)}d", *values), dtype=np.float64)


def iteration_compositions(iterations: pd.DataFrame, block_size: int = 16) -> list[StepComposition]:
    """The StepComposition of every row of an iterations table (the inverse of IterationLog.add)."""
    cols = {c: iterations[c].to_numpy(dtype=np.int64) for c in (
        "prefill_seqs", "prefill_tokens", "prefill_attn_pairs", "prefill_context_tokens", "decode_tokens",
        "context_tokens", "swap_in_blocks", "swap_out_blocks", "copy_blocks")}
    return [StepComposition(num_prefill_seqs=int(a), prefill_tokens=int(b), prefill_attn_pairs=int(c),
                            prefill_context_tokens=int(d), num_decode_seqs=int(e), decode_context_tokens=int(f - d),
                            swap_in_blocks=int(g), swap_out_blocks=int(h), copy_blocks=int(i), block_size=block_size)
            for a, b, c, d, e, f, g, h, i in zip(*cols.values())]


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
    are kept as numpy chunks, one per `add` (C numbers: `_ints`, `_floats`, no Python object per
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
            parts[c].append(_ints(ints))
        for c, floats in zip(_GATHERED_FLOATS, (arrival, scheduled, first, finish, slo_ttft, slo_tpot)):
            parts[c].append(_floats(floats))
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
            mapped = _ints([index.setdefault(v, len(index)) for v in s._codes[c]])  # a store's code -> the run's
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
    """`np.average(x, weights=weights)` of columns, bit for bit (numpy's: the products summed, over
    the weights' float64 sum), each product written into an array given or one scratch array kept
    for every call: np.average makes a new one per call (96 MB at a million requests, each of them
    pages the process touches for the first time)."""

    def __init__(self, weights: np.ndarray) -> None:
        self.weights = weights
        self.total = weights.sum(dtype=np.float64)
        self.scratch: np.ndarray | None = None

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> float:
        if out is None:
            out = self._scratch()
        np.multiply(x, self.weights, out=out, dtype=np.float64)
        return float(out.sum() / self.total)

    def of_blocks(self, blocks: Iterable[tuple[np.ndarray, ...]], fill: Callable[..., object]) -> float:
        """The average of the column that `fill(out, *block)` writes block by block into the
        scratch array (each block's rows in turn: a float64 slice of the block's length)."""
        out, at = self._scratch(), 0
        for block in blocks:
            n = len(block[0])
            fill(out[at:at + n], *block)
            at += n
        return self(out, out=out)  # float64(x) * w is x * w with x cast: the same bits

    def _scratch(self) -> np.ndarray:
        if self.scratch is None:
            self.scratch = np.empty(len(self.weights), dtype=np.float64)
        return self.scratch


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
