"""A run's iteration table, each column built from the replicas' logs when it is first read.

A million-request run logs ~12 million iterations: 2.3 GB as the table's int64 / float64 columns
against ~0.5 GB as the logs' compact pieces, and on a virtual machine most of the table's cost is
the first touch of its fresh pages. The run's summary reads eight columns; a study, a sweep or a
capacity plan reads the summary and the request table. So the table is kept as the logs' pieces
and a column is built when something reads it (SimResult.iterations builds them all).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pandas as pd

from policies.iteration_log import ITERATION_COLUMNS, IterationLog
from sim.cluster import return_freed_memory

# the pieces' bytes dropped between two returns of freed memory to the system: enough to bound a
# million-request run's peak, few enough that a small run's freed pages are reused rather than
# returned and faulted in again
_TRIM_BYTES = 64 << 20


class IterationTable:
    """The iteration table of the replicas whose logs it was given: each log's rows in the order
    written, one log after another, an `iteration` column counting each log's rows from 0 and, with
    more than one log, a `replica` column naming whose (one log: exactly its frame).

    Invariants: the logs are emptied when the table is made (their pieces are held here, numpy
    arrays only, so a table pickles); every column's pieces split the rows alike (`_splits`: a
    log's blocks, one log after another); a column is built at most once, is kept, and is the same
    array in every frame returned; its pieces are dropped when it is built."""

    def __init__(self, logs: list[IterationLog], replicas: list[int]) -> None:
        if len(logs) != len(replicas):
            raise ValueError(f"IterationTable: {len(logs)} logs for {len(replicas)} replica indices")
        self._rows = [log.rows for log in logs]
        self._replicas = replicas
        self._pieces = {c: [] for c in ITERATION_COLUMNS}
        for log in logs:
            for c in ITERATION_COLUMNS:
                self._pieces[c] += log.pop_parts(c)
        self._splits = [len(piece) for piece in self._pieces[ITERATION_COLUMNS[0]]]
        self._built: dict[str, np.ndarray] = {}
        self._freed = 0  # pieces' bytes dropped since memory was last handed back
        self.names = ("iteration", *ITERATION_COLUMNS, *(("replica",) if len(logs) > 1 else ()))

    def __len__(self) -> int:
        return sum(self._rows)

    def column(self, c: str) -> np.ndarray:
        """Column `c` as int64 / float64 (KeyError naming it if the table has no such column)."""
        if c not in self._built:
            if c not in self.names:
                raise KeyError(f"the iteration table has no column {c!r} (columns: {', '.join(self.names)})")
            self._built[c] = self._build(c)
        return self._built[c]

    def frame(self, columns: Iterable[str] | None = None) -> pd.DataFrame:
        """The table, or only `columns` of it (in the table's order), sharing the built arrays."""
        wanted = self.names if columns is None else set(columns)
        for c in wanted:
            self.column(c)  # an unknown name fails here
        return pd.DataFrame({c: self._built[c] for c in self.names if c in wanted}, copy=False)

    def blocks(self, names: Iterable[str]) -> Iterator[tuple[np.ndarray, ...]]:
        """The columns `names` block by block (the same rows in each; in order): what has not been
        built as its pieces (perhaps narrower than the column's type), what has as slices of it.
        Reads that go row-wise through a few columns need no whole column of each."""
        names = list(names)
        pieces = [self._pieces.get(c) if c not in self._built else None for c in names]
        built = [self.column(c) if p is None else None for c, p in zip(names, pieces)]
        at = 0
        for i, n in enumerate(self._splits):
            yield tuple(p[i] if p is not None else b[at:at + n] for p, b in zip(pieces, built))
            at += n

    def _build(self, c: str) -> np.ndarray:
        if c == "iteration":
            return np.concatenate([np.arange(n, dtype=np.int64) for n in self._rows] or [np.zeros(0, np.int64)])
        if c == "replica":
            return np.repeat(np.array(self._replicas, dtype=np.int64), self._rows)
        # allocated once, each log's pieces copied into their rows (widened as np.concatenate
        # widens them: the same values) and dropped, memory handed back as it goes
        column = np.empty(len(self), dtype=IterationLog.dtype(c))
        at = 0
        pieces = self._pieces.pop(c)
        pieces.reverse()  # popped from the end: each piece let go once copied
        while pieces:
            piece = pieces.pop()
            column[at:at + len(piece)] = piece
            at += len(piece)
            self._freed += piece.nbytes
            del piece
            if self._freed >= _TRIM_BYTES:
                return_freed_memory()
                self._freed = 0
        return column
