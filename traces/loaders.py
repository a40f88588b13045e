"""Loaders for public LLM-serving trace formats and the project's own format.

``load_trace(path, format=None)`` reads a file into a ``Trace``. The format is detected from the
suffix and the column names (CSV header, Parquet schema, JSONL keys) unless given by name.

Every problem with the file's content raises ``TraceFormatError`` naming the file, the 1-based file
line (CSV, JSONL) or data row (Parquet) or the field, and what was expected. CSV line numbers
assume one record per line (no quoted newlines), which holds for all supported formats.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from traces.trace import MAX_ARRIVAL, Trace, split_ints

KNOWN_FORMATS = ("azure", "length-csv", "splitwise", "mooncake", "burstgpt", "pagesim")

MOONCAKE_BLOCK = 512  # Mooncake hash_ids name 512-token prompt blocks

# The largest token count a trace may hold: beyond 2**53 float64 (how CSV numbers are parsed) no
# longer holds every integer, and int64 (how lengths are stored) wraps at 2**63. No model's context
# comes near either.
MAX_LENGTH = 2**53

# Column aliases for Splitwise-style processed traces: Vidur's trace replay uses
# arrived_at/num_prefill_tokens/num_decode_tokens, splitwise-sim uses
# arrival_timestamp/prompt_size/token_size. All in seconds and tokens.
SPLITWISE_TIME = ("arrived_at", "arrival_timestamp", "arrival_time")
SPLITWISE_PROMPT = ("num_prefill_tokens", "prompt_size", "prompt_tokens", "input_tokens")
SPLITWISE_OUTPUT = ("num_decode_tokens", "token_size", "output_tokens", "completion_tokens")


class TraceFormatError(ValueError):
    """A trace file cannot be read as the requested or detected format."""


@dataclass(frozen=True)
class _Where:
    """How to name a location in the file being read, for error messages."""

    path: Path
    unit: str = "line"  # "line" for CSV/JSONL, "row" for Parquet
    first: int = 2  # CSV: data row 0 is file line 2 (line 1 is the header)

    def at(self, label: int) -> str:
        return f"{self.path}: {self.unit} {int(label) + self.first}"

    def fail(self, label: int, column: str, message: str) -> TraceFormatError:
        return TraceFormatError(f"{self.at(label)}: column {column!r}: {message}")


# ---------------------------------------------------------------- column validation


def _require(frame: pd.DataFrame, columns: tuple[str, ...], where: _Where, fmt: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise TraceFormatError(
            f"{where.path}: {fmt} format needs column(s) {missing}; found {list(frame.columns)}"
        )


def _first_alias(frame: pd.DataFrame, aliases: tuple[str, ...], where: _Where, what: str) -> str:
    for name in aliases:
        if name in frame.columns:
            return name
    raise TraceFormatError(
        f"{where.path}: splitwise format needs a {what} column (one of {list(aliases)}); "
        f"found {list(frame.columns)}"
    )


def _numeric(frame: pd.DataFrame, column: str, where: _Where, expected: str) -> pd.Series:
    """The column as float, failing at the first missing or non-numeric cell."""
    raw = frame[column]
    missing = raw.isna()
    if missing.any():
        raise where.fail(raw.index[missing.argmax()], column, f"missing value (NaN), expected {expected}")
    _refuse_booleans(raw, column, where, expected)
    values = pd.to_numeric(raw, errors="coerce")
    bad = values.isna()
    if bad.any():
        label = raw.index[bad.argmax()]
        raise where.fail(label, column, f"{raw[label]!r} is not a number, expected {expected}")
    return values.astype(np.float64)


def _refuse_booleans(raw: pd.Series, column: str, where: _Where, expected: str) -> None:
    """pandas reads a column of nothing but true/false as booleans, which to_numeric takes as 1/0:
    refuse it at its first row rather than replay ``True`` as a one-token length."""
    if raw.dtype == bool:
        raise where.fail(raw.index[0], column, f"{str(raw.iloc[0])!r} is not a number, expected {expected}")


def _lengths(frame: pd.DataFrame, column: str, where: _Where, minimum: int = 1) -> np.ndarray:
    """A token-length column as int64, every value an integer in [minimum, MAX_LENGTH]."""
    expected = "a positive integer token count" if minimum == 1 else f"an integer token count >= {minimum}"
    values = _numeric(frame, column, where, expected)
    frac = ~np.isfinite(values) | (values != np.floor(values))
    if frac.any():
        label = values.index[frac.argmax()]
        raise where.fail(label, column, f"non-integer length {float(values[label])!r}, expected {expected}")
    small = values < minimum
    if small.any():
        label = values.index[small.argmax()]
        kind = "zero" if values[label] == 0 else "negative"
        raise where.fail(label, column, f"{kind} length {int(values[label])}, expected {expected}")
    large = values > MAX_LENGTH
    if large.any():
        label = values.index[large.argmax()]
        raise where.fail(label, column, f"length {int(values[label])} is too large, expected at most 2**53")
    return values.to_numpy(np.int64)


def _seconds(frame: pd.DataFrame, column: str, where: _Where, scale: float = 1.0) -> np.ndarray:
    """A numeric timestamp column in seconds (``scale`` converts units), finite and >= 0."""
    values = _numeric(frame, column, where, "a timestamp >= 0")
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        label = values.index[bad.argmax()]
        raise where.fail(label, column, f"timestamp {float(values[label]):g}, expected a finite value >= 0")
    late = values * scale > MAX_ARRIVAL
    if late.any():
        label = values.index[late.argmax()]
        raise where.fail(label, column, f"timestamp {float(values[label]):g} is beyond 2**32 s (about 136 years), "
                                        "expected seconds from the trace's start")
    return values.to_numpy(np.float64) * scale


# ---------------------------------------------------------------- reading files


_TEXT_COLUMNS = {"prefix_hashes": str, "prompt_token_ids": str, "reject_reason": str, "client": str}


def _read_csv(path: Path) -> pd.DataFrame:
    """Read a CSV keeping file line numbers recoverable: index label i is file line i + 2."""
    try:
        # skip_blank_lines=False keeps blank lines as all-NaN rows so the index stays aligned with
        # file lines; dropping them afterwards keeps the original index labels.
        # Int-list columns stay strings: a column of single hashes would otherwise parse as
        # numbers, and as lossy floats when some cells are empty.
        frame = pd.read_csv(path, skip_blank_lines=False, skipinitialspace=True, dtype=_TEXT_COLUMNS)
    except UnicodeDecodeError as exc:
        raise _not_utf8(path) from exc
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise TraceFormatError(f"{path}: cannot parse as CSV: {exc}") from exc
    _refuse_repeated_columns(path)
    frame.columns = [str(c).strip() for c in frame.columns]
    frame = frame.dropna(how="all")
    if frame.empty:
        raise TraceFormatError(f"{path}: no requests (header only, expected at least one data line)")
    return frame


def _refuse_repeated_columns(path: Path) -> None:
    """pandas renames a repeated header name (``arrival``, ``arrival.1``) and the loader then reads
    only the first of the two, silently: refuse a header that names a column twice."""
    header = [c for c in _csv_header(path) if c]
    repeated = sorted({c for c in header if header.count(c) > 1})
    if repeated:
        raise TraceFormatError(f"{path}: header: column(s) {repeated} appear more than once, expected each once")


def _read_parquet(path: Path) -> pd.DataFrame:
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several unrelated types for corrupt files
        raise TraceFormatError(f"{path}: cannot read as Parquet: {exc}") from exc
    if frame.empty:
        raise TraceFormatError(f"{path}: no requests (expected at least one row)")
    return frame.reset_index(drop=True)


def _bad_byte(path: Path, lineno: int, raw: bytes, exc: UnicodeDecodeError) -> TraceFormatError:
    return TraceFormatError(f"{path}: line {lineno}: byte 0x{raw[exc.start:exc.start + 1].hex()} at column "
                            f"{exc.start + 1} is not UTF-8, expected UTF-8 text")


def _not_utf8(path: Path) -> TraceFormatError:
    """The error for a file that is not UTF-8, naming the first offending line and byte."""
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return _bad_byte(path, lineno, raw, exc)
    return TraceFormatError(f"{path}: not UTF-8 text")  # pragma: no cover - the decoder failed somewhere


def read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) for each non-blank line."""
    records = []
    with path.open("rb") as handle:  # bytes, so that a non-UTF-8 line is reported by its number
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a BOM, as CSV files may have
            except UnicodeDecodeError as exc:
                raise _bad_byte(path, lineno, raw, exc) from exc
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{path}: line {lineno}: unreadable JSON ({exc.msg})") from exc
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{path}: line {lineno}: expected a JSON object, got {type(obj).__name__}")
            records.append((lineno, obj))
    if not records:
        raise TraceFormatError(f"{path}: no requests (expected JSON lines)")
    return records


def _sorted_order(arrival: np.ndarray, path: Path) -> np.ndarray | None:
    """A stable sorting permutation if arrivals are out of order (with a warning), else None."""
    if not np.any(np.diff(arrival) < 0):
        return None
    warnings.warn(f"{path}: timestamps are not sorted; sorting {len(arrival)} requests by arrival", stacklevel=3)
    return np.argsort(arrival, kind="stable")


def _build(path: Path, arrival: np.ndarray | None, prompt: np.ndarray, output: np.ndarray, **extra: Any) -> Trace:
    """Make a Trace from validated columns, sorting by arrival (with a warning) if needed."""
    has_ts = arrival is not None
    arrival = np.zeros(len(prompt)) if arrival is None else arrival
    order = _sorted_order(arrival, path) if has_ts else None
    if order is not None:
        arrival, prompt, output = arrival[order], prompt[order], output[order]
        for key in ("prefix_hashes", "prompt_token_ids", "reject_reason", "client"):
            if extra.get(key) is not None:
                extra[key] = [extra[key][i] for i in order]
        for key in ("n", "beam_width", "priority", "slo_ttft", "slo_tpot"):
            if extra.get(key) is not None:
                extra[key] = extra[key][order]
    try:
        return Trace(arrival=arrival, prompt_len=prompt, output_len=output, name=path.stem, source=str(path),
                     has_timestamps=has_ts, **extra)
    except ValueError as exc:  # cross-column invariants (hash and token id counts), an Azure span past 2**32 s
        raise TraceFormatError(f"{path}: {exc}") from exc


# ---------------------------------------------------------------- per-format loaders


def _load_azure(path: Path) -> Trace:
    frame = _read_csv(path)
    where = _Where(path)
    _require(frame, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), where, "azure")
    raw = frame["TIMESTAMP"]
    _one_time_zone(raw, where)
    # pandas parses the 7 fractional digits that datetime.strptime's %f rejects.
    try:
        stamps = pd.to_datetime(raw, errors="coerce", format="ISO8601")
    except ValueError as exc:  # pragma: no cover - mixed zones are caught above; anything else pandas refuses
        raise TraceFormatError(f"{path}: column 'TIMESTAMP': {exc}") from exc
    bad = stamps.isna()
    if bad.any():
        label = raw.index[bad.argmax()]
        raise where.fail(label, "TIMESTAMP", f"{raw[label]!r} is not a date-time like 2023-11-16 18:15:46.6805900")
    arrival = (stamps - stamps.min()).dt.total_seconds().to_numpy(np.float64)
    return _build(path, arrival, _lengths(frame, "ContextTokens", where), _lengths(frame, "GeneratedTokens", where))


def _one_time_zone(raw: pd.Series, where: _Where) -> None:
    """Refuse date-times in more than one time zone (or some with a zone, some without): the
    arrival gaps between them would depend on a conversion the trace does not state."""
    zone = raw.astype(str).str.extract(r"\d\d:\d\d(?::\d\d(?:\.\d*)?)?\s*(Z|[+-]\d\d(?::?\d\d)?)?\s*$")[0]
    zone = zone.fillna("").str.replace(":", "", regex=False).replace({"Z": "+0000", "+00": "+0000", "-00": "+0000"})
    differs = (zone != zone.iloc[0]).to_numpy()
    if differs.any():
        label = raw.index[differs.argmax()]
        first, here = (z or "no zone" for z in (zone.iloc[0], zone[label]))
        raise where.fail(label, "TIMESTAMP", f"{raw[label]!r} is in time zone {here} but {where.unit} "
                                             f"{int(raw.index[0]) + where.first} is in {first}; expected one time "
                                             "zone throughout")


def _load_length_csv(path: Path) -> Trace:
    frame = _read_csv(path)
    where = _Where(path)
    _require(frame, ("num_prefill_tokens", "num_decode_tokens"), where, "length-csv")
    prompt = _lengths(frame, "num_prefill_tokens", where)
    return _build(path, None, prompt, _lengths(frame, "num_decode_tokens", where))


def _load_splitwise(path: Path) -> Trace:
    frame = _read_csv(path)
    where = _Where(path)
    time_col = _first_alias(frame, SPLITWISE_TIME, where, "arrival time")
    prompt_col = _first_alias(frame, SPLITWISE_PROMPT, where, "prompt length")
    output_col = _first_alias(frame, SPLITWISE_OUTPUT, where, "output length")
    arrival = _seconds(frame, time_col, where)
    return _build(path, arrival, _lengths(frame, prompt_col, where), _lengths(frame, output_col, where))


def _load_burstgpt(path: Path) -> Trace:
    frame = _read_csv(path)
    where = _Where(path)
    _require(frame, ("Timestamp", "Request tokens", "Response tokens"), where, "burstgpt")
    arrival = _seconds(frame, "Timestamp", where)
    prompt = _lengths(frame, "Request tokens", where, minimum=0)
    output = _lengths(frame, "Response tokens", where, minimum=0)
    # BurstGPT logs failed requests with zero request or response tokens: not work to replay, but
    # still input requests, so they stay as rows the simulator rejects on arrival with this reason.
    failed = np.flatnonzero((prompt == 0) | (output == 0))
    reasons = None
    if len(failed):
        warnings.warn(f"{path}: {len(failed)} failed requests (zero request or response tokens) kept as rejected "
                      "rows", stacklevel=3)
        reasons = [""] * len(prompt)
        for i in failed:
            reasons[i] = _zero_tokens(path, int(frame.index[i]) + where.first, prompt[i], output[i])
    return _build(path, arrival, prompt, output, reject_reason=reasons)


def _zero_tokens(path: Path, line: int, prompt: int, output: int) -> str:
    """The reject reason of a BurstGPT row with zero request and/or response tokens."""
    which = "request and response" if not (prompt or output) else "request" if not prompt else "response"
    return f"zero {which} tokens in the trace ({path.name} line {line})"


def _mooncake_int(obj: dict[str, Any], key: str, where: str, minimum: int) -> int:
    if key not in obj:
        raise TraceFormatError(f"{where}: missing field {key!r}; found {sorted(obj)}")
    value = obj[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value != int(value):
        raise TraceFormatError(f"{where}: field {key!r} = {value!r}, expected an integer >= {minimum}")
    if value < minimum:
        kind = "zero" if value == 0 else "negative"
        raise TraceFormatError(f"{where}: field {key!r} is {kind} ({value}), expected an integer >= {minimum}")
    if value > MAX_LENGTH:
        raise TraceFormatError(f"{where}: field {key!r} = {value!r} is too large, expected at most 2**53")
    return int(value)


def _mooncake_ms(obj: dict[str, Any], where: str) -> float:
    if "timestamp" not in obj:
        raise TraceFormatError(f"{where}: missing field 'timestamp'; found {sorted(obj)}")
    stamp = obj["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp) or stamp < 0:
        raise TraceFormatError(f"{where}: field 'timestamp' = {stamp!r}, expected milliseconds >= 0")
    if stamp / 1000.0 > MAX_ARRIVAL:
        raise TraceFormatError(f"{where}: field 'timestamp' = {stamp!r} ms is beyond 2**32 s (about 136 years), "
                               "expected milliseconds from the trace's start")
    return float(stamp)


def _mooncake_hashes(obj: dict[str, Any], where: str, prompt: int) -> tuple[int, ...]:
    value = obj["hash_ids"]
    if not isinstance(value, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in value):
        raise TraceFormatError(f"{where}: field 'hash_ids' must be a list of integers")
    if len(value) > -(-prompt // MOONCAKE_BLOCK):
        raise TraceFormatError(
            f"{where}: field 'hash_ids' has {len(value)} ids for input_length {prompt}, "
            f"expected at most ceil({prompt}/{MOONCAKE_BLOCK})"
        )
    return tuple(value)


def _load_mooncake(path: Path) -> Trace:
    records = read_jsonl(path)
    with_hashes = "hash_ids" in records[0][1]
    arrival, prompt, output, hashes = [], [], [], []
    for lineno, obj in records:
        where = f"{path}: line {lineno}"
        # Mooncake timestamps are integer milliseconds; accept fractional ms too.
        arrival.append(_mooncake_ms(obj, where) / 1000.0)
        prompt.append(_mooncake_int(obj, "input_length", where, 1))
        output.append(_mooncake_int(obj, "output_length", where, 1))
        if ("hash_ids" in obj) != with_hashes:
            state = "missing" if with_hashes else "present here but not on the first line"
            raise TraceFormatError(f"{where}: field 'hash_ids' {state}; expected on all lines or none")
        if with_hashes:
            hashes.append(_mooncake_hashes(obj, where, prompt[-1]))
    extra: dict[str, Any] = {}
    if with_hashes:
        extra = {"prefix_hashes": hashes, "hash_block_size": MOONCAKE_BLOCK}
    return _build(path, np.array(arrival), np.array(prompt, np.int64), np.array(output, np.int64), **extra)


def _load_pagesim(path: Path) -> Trace:
    parquet = path.suffix.lower() in (".parquet", ".pq")
    frame = _read_parquet(path) if parquet else _read_csv(path)
    where = _Where(path, unit="row", first=1) if parquet else _Where(path)
    _require(frame, ("prompt_len", "output_len"), where, "pagesim")
    arrival = None
    if "arrival" in frame and not frame["arrival"].isna().all():
        arrival = _seconds(frame, "arrival", where)  # partly empty column: error at first gap
    extra: dict[str, Any] = {}
    for column in ("n", "beam_width"):
        if column in frame:
            extra[column] = _lengths(frame, column, where)
    if "n" in extra and "beam_width" in extra:  # else the request's own error, after loading, naming no line
        both = (extra["n"] > 1) & (extra["beam_width"] > 1)
        if both.any():
            i = int(both.argmax())
            raise where.fail(frame.index[i], "beam_width", f"{extra['beam_width'][i]} with n {extra['n'][i]}, "
                                                           "expected parallel sampling (n > 1) or beam search, not both")
    if "prefix_hashes" in frame:
        extra.update(_pagesim_hashes(frame, where))
    if "prompt_token_ids" in frame:
        extra["prompt_token_ids"] = _token_ids(frame, where)
    extra.update(_classes(frame, where))
    # a row with a reject reason (a failed request kept from the source trace) may have zero tokens
    minimum = 1
    if "reject_reason" in frame:
        extra["reject_reason"] = frame["reject_reason"].fillna("").astype(str).str.strip().tolist()
        minimum = 0
    prompt = _lengths(frame, "prompt_len", where, minimum)
    output = _lengths(frame, "output_len", where, minimum)
    if minimum == 0:
        served = (frame["reject_reason"].fillna("").astype(str).str.strip() == "").to_numpy()
        for column, values in (("prompt_len", prompt), ("output_len", output)):
            bad = served & (values == 0)
            if bad.any():
                raise where.fail(frame.index[bad.argmax()], column, "zero length without a reject_reason, expected "
                                                                    "a positive integer token count")
    _check_list_lengths(frame, where, prompt, extra)
    return _build(path, arrival, prompt, output, **extra)


def _check_list_lengths(frame: pd.DataFrame, where: _Where, prompt: np.ndarray, extra: dict[str, Any]) -> None:
    """Token ids and prefix hashes against each row's prompt_len, at the row's line (Trace checks
    them too, but by request index, which sorting by arrival separates from the line)."""
    ids, hashes = extra.get("prompt_token_ids"), extra.get("prefix_hashes")
    for i, label in enumerate(frame.index):
        plen = int(prompt[i])
        if ids is not None and len(ids[i]) != plen:
            raise where.fail(label, "prompt_token_ids", f"{len(ids[i])} ids for prompt_len {plen}, expected one per "
                                                        "prompt token")
        if hashes is not None and len(hashes[i]) > -(-plen // extra["hash_block_size"]):
            block = extra["hash_block_size"]
            raise where.fail(label, "prefix_hashes", f"{len(hashes[i])} hashes for prompt_len {plen}, expected at "
                                                     f"most ceil({plen}/{block})")


def _classes(frame: pd.DataFrame, where: _Where) -> dict[str, Any]:
    """The optional client / priority / SLO-class columns that Trace.save writes (dropping them
    silently lost every request's client and class on a save/load round trip)."""
    extra: dict[str, Any] = {}
    if "client" in frame:
        extra["client"] = ["" if pd.isna(c) else str(c).strip() for c in frame["client"]]
    if "priority" in frame:
        values = _numeric(frame, "priority", where, "an integer priority")
        bad = ~np.isfinite(values) | (values != np.floor(values)) | (values.abs() >= 2.0**63)
        if bad.any():
            label = values.index[bad.argmax()]
            raise where.fail(label, "priority", f"{float(values[label])!r} is not an integer priority")
        extra["priority"] = values.to_numpy(np.int64)
    for column in ("slo_ttft", "slo_tpot"):
        if column in frame:  # empty cells: the run's SLO
            _refuse_booleans(frame[column], column, where, "a finite number of seconds > 0 (or empty)")
            values = pd.to_numeric(frame[column], errors="coerce")
            bad = (frame[column].notna() & values.isna()) | ~(values.isna() | ((values > 0) & np.isfinite(values)))
            if bad.any():
                label = values.index[bad.argmax()]
                raw = frame[column][label]
                shown = repr(raw) if isinstance(raw, str) else f"{float(raw):g}"
                raise where.fail(label, column, f"{shown}, expected a finite number of seconds > 0 (or empty for "
                                                "the run's)")
            extra[column] = values.to_numpy(np.float64)
    return extra


def _int_lists(frame: pd.DataFrame, column: str, where: _Where) -> list[list[int]]:
    out = []
    for label, value in frame[column].items():
        try:
            out.append(split_ints(value))
        except (TypeError, ValueError):
            raise where.fail(label, column, f"{value!r} is not space-separated integers") from None
    return out


def _token_ids(frame: pd.DataFrame, where: _Where) -> list[list[int]]:
    """The prompt_token_ids column; a negative id (no vocabulary has one) is refused at its line."""
    rows = _int_lists(frame, "prompt_token_ids", where)
    for label, row in zip(frame.index, rows):
        if row and min(row) < 0:
            raise where.fail(label, "prompt_token_ids", f"token id {min(row)} is negative, expected ids >= 0")
    return rows


def _pagesim_hashes(frame: pd.DataFrame, where: _Where) -> dict[str, Any]:
    if "hash_block_size" not in frame:
        raise TraceFormatError(f"{where.path}: column 'prefix_hashes' needs a 'hash_block_size' column")
    block = _lengths(frame, "hash_block_size", where)
    differs = block != block[0]
    if differs.any():
        label = frame.index[differs.argmax()]
        raise where.fail(label, "hash_block_size", f"{int(block[differs.argmax()])} differs from the first row's {block[0]}")
    hashes = [tuple(ids) for ids in _int_lists(frame, "prefix_hashes", where)]
    return {"prefix_hashes": hashes, "hash_block_size": int(block[0])}


LOADERS: dict[str, Callable[[Path], Trace]] = {
    "azure": _load_azure,
    "length-csv": _load_length_csv,
    "splitwise": _load_splitwise,
    "mooncake": _load_mooncake,
    "burstgpt": _load_burstgpt,
    "pagesim": _load_pagesim,
}


# ---------------------------------------------------------------- detection


def _csv_header(path: Path) -> list[str]:
    with path.open("r", encoding="utf-8-sig", errors="replace") as handle:
        for line in handle:
            if line.strip():
                return [c.strip().strip('"') for c in line.rstrip("\n").split(",")]
    return []


# each CSV format's required columns (splitwise's are alternatives: SPLITWISE_*), read by detection
# and by the error naming what a header that matches none of them lacks
_REQUIRED_COLUMNS = {"azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
                     "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
                     "pagesim": ("prompt_len", "output_len"),
                     "length-csv": ("num_prefill_tokens", "num_decode_tokens")}


def _format_from_columns(columns: list[str]) -> str | None:
    cols = set(columns)
    for fmt in ("azure", "burstgpt", "pagesim"):
        if set(_REQUIRED_COLUMNS[fmt]) <= cols:
            return fmt
    if all(cols & set(aliases) for aliases in (SPLITWISE_TIME, SPLITWISE_PROMPT, SPLITWISE_OUTPUT)):
        return "splitwise"
    return "length-csv" if set(_REQUIRED_COLUMNS["length-csv"]) <= cols else None


def _closest_format(columns: list[str]) -> str:
    """What the CSV format sharing most columns with `columns` lacks ("" when none shares any):
    a header missing one column named it only among all formats (was: "cannot detect")."""
    have = set(columns)
    fmt, need = max(_REQUIRED_COLUMNS.items(), key=lambda kv: len(have & set(kv[1])))
    if not have & set(need):
        return ""
    return f"; as a {fmt} trace it lacks column(s) {[c for c in need if c not in have]}"


def _jsonl_keys(path: Path) -> list[str]:
    with path.open("r", encoding="utf-8-sig", errors="replace") as handle:
        for lineno, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceFormatError(f"{path}: line {lineno}: unreadable JSON ({exc.msg})") from exc
                return sorted(obj) if isinstance(obj, dict) else []
    return []


def detect_format(path: str | Path) -> str:
    """The format name of ``path`` from its suffix and column names or JSON keys."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "pagesim"
    if suffix in (".jsonl", ".json"):
        keys = _jsonl_keys(path)
        if {"timestamp", "input_length", "output_length"} <= set(keys):
            return "mooncake"
        raise TraceFormatError(
            f"{path}: cannot detect trace format from JSON fields {keys}; expected Mooncake fields "
            f"timestamp, input_length, output_length[, hash_ids]. Known formats: {', '.join(KNOWN_FORMATS)}"
        )
    columns = _csv_header(path)
    fmt = _format_from_columns(columns)
    if fmt is None:
        raise TraceFormatError(
            f"{path}: cannot detect trace format from columns {columns}{_closest_format(columns)}; "
            f"pass a format, one of: {', '.join(KNOWN_FORMATS)}"
        )
    return fmt


def load_trace(path: str | Path, format: str | None = None) -> Trace:
    """Load a trace file; ``format`` is one of ``KNOWN_FORMATS`` or None to detect it.

    Raises FileNotFoundError if the file does not exist and TraceFormatError for unreadable or
    invalid content. Unsorted timestamps are sorted with a warning naming the file.
    """
    path = Path(path)
    if format is not None and format not in LOADERS:
        raise TraceFormatError(f"{path}: unknown trace format {format!r}; known formats: {', '.join(KNOWN_FORMATS)}")
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist")
    if path.stat().st_size == 0:
        raise TraceFormatError(f"{path}: file is empty, expected a trace")
    fmt = format or detect_format(path)
    return LOADERS[fmt](path)
