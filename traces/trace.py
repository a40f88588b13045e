"""The Trace type: one workload, one entry per request, sorted by arrival.

A trace is the only thing the simulator and the live executor need to know about a workload: when
each request arrives, how long its prompt is, how many tokens it must generate, and (optionally)
which prompt blocks it shares with other requests.

Invariants (checked in ``Trace.__post_init__``):

- all per-request arrays have the same length N >= 0;
- ``arrival`` is float64, finite, >= 0 and non-decreasing (requests are in arrival order);
- ``prompt_len`` and ``output_len`` are int64 and >= 1, except on rows with a reject reason
  (below), where they are >= 0: such a row keeps the trace's own (possibly zero) lengths;
- ``n`` (parallel samples) and ``beam_width`` are int64 and >= 1;
- ``prefix_hashes``, when present, has one tuple per request; ``hash_block_size`` is then a
  positive int and request i has at most ceil(prompt_len[i] / hash_block_size) hashes. Hash j names
  tokens [j*B, (j+1)*B) of the prompt (the last one may be partial, as in Mooncake); equal hashes
  mean equal content *and* equal preceding content, so a shared hash sequence is a shared prefix;
- ``prompt_token_ids``, when present, has one list per request of exactly prompt_len[i] ids;
- ``reject_reason``, when present, has one string per request: "" for a request to serve, else why
  the request can never be served (e.g. BurstGPT logs failed requests with zero tokens). Such rows
  stay in the trace so that every input request gets a result row (rejected, with this reason);
- when ``has_timestamps`` is False, ``arrival`` is all zeros and an arrival process must be applied
  (see ``traces.arrivals.apply_arrivals``) before the trace is replayed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

# Columns of the project's own on-disk format (CSV or Parquet), in this order.
FRAME_COLUMNS = (
    "arrival",
    "prompt_len",
    "output_len",
    "n",
    "beam_width",
    "prefix_hashes",
    "hash_block_size",
    "prompt_token_ids",
    "reject_reason",
    "client",
    "priority",
    "slo_ttft",
    "slo_tpot",
)


# The latest arrival a trace may hold, in seconds (2**32, about 136 years): beyond it float64 resolves
# time more coarsely than a microsecond, so a request's latencies round to nothing against its
# arrival (an arrival of 1e300 s "finished" with TTFT 0 and a throughput of 1e12 req/s).
MAX_ARRIVAL = 2.0**32


def _int_array(values: Any, name: str, length: int | None = None) -> np.ndarray:
    """Return ``values`` as an int64 array, refusing fractional or non-finite entries."""
    arr = np.asarray(values)
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.floor(arr)):
            raise ValueError(f"{name} must hold integers")
    elif arr.dtype.kind not in "iub":
        raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")
    # casting wraps values beyond int64 (2**63 becomes -2**63): refuse them instead
    if arr.dtype.kind in "fu" and arr.size and np.any(arr >= 2.0**63 if arr.dtype.kind == "f" else arr > 2**63 - 1):
        raise ValueError(f"{name} holds a value >= 2**63, beyond int64")
    arr = arr.astype(np.int64).reshape(-1)
    if length is not None and len(arr) != length:
        raise ValueError(f"{name} has {len(arr)} entries, expected {length}")
    return arr


def _check_positive(arr: np.ndarray, name: str, exempt: np.ndarray | None = None) -> None:
    """Every entry >= 1; entries where ``exempt`` is True (rejected rows) need only be >= 0."""
    low = np.ones(len(arr), np.int64) if exempt is None else np.where(exempt, 0, 1)
    bad = arr < low
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] = {int(arr[i])}, expected an integer >= {int(low[i])}")


def _stats(values: np.ndarray, prefix: str) -> dict[str, float]:
    """Mean and tail percentiles of a length array, keyed ``{prefix}_mean`` etc."""
    if len(values) == 0:
        return {f"{prefix}_{k}": float("nan") for k in ("mean", "p50", "p90", "p99", "max")}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {
        f"{prefix}_mean": float(values.mean()),
        f"{prefix}_p50": float(p50),
        f"{prefix}_p90": float(p90),
        f"{prefix}_p99": float(p99),
        f"{prefix}_max": float(values.max()),
    }


def prefix_reuse(prefix_hashes: Sequence[Sequence[int]]) -> float:
    """Fraction of all hash blocks whose hash appeared in an *earlier* request.

    This is the hit rate an unbounded prefix cache would see replaying the trace in order, the
    upper bound on what prefix caching can save. Repeats inside one request do not count.
    """
    seen: set[int] = set()
    hits = total = 0
    for hashes in prefix_hashes:
        hits += sum(1 for h in hashes if h in seen)
        total += len(hashes)
        seen.update(hashes)
    return hits / total if total else 0.0


def join_ints(values: Sequence[int]) -> str:
    """Encode a sequence of ints as the space-separated string used on disk."""
    return " ".join(str(int(v)) for v in values)


def split_ints(text: Any) -> list[int]:
    """Decode a space-separated int string; empty or missing (NaN/None) means no ints."""
    if text is None or (isinstance(text, float) and np.isnan(text)):
        return []
    if isinstance(text, str):
        return [int(tok) for tok in text.split()]
    return [int(v) for v in text]  # already a sequence (e.g. from an in-memory frame)


@dataclass(frozen=True, eq=False)
class Trace:
    """A request trace; see the module docstring for the invariants. Immutable: methods that
    change something return a new Trace."""

    arrival: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    prefix_hashes: list[tuple[int, ...]] | None = None
    hash_block_size: int | None = None
    prompt_token_ids: list[list[int]] | None = None
    n: np.ndarray | None = None
    beam_width: np.ndarray | None = None
    name: str = ""
    source: str = ""
    has_timestamps: bool = True
    reject_reason: list[str] | None = None  # per request: "" to serve it, else why it cannot be served
    client: list[str] | None = None         # per request: who sent it (fair-share policies, per-client tables)
    priority: np.ndarray | None = None      # per request: int, lower is served first by `priority`
    slo_ttft: np.ndarray | None = None      # per request SLO class: TTFT / TPOT targets in s (NaN: the run's)
    slo_tpot: np.ndarray | None = None

    def __post_init__(self) -> None:
        size = len(np.asarray(self.prompt_len).reshape(-1))
        # Frozen dataclass: normalise fields in place via object.__setattr__, once, at creation.
        set_ = object.__setattr__
        set_(self, "prompt_len", _int_array(self.prompt_len, "prompt_len", size))
        set_(self, "output_len", _int_array(self.output_len, "output_len", size))
        for name in ("n", "beam_width"):
            value = getattr(self, name)
            arr = np.ones(size, np.int64) if value is None else _int_array(value, name, size)
            set_(self, name, arr)
        arrival = np.asarray(self.arrival, dtype=np.float64).reshape(-1)
        if len(arrival) != size:
            raise ValueError(f"arrival has {len(arrival)} entries, expected {size}")
        set_(self, "arrival", arrival)
        rejected = self._check_reasons()
        for name in ("prompt_len", "output_len"):
            _check_positive(getattr(self, name), name, rejected)
        for name in ("n", "beam_width"):
            _check_positive(getattr(self, name), name)
        self._check_arrival()
        self._check_hashes()
        self._check_token_ids()
        self._check_classes()

    def _check_classes(self) -> None:
        """Normalise and check the optional client / priority / SLO-class columns."""
        size, set_ = len(self), object.__setattr__
        if self.client is not None:
            clients = ["" if c is None or (isinstance(c, float) and np.isnan(c)) else str(c) for c in self.client]
            if len(clients) != size:
                raise ValueError(f"client has {len(clients)} entries, expected {size}")
            set_(self, "client", clients)
        if self.priority is not None:
            set_(self, "priority", _int_array(self.priority, "priority", size))
        for name in ("slo_ttft", "slo_tpot"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                arr = np.asarray(value, dtype=np.float64).reshape(-1)
            except (TypeError, ValueError):
                raise ValueError(f"{name} must hold numbers of seconds (empty or NaN for none)") from None
            if len(arr) != size:
                raise ValueError(f"{name} has {len(arr)} entries, expected {size}")
            bad = ~np.isnan(arr) & ~((arr > 0) & np.isfinite(arr))
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"{name}[{i}] = {arr[i]}, expected a finite number of seconds > 0 (or empty)")
            set_(self, name, arr)

    def _check_arrival(self) -> None:
        arr = self.arrival
        if not np.all(np.isfinite(arr)):
            raise ValueError("arrival must be finite")
        if len(arr) and arr.min() < 0:
            raise ValueError("arrival must be >= 0")
        if len(arr) and arr.max() > MAX_ARRIVAL:
            i = int(np.argmax(arr))
            raise ValueError(f"arrival[{i}] = {arr[i]:g} s is beyond 2**32 s (about 136 years), where float64 "
                             "time no longer resolves a microsecond")
        if np.any(np.diff(arr) < 0):
            raise ValueError("arrival must be sorted (non-decreasing)")
        if not self.has_timestamps and np.any(arr != 0):
            raise ValueError("a trace without timestamps must have all-zero arrival")

    def _check_reasons(self) -> np.ndarray | None:
        """Normalise ``reject_reason`` to a list of str (None when no row is rejected); return the
        mask of rejected rows, or None."""
        if self.reject_reason is None:
            return None
        reasons = ["" if r is None or (isinstance(r, float) and np.isnan(r)) else str(r) for r in self.reject_reason]
        if len(reasons) != len(self):
            raise ValueError(f"reject_reason has {len(reasons)} entries, expected {len(self)}")
        if not any(reasons):
            object.__setattr__(self, "reject_reason", None)
            return None
        object.__setattr__(self, "reject_reason", reasons)
        return np.array([bool(r) for r in reasons])

    @property
    def num_rejected(self) -> int:
        """Rows that can never be served (see ``reject_reason``)."""
        return 0 if self.reject_reason is None else sum(1 for r in self.reject_reason if r)

    def _check_hashes(self) -> None:
        if self.prefix_hashes is None:
            return
        hashes = [tuple(int(h) for h in hs) for hs in self.prefix_hashes]
        object.__setattr__(self, "prefix_hashes", hashes)
        if len(hashes) != len(self):
            raise ValueError(f"prefix_hashes has {len(hashes)} entries, expected {len(self)}")
        block = self.hash_block_size
        if not isinstance(block, (int, np.integer)) or block < 1:
            raise ValueError(f"hash_block_size must be a positive int with prefix_hashes, got {block!r}")
        object.__setattr__(self, "hash_block_size", int(block))
        for i, (hs, plen) in enumerate(zip(hashes, self.prompt_len)):
            if len(hs) > -(-int(plen) // block):
                raise ValueError(
                    f"request {i}: {len(hs)} prefix hashes for a {plen}-token prompt "
                    f"(at most ceil({plen}/{block}))"
                )

    def _check_token_ids(self) -> None:
        if self.prompt_token_ids is None:
            return
        ids = [[int(t) for t in row] for row in self.prompt_token_ids]
        object.__setattr__(self, "prompt_token_ids", ids)
        if len(ids) != len(self):
            raise ValueError(f"prompt_token_ids has {len(ids)} entries, expected {len(self)}")
        for i, (row, plen) in enumerate(zip(ids, self.prompt_len)):
            if len(row) != plen:
                raise ValueError(f"request {i}: {len(row)} prompt token ids, prompt_len is {plen}")
            if row and min(row) < 0:
                raise ValueError(f"request {i}: prompt token id {min(row)} is negative, expected ids >= 0")

    def __len__(self) -> int:
        return len(self.prompt_len)

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (by arrival)."""
        if n < 0:
            raise ValueError(f"head: n must be >= 0, got {n}")
        cut = slice(0, n)
        return dataclasses.replace(
            self,
            arrival=self.arrival[cut],
            prompt_len=self.prompt_len[cut],
            output_len=self.output_len[cut],
            n=self.n[cut],
            beam_width=self.beam_width[cut],
            prefix_hashes=None if self.prefix_hashes is None else self.prefix_hashes[cut],
            prompt_token_ids=None if self.prompt_token_ids is None else self.prompt_token_ids[cut],
            reject_reason=None if self.reject_reason is None else self.reject_reason[cut],
            client=None if self.client is None else self.client[cut],
            **{k: None if getattr(self, k) is None else getattr(self, k)[cut]
               for k in ("priority", "slo_ttft", "slo_tpot")},
        )

    def with_arrivals(self, arrival: np.ndarray) -> Trace:
        """The same requests with new arrival times (sorted, >= 0, one per request)."""
        return dataclasses.replace(self, arrival=np.asarray(arrival, np.float64), has_timestamps=True)

    def to_frame(self) -> pd.DataFrame:
        """The on-disk representation: one row per request, columns ``FRAME_COLUMNS``.

        ``arrival`` is NaN throughout when the trace has no timestamps; hashes and token ids are
        space-separated strings (columns omitted when absent, as is ``reject_reason`` when no row
        is rejected).
        """
        arrival = self.arrival if self.has_timestamps else np.full(len(self), np.nan)
        frame = pd.DataFrame(
            {
                "arrival": arrival,
                "prompt_len": self.prompt_len,
                "output_len": self.output_len,
                "n": self.n,
                "beam_width": self.beam_width,
            }
        )
        if self.prefix_hashes is not None:
            frame["prefix_hashes"] = [join_ints(hs) for hs in self.prefix_hashes]
            frame["hash_block_size"] = np.full(len(self), self.hash_block_size, np.int64)
        if self.prompt_token_ids is not None:
            frame["prompt_token_ids"] = [join_ints(ids) for ids in self.prompt_token_ids]
        if self.reject_reason is not None:
            frame["reject_reason"] = self.reject_reason
        for name in ("client", "priority", "slo_ttft", "slo_tpot"):
            if getattr(self, name) is not None:
                frame[name] = getattr(self, name)
        return frame

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, name: str = "", source: str = "") -> Trace:
        """Inverse of ``to_frame`` (rows must already be in arrival order).

        Raises ValueError on invalid content; ``traces.loaders`` validates files row by row first
        so that users get file and line numbers.
        """
        has_ts = "arrival" in frame and not frame["arrival"].isna().all()
        arrival = frame["arrival"].to_numpy(np.float64) if has_ts else np.zeros(len(frame))
        hashes = block = None
        if "prefix_hashes" in frame:
            hashes = [tuple(split_ints(v)) for v in frame["prefix_hashes"]]
            block = int(frame["hash_block_size"].iloc[0]) if len(frame) else 1
        ids = None
        if "prompt_token_ids" in frame:
            ids = [split_ints(v) for v in frame["prompt_token_ids"]]
        reasons = list(frame["reject_reason"]) if "reject_reason" in frame else None
        return cls(
            arrival=arrival,
            prompt_len=frame["prompt_len"].to_numpy(),
            output_len=frame["output_len"].to_numpy(),
            n=frame["n"].to_numpy() if "n" in frame else None,
            beam_width=frame["beam_width"].to_numpy() if "beam_width" in frame else None,
            prefix_hashes=hashes,
            hash_block_size=block,
            prompt_token_ids=ids,
            reject_reason=reasons,
            client=list(frame["client"]) if "client" in frame else None,
            **{k: frame[k].to_numpy() for k in ("priority", "slo_ttft", "slo_tpot") if k in frame},
            name=name,
            source=source,
            has_timestamps=has_ts,
        )

    def save(self, path: str | Path) -> Path:
        """Write the project's own format; ``.csv`` or ``.parquet`` chosen by suffix."""
        path = Path(path)
        frame = self.to_frame()
        suffix = path.suffix.lower()
        if suffix == ".csv":
            frame.to_csv(path, index=False)
        elif suffix in (".parquet", ".pq"):
            frame.to_parquet(path, index=False)
        else:
            raise ValueError(f"save: unsupported suffix {path.suffix!r} for {path}; use .csv or .parquet")
        return path

    def info(self) -> dict[str, Any]:
        """Summary statistics: size, timing (when timestamps exist), lengths and prefix reuse.

        ``mean_rate`` is (N-1)/duration, the inverse of the mean inter-arrival time;
        ``interarrival_cv`` is std/mean of inter-arrival times (1 for Poisson, >1 bursty).
        ``num_requests`` counts every row; the length statistics cover the rows to serve, and
        ``rejected`` (present when nonzero) counts the others.
        """
        out: dict[str, Any] = {"name": self.name, "num_requests": len(self), "has_timestamps": self.has_timestamps}
        out.update(self._timing())
        serve = slice(None) if self.reject_reason is None else np.array([not r for r in self.reject_reason], bool)
        out.update(_stats(self.prompt_len[serve], "prompt"))
        out.update(_stats(self.output_len[serve], "output"))
        if self.prefix_hashes is not None:
            out["hash_block_size"] = self.hash_block_size
            out["prefix_reuse"] = prefix_reuse(self.prefix_hashes)
        if self.num_rejected:
            out["rejected"] = self.num_rejected
        return out

    def _timing(self) -> dict[str, float | None]:
        if not self.has_timestamps or len(self) < 2:
            return {"duration_s": None, "mean_rate": None, "interarrival_cv": None}
        gaps = np.diff(self.arrival)
        duration = float(self.arrival[-1] - self.arrival[0])
        mean_gap = float(gaps.mean())
        return {
            "duration_s": duration,
            "mean_rate": (len(self) - 1) / duration if duration > 0 else None,
            "interarrival_cv": float(gaps.std() / mean_gap) if mean_gap > 0 else None,
        }
