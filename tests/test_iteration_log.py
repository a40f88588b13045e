"""The iteration log's compact storage: whatever the mix of single rows and windows, block
boundaries and value ranges, its frame equals the rows written, as float64 / int64 columns."""

import numpy as np
import pandas as pd

from policies.memory import MemoryBreakdown
from policies.metrics import ITERATION_COLUMNS, IterationLog
from policies.plan import StepComposition


def _single(rng: np.random.Generator, start: float) -> tuple[tuple, dict[str, float | int]]:
    big = int(rng.choice([3, 200, 40_000, 3_000_000_000]))  # int8 .. beyond int32
    c = StepComposition(num_prefill_seqs=1, prefill_tokens=big, prefill_attn_pairs=big * 7, num_decode_seqs=5,
                        decode_context_tokens=int(rng.integers(0, 1000)), swap_out_blocks=int(rng.integers(0, 3)))
    mem = MemoryBreakdown(token_states=big, reserved=0, internal_frag=-big, external_frag=0, free=9)
    row = dict.fromkeys(ITERATION_COLUMNS, 0)
    row.update(start=start, duration=0.5, num_seqs=6, prefill_tokens=big, decode_tokens=5,
               context_tokens=c.decode_context_tokens, num_preempted=1, swap_out_blocks=c.swap_out_blocks,
               waiting=2, running=6, kv_token_states=big, kv_internal_frag=-big, kv_free=9, prefix_hits=3,
               prefill_seqs=1, prefill_attn_pairs=big * 7)
    return (start, 0.5, c, 1, 2, 6, mem, 3), row


def test_frame_equals_rows_written_across_blocks() -> None:
    rng = np.random.default_rng(0)
    log, rows, t = IterationLog(capacity=7), [], 0.0
    for _ in range(60):
        if rng.random() < 0.5:
            args, row = _single(rng, t)
            log.add(*args)
            rows.append(row)
            t += 0.5
        else:  # a window, sometimes longer than a staging block; two columns left out (stay 0)
            k = int(rng.integers(1, 12))
            cols = {"start": t + 0.25 * np.arange(k), "duration": np.full(k, 0.25),
                    "num_seqs": rng.integers(0, 2**40, k), "decode_tokens": rng.integers(-5, 5, k)}
            rows += [dict(dict.fromkeys(ITERATION_COLUMNS, 0), **{c: v[i] for c, v in cols.items()}) for i in range(k)]
            log.add_many(cols)
            t += 0.25 * k
    want = pd.DataFrame(rows, columns=list(ITERATION_COLUMNS)).astype(
        {c: "float64" if c in ("start", "duration") else "int64" for c in ITERATION_COLUMNS})
    want.insert(0, "iteration", np.arange(len(rows)))
    got = log.frame()
    assert log.rows == len(rows)
    pd.testing.assert_frame_equal(got, want)


def test_sealed_blocks_are_narrow_and_reading_widens() -> None:
    log = IterationLog(capacity=4)
    for first in (0, 3):  # the second window does not fit beside the first: the first is sealed
        log.add_many({"start": np.arange(first, first + 3.0), "duration": np.ones(3),
                      "waiting": np.arange(first, first + 3) * 1000})
    parts = log.parts("waiting")
    assert [p.dtype for p in parts] == [np.dtype(np.int16), np.dtype(np.int64)]  # sealed 0..2000; staging
    assert log.parts("kv_free")[0].dtype == np.int8  # an all-zero column costs a byte a row
    assert log.column("waiting").dtype == np.int64 and log.column("waiting").tolist() == list(range(0, 6000, 1000))
