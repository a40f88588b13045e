"""Regressions from the adversarial review of issue 11: skip-ahead vs stepping under prefix caching,
side-effect-free admission, the iteration log's waiting column, disaggregated runs that never reach
a decode replica, and the LRU order of injected prefixes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from policies.block_manager import PagedBlockManager
from policies.request import Request, SamplingParams, SequenceGroup
from policies.vllm_scheduler import VllmScheduler
from sim.run import SimConfig, run_simulation
from traces import resolve_trace
from traces.trace import Trace


def _both(cfg: SimConfig, tr: Trace):
    return run_simulation(cfg, tr), run_simulation(dataclasses.replace(cfg, fast_forward=False), tr)


def _assert_same(a, b) -> None:
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)


def test_head_blocked_check_counts_the_prefix_hit():
    # the second prompt needs only its 16 uncached tokens once the first has cached the shared
    # block, which fits the budget left beside one decode: stepping admits it at once
    ids = [list(range(16)) + [100 + j for j in range(16)], list(range(16)) + [200 + j for j in range(16)]]
    tr = Trace(arrival=np.array([0.0, 0.0]), prompt_len=np.array([32, 32]), output_len=np.array([10, 10]),
               prompt_token_ids=ids)
    a, b = _both(SimConfig(num_gpu_blocks=100, max_num_batched_tokens=32, prefix_caching=True), tr)
    _assert_same(a, b)
    assert b.requests.ttft[1] < 0.1


def test_shared_prefix_workload_with_budget_near_prompt_size():
    tr = resolve_trace("shared-prefix", num_requests=120, rate=16.0, seed=1)  # prompts of 576 tokens
    for budget in (576, 600):
        a, b = _both(SimConfig(prefix_caching=True, max_num_batched_tokens=budget), tr)
        _assert_same(a, b)


def _req(i: int, ids: list[int], out: int = 5) -> Request:
    return Request(i, 0.0, len(ids), SamplingParams(max_tokens=out, ignore_eos=True), out, list(ids))


def test_failed_admission_changes_nothing():
    # two 168-token prompts sharing their first 16 tokens, budget 256: the second does not fit
    # beside the first in one iteration; its refused admission must not count hits or touch blocks
    shared = list(range(16))
    s = VllmScheduler(num_gpu_blocks=100, max_num_batched_tokens=256, prefix_caching=True)
    bm = s.bm
    s.add_request(_req(0, shared + list(range(1000, 1152))))
    s.add_request(_req(1, shared + list(range(2000, 2152))))
    plan = s.schedule(0.0)
    assert [x.seq_id for x in plan.seqs] == [0]  # request 1 waits
    assert (bm.prefix_hits, bm.prefix_queries) == (0, 10)
    assert len(s.waiting) == 1 and s.waiting[0].prefix_hit_tokens == 0
    assert s.waiting[0].seqs[0].seq_id not in bm.tables
    bm.check_invariants()


def test_prefix_hit_counters_agree_under_budget_pressure():
    tr_ids = [list(range(16)) + list(range(1000 * (i + 1), 1000 * (i + 1) + 152)) for i in range(2)]
    tr = Trace(arrival=np.array([0.0, 0.0]), prompt_len=np.array([168, 168]), output_len=np.array([5, 5]),
               prompt_token_ids=tr_ids)
    res = run_simulation(SimConfig(num_gpu_blocks=100, max_num_batched_tokens=256, prefix_caching=True), tr)
    hit_blocks = int(res.iterations.prefix_hits.iloc[-1])
    assert hit_blocks * 16 == int(res.requests.prefix_hit_tokens.sum()) == 16


def test_waiting_column_leaves_out_requests_rejected_on_arrival():
    tr = Trace(arrival=np.array([0.0, 0.0, 0.5]), prompt_len=np.array([10, 10, 3000]),
               output_len=np.array([200, 5, 5]))
    a, b = _both(SimConfig(max_num_seqs=1), tr)
    _assert_same(a, b)
    assert (b.requests.status == "rejected").sum() == 1


def test_disaggregated_run_with_no_decode_half():
    tr = Trace(arrival=np.array([0.0]), prompt_len=np.array([3000]), output_len=np.array([5]))
    res = run_simulation(SimConfig(disaggregate=(1, 1)), tr)
    assert res.requests.status.tolist() == ["rejected"]
    assert "context" in res.requests.reject_reason[0]


def test_injected_prefix_survives_one_eviction_like_a_computed_one():
    bs = 4
    ids = list(range(17))  # 4 full blocks, the last token left to compute

    def served_after_one_eviction(inject: bool) -> int:
        bm = PagedBlockManager(num_gpu_blocks=4, block_size=bs, enable_prefix_caching=True, watermark=0.0)
        req = _req(0, ids)
        if inject:
            assert bm.inject_prefix(req) == 4
        else:
            g = SequenceGroup(req, 0)
            seq = g.seqs[0]
            bm.allocate(seq)
            bm.append_slots(seq, 16)
            bm.free(seq)
        other = SequenceGroup(_req(1, [9999] * 3), 1).seqs[0]  # takes one free block: evicts the LRU one
        bm.allocate(other)
        assert bm.append_slots(other, 3) == []
        return bm.cached_prefix_blocks(req)

    assert served_after_one_eviction(False) == 3
    assert served_after_one_eviction(True) == 3


def test_disaggregated_run_keeps_unservable_trace_rows_as_rejected():
    tr = Trace(arrival=np.array([0.0, 0.1]), prompt_len=np.array([0, 30]), output_len=np.array([5, 5]),
               reject_reason=["zero tokens in the trace", ""])
    res = run_simulation(SimConfig(disaggregate=(1, 1)), tr)
    assert res.requests.status.tolist() == ["rejected", "finished"]
    assert res.requests.reject_reason[0] == "zero tokens in the trace"


def test_arrival_at_exactly_an_iteration_end_counts_alike_in_the_waiting_column():
    # a window counted an arrival at exactly an iteration's end in that row's waiting column; stepping
    # only when the arrival's SimPy timeout was created before the engine's (same-instant order)
    # found by the coincidence search of tests/test_fastpath_fuzz.py's author: two decodes, then one
    # arrival one ulp before the end of stepped iteration 19 and two at exactly its end
    base = Trace(arrival=np.array([0.0, 0.0]), prompt_len=np.array([100, 50]), output_len=np.array([300, 200]))
    cfg = SimConfig(max_num_seqs=2)
    e = float(run_simulation(dataclasses.replace(cfg, fast_forward=False), base).iterations.start[20])
    tr = Trace(arrival=np.array([0.0, 0.0, np.nextafter(e, 0.0), e, e]), prompt_len=np.array([100, 50, 20, 30, 40]),
               output_len=np.array([300, 200, 5, 40, 60]))
    a, b = _both(cfg, tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)  # the request rows agreed before the fix too
    _assert_same(a, b)  # row 19: waiting was 3 (window) against 1 (stepping)
    assert b.iterations.waiting[19] == 3
