"""The iteration log's compact storage: whatever the mix of single rows, window records (paged
RepeatResults, with their overrides) and column windows, block boundaries and value ranges, its
frame equals the rows written, as float64 / int64 columns, each row built here one by one."""

from itertools import accumulate

import numpy as np
import pandas as pd
import pytest

from policies.iteration_log import ITERATION_COLUMNS, IterationLog
from policies.memory import MemoryBreakdown
from policies.plan import RepeatResult, StepComposition

_BIG = [3, 200, 40_000, 3_000_000_000]  # int8 .. beyond int32


def _single(rng: np.random.Generator, start: float) -> tuple[tuple, dict[str, float | int]]:
    big = int(rng.choice(_BIG))
    c = StepComposition(num_prefill_seqs=1, prefill_tokens=big, prefill_attn_pairs=big * 7, num_decode_seqs=5,
                        decode_context_tokens=int(rng.integers(0, 1000)), swap_out_blocks=int(rng.integers(0, 3)))
    mem = MemoryBreakdown(token_states=big, reserved=0, internal_frag=-big, external_frag=0, free=9)
    row = dict.fromkeys(ITERATION_COLUMNS, 0)
    row.update(start=start, duration=0.5, num_seqs=6, prefill_tokens=big, decode_tokens=5,
               context_tokens=c.decode_context_tokens, num_preempted=1, swap_out_blocks=c.swap_out_blocks,
               waiting=2, running=6, kv_token_states=big, kv_internal_frag=-big, kv_free=9, prefix_hits=3,
               prefill_seqs=1, prefill_attn_pairs=big * 7)
    return (start, 0.5, c, 1, 2, 6, mem, 3), row


def _paged(rng: np.random.Generator, k: int) -> RepeatResult:
    """A random paged RepeatResult of k iterations, its last iteration's figures set apart (a
    finish) or as the opened blocks give them."""
    scale = int(rng.choice(_BIG))
    b, bs = int(rng.integers(1, 40)), int(rng.choice([1, 16, 32]))
    res = RepeatResult([int(x) for x in rng.integers(0, b + 1, k)], b, int(rng.integers(0, scale)),
                             int(rng.integers(0, scale)), int(rng.integers(0, scale)) * bs,
                             int(rng.integers(0, scale)) * bs, bs)
    res.last_running, res.last_states, res.last_internal, res.last_free = (
        int(x) for x in rng.integers(-scale, scale, 4))
    return res


def _paged_rows(start: float, ends: list[float], durations: list[float], k: int, res: RepeatResult,
                waiting: int | list[int], prefix_hits: int) -> list[dict[str, float | int]]:
    """add_window's rows, one at a time, as its docstring and RepeatResult's state them."""
    assert res.opened is not None
    rows, taken = [], 0
    for i in range(k):
        j = i + 1
        taken += res.opened[i]
        states = res.states0 + j * res.num_seqs
        row = dict.fromkeys(ITERATION_COLUMNS, 0)
        row.update(start=start if i == 0 else ends[i - 1], duration=durations[i], num_seqs=res.num_seqs,
                   decode_tokens=res.num_seqs, context_tokens=res.context_tokens + j * res.num_seqs,
                   waiting=waiting if isinstance(waiting, int) else waiting[i], prefix_hits=prefix_hits,
                   running=res.num_seqs, kv_token_states=states,
                   kv_internal_frag=res.allocated0 + taken * res.block_size - states,
                   kv_free=res.free0 - taken * res.block_size)
        if j == k:
            row.update(running=res.last_running, kv_token_states=res.last_states,
                       kv_internal_frag=res.last_internal, kv_free=res.last_free)
        rows.append(row)
    return rows


def _frame(rows: list[dict]) -> pd.DataFrame:
    want = pd.DataFrame(rows, columns=list(ITERATION_COLUMNS)).astype(
        {c: "float64" if c in ("start", "duration") else "int64" for c in ITERATION_COLUMNS})
    want.insert(0, "iteration", np.arange(len(rows)))
    return want


def _write_random(log: IterationLog, rng: np.random.Generator, n: int) -> list[dict]:
    """n random writes of each kind to `log`; returns the rows written, built one by one."""
    rows: list[dict] = []
    t = float(rng.random())
    for _ in range(n):
        kind = rng.random()
        if kind < 0.35:
            args, row = _single(rng, t)
            log.add(*args)
            rows.append(row)
            t += 0.5
        elif kind < 0.85:  # a paged window, sometimes longer than a staging block, maybe with a preempting tail
            k = int(rng.integers(1, 12))
            durations = [float(x) for x in rng.random(k + int(rng.integers(0, 2)))]
            ends = list(accumulate(durations, initial=t))[1:]
            res = _paged(rng, k)
            w0 = int(rng.integers(0, 300))
            waiting: int | list[int] = w0 if rng.random() < 0.6 else [w0 + int(x) for x in
                                                                       np.sort(rng.integers(0, 70_000, k))]
            hits = int(rng.choice([0, 7, 100_000]))
            log.add_window(t, ends, durations, k, res, waiting, hits)
            rows += _paged_rows(t, ends, durations, k, res, waiting, hits)
            t = ends[k - 1]
        else:  # columns, two left out (they stay 0), one given as one value for all
            k = int(rng.integers(1, 12))
            cols = {"start": t + 0.25 * np.arange(k), "duration": np.full(k, 0.25),
                    "num_seqs": rng.integers(0, 2**40, k), "decode_tokens": rng.integers(-5, 5, k), "running": 4}
            rows += [dict(dict.fromkeys(ITERATION_COLUMNS, 0), running=4,
                          **{c: v[i] for c, v in cols.items() if c != "running"}) for i in range(k)]
            log.add_many(cols)
            t += 0.25 * k
    return rows


@pytest.mark.parametrize("seed,capacity", [(0, 7), (1, 1), (2, 50), (3, 16384)])
def test_frame_equals_rows_written_across_blocks(seed: int, capacity: int) -> None:
    rng = np.random.default_rng(seed)
    log = IterationLog(capacity=capacity)
    rows = _write_random(log, rng, 80)
    assert log.rows == len(rows)
    pd.testing.assert_frame_equal(log.frame(), _frame(rows), check_exact=True)


def test_reading_midway_then_writing_on() -> None:
    """A read seals the staging block; rows written after it follow in order."""
    rng = np.random.default_rng(4)
    log = IterationLog(capacity=30)
    rows = _write_random(log, rng, 25)
    pd.testing.assert_frame_equal(log.frame(), _frame(rows), check_exact=True)
    rows += _write_random(log, rng, 25)
    pd.testing.assert_frame_equal(log.frame(), _frame(rows), check_exact=True)


def test_window_rows_from_a_paged_result() -> None:
    """One window by hand: the cumulative blocks and the last iteration's own figures."""
    log = IterationLog()
    res = RepeatResult([1, 0, 2], num_seqs=2, context_tokens=10, states0=100, allocated0=160, free0=64,
                             block_size=16)
    res.last_running, res.last_states, res.last_internal, res.last_free = 1, 90, 22, 80
    log.add_window(5.0, [5.5, 6.0, 6.5, 7.0], [0.5, 0.5, 0.5, 0.5], 3, res, [4, 4, 6], 9)
    f = log.frame()
    assert f.start.tolist() == [5.0, 5.5, 6.0] and f.duration.tolist() == [0.5] * 3
    assert f.context_tokens.tolist() == [12, 14, 16] and f.num_seqs.tolist() == [2, 2, 2]
    assert f.kv_token_states.tolist() == [102, 104, 90]
    assert f.kv_internal_frag.tolist() == [160 + 16 - 102, 160 + 16 - 104, 22]
    assert f.kv_free.tolist() == [48, 48, 80] and f.running.tolist() == [2, 2, 1]
    assert f.waiting.tolist() == [4, 4, 6] and f.prefix_hits.tolist() == [9, 9, 9]
    assert f.kv_reserved.tolist() == [0, 0, 0]


def test_sealed_blocks_are_narrow_and_reading_widens() -> None:
    log = IterationLog(capacity=4)
    for first in (0, 3):  # the second window fills the first block past its capacity: it is sealed
        log.add_many({"start": np.arange(first, first + 3.0), "duration": np.ones(3),
                      "waiting": np.arange(first, first + 3) * 1000})
    log.add_many({"start": np.arange(6, 9.0), "duration": np.ones(3), "waiting": np.arange(6, 9) * 1000})
    parts = log.parts("waiting")  # reading seals the rest
    assert [p.dtype for p in parts] == [np.dtype(np.int16), np.dtype(np.int16)]  # 0..5000; 6000..8000
    assert [len(p) for p in parts] == [6, 3]
    assert log.parts("kv_free")[0].dtype == np.int8  # an all-zero column costs a byte a row
    assert log.column("waiting").dtype == np.int64 and log.column("waiting").tolist() == list(range(0, 9000, 1000))


def test_an_empty_log_reads_as_empty_columns() -> None:
    log = IterationLog()
    assert len(log.frame()) == 0 and log.column("start").dtype == np.float64
    assert np.concatenate(log.pop_parts("waiting")).dtype == np.int64


def test_a_block_of_more_records_than_the_buffer_first_holds() -> None:
    """More single rows in one block than the record buffer's first size (it doubles), each row's
    numbers where it was written."""
    n = 70_000
    log = IterationLog(capacity=100_000)
    c = StepComposition(num_prefill_seqs=0, prefill_tokens=0, num_decode_seqs=3, decode_context_tokens=5)
    for i in range(n):
        log.add(i * 0.25, 0.125, c, 0, i % 1000, 3, MemoryBreakdown(i, 0, 0, 0, 2**40 - i), 0)
    assert log.column("start").tolist() == [i * 0.25 for i in range(n)]
    assert log.column("waiting").tolist() == [i % 1000 for i in range(n)]
    assert log.column("kv_free").tolist() == [2**40 - i for i in range(n)]
    assert log.column("kv_token_states").tolist() == list(range(n))


def test_seals_at_the_capacity_boundary_and_a_spent_log_hands_over_its_last_block_wide() -> None:
    """A block is sealed as soon as it holds `capacity` rows (a window may overfill it); the pieces
    read back in order; pop_parts hands the block still staged over as int64, unnarrowed."""
    rng = np.random.default_rng(5)
    log = IterationLog(capacity=3)
    rows: list[dict] = []
    args, row = _single(rng, 0.0)
    log.add(*args)
    rows.append(row)
    res = _paged(rng, 2)
    log.add_window(0.5, [1.0, 1.5], [0.5, 0.5], 2, res, 7, 0)  # exactly 3 rows: sealed
    rows += _paged_rows(0.5, [1.0, 1.5], [0.5, 0.5], 2, res, 7, 0)
    assert [len(p) for p in log._sealed["waiting"]] == [3]
    res = _paged(rng, 4)
    ends, durations = [2.0, 2.5, 3.0, 3.5, 4.0], [0.5] * 5  # one more: a preempting iteration's
    log.add_window(1.5, ends, durations, 4, res, [1, 2, 3, 4], 2)  # overfills: 4 rows, sealed
    rows += _paged_rows(1.5, ends, durations, 4, res, [1, 2, 3, 4], 2)
    args, row = _single(rng, 4.0)
    log.add(*args)  # staged
    rows.append(row)
    want = _frame(rows)
    assert [len(p) for p in log._sealed["waiting"]] == [3, 4]
    parts = log.pop_parts("waiting")
    assert [len(p) for p in parts] == [3, 4, 1] and parts[-1].dtype == np.int64
    assert np.concatenate(parts).tolist() == want.waiting.tolist()
    for c in ITERATION_COLUMNS:
        if c != "waiting":
            assert np.concatenate(log.pop_parts(c)).tolist() == want[c].tolist(), c


def test_writes_of_no_rows_log_nothing() -> None:
    log = IterationLog(capacity=4)
    log.add_many({"start": np.zeros(0), "duration": np.zeros(0)})
    log.add_window(1.0, [], [], 0, RepeatResult([], 2, 0, 0, 0, 0, 16), 0, 0)
    assert log.rows == 0 and len(log.frame()) == 0


def test_a_window_whose_numbers_do_not_match_its_steps_is_refused() -> None:
    log = IterationLog()
    res = RepeatResult([1, 0], 2, 0, 0, 0, 0, 16)
    with pytest.raises(ValueError, match="3 steps"):
        log.add_window(0.0, [1.0, 2.0], [1.0, 1.0], 3, res, 0, 0)
    assert log.rows == 0


def test_num_seqs_is_derived_for_written_rows_but_stays_as_given_by_columns() -> None:
    """A row's num_seqs is stored as prefill_seqs + decode_tokens (`add`, `add_window`); rows given
    as columns keep what they give, 0 when left out, whatever their other columns."""
    log = IterationLog()
    log.add(0.0, 1.0, StepComposition(num_prefill_seqs=2, num_decode_seqs=3), 0, 0, 5, MemoryBreakdown(0, 0, 0, 0, 0), 0)
    log.add_many({"start": [1.0, 2.0], "duration": [1.0, 1.0], "decode_tokens": [4, 4], "prefill_seqs": 1})
    log.add_many({"start": [3.0], "duration": [1.0], "decode_tokens": [4], "num_seqs": [9]})
    assert log.column("num_seqs").tolist() == [5, 0, 0, 9]
    assert log.column("decode_tokens").tolist() == [3, 4, 4, 4]
