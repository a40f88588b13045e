"""A row per engine iteration, in one form for simulation and live runs (both executors write it, so it
lives with the shared contract in policies/): the columns (`ITERATION_COLUMNS`), the log an engine
writes as it runs (`IterationLog`), and the compositions read back from a table."""

from __future__ import annotations

import struct
from typing import Final

import numpy as np
import pandas as pd

from policies.memory import MemoryBreakdown
from policies.plan import RepeatResult, StepComposition

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
        taken = np.cumsum(int64_array(self._opened))  # blocks taken by each row's end, from the first window's start
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
        ends = float64_array(self._ends)
        starts = np.empty(m)
        starts[1:] = ends[:-1]
        starts[first] = w.view(np.float64)[:, 1]
        cols["start"][rows] = starts
        cols["duration"][rows] = float64_array(self._durations)

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


def int64_array(values: list[int]) -> np.ndarray:
    """A flat list of Python ints as int64 (read-only), converted in C: struct reads each int
    directly, where np.fromiter / np.array convert element by element through numpy's generic
    packing (about four times the instructions)."""
    return np.frombuffer(struct.pack(f"{len(values)}q", *values), dtype=np.int64)


def float64_array(values: list[float]) -> np.ndarray:
    """A flat list of Python floats as float64 (read-only), the same values bit for bit (see int64_array)."""
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
