"""Sequence state read outside the scheduler is exact whenever it is read (issue 23): a running-batch
member's exact properties add what it owes, a router handed the schedulers reads them materialised,
a queue policy told of service mid-window reads what stepping shows, and under --debug a read of an
owed field from outside the scheduler raises, naming the field and the reader."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import pandas as pd
import pytest

from policies import exact_reads
from policies.block_manager import PagedBlockManager
from policies.exact_reads import StaleReadError
from policies.queue_policy import QueuePolicy
from policies.registry import make_scheduler
from policies.request import Request, SequenceGroup
from policies.router import ROUTERS, Router
from policies.running_batch import RunningBatch
from policies.scheduler import Scheduler
from policies.vllm_scheduler import VllmScheduler
from sim.run import SimConfig, run_simulation
from tests.test_running_batch import decode_steps, plain_decoder
from traces import resolve_trace

checked = pytest.mark.skipif(exact_reads.GUARDED is None, reason="the read check needs the interpreted Sequence")


def _member(bm: PagedBlockManager, batch: RunningBatch, rid: int, prompt: int) -> SequenceGroup:
    """A plain decoder (prompt computed, one token sampled, token ids kept) joined to `batch`."""
    g = plain_decoder(bm, rid, prompt, keep_token_ids=True)
    batch.join(g.seqs[0])
    return g


def test_exact_reads_add_what_a_member_owes_and_materialise_all_pays_it_keeping_the_batch():
    bm = PagedBlockManager(100, block_size=4)
    batch = RunningBatch(bm, Scheduler.seq_demand)
    g = _member(bm, batch, 0, 5)
    s = g.seqs[0]
    decode_steps(batch, bm, 6)
    assert (s.owed, s.num_computed, s.output_len) == (6, 5, 1)  # stored: the clock at its anchor
    assert (s.exact_num_computed, s.exact_output_len, s.exact_num_tokens) == (11, 7, 12)
    assert s.exact_token_ids == [*range(5), 7, -1, -1, -1, -1, -1, -1] and len(s.token_ids) == 6
    assert g.output_len == 7 and "tokens=12, computed=11" in repr(s)
    context = batch.context()
    batch.materialise_all()
    assert (s.owed, s.num_computed, s.output_len, s.token_ids) == (0, 11, 7, s.exact_token_ids)
    assert s.batch is batch and batch.size == 1 and batch.context() == context  # still a member
    bm.check_invariants(batch.check([s]))
    batch.leave(s)
    assert s.batch is None and s.owed == 0 and s.exact_output_len == s.output_len == 7


@checked
def test_a_guarded_member_refuses_stale_reads_from_outside_the_scheduler_only():
    bm = PagedBlockManager(100, block_size=4)
    batch = RunningBatch(bm, Scheduler.seq_demand)
    s = _member(bm, batch, 0, 5).seqs[0]
    batch.guard_reads()
    late = _member(bm, batch, 1, 3).seqs[0]  # joins guarded
    assert s.output_len == 1 and late.num_tokens == 4  # owing nothing: exact, whoever reads
    batch.set_finishes([s, late], [50, 50])  # as a plan is told before it is applied
    decode_steps(batch, bm, 3)
    for seq in (s, late):
        with pytest.raises(StaleReadError, match=rf"test_exact_reads\.test_a_guarded.*read Sequence\.output_len "
                                                 rf"of sequence {seq.seq_id} .*owes 3 decode steps.*exact_output_len"):
            _ = seq.output_len
    with pytest.raises(StaleReadError, match=r"Sequence\.num_tokens .*exact_num_tokens"):
        _ = s.num_tokens
    with pytest.raises(StaleReadError, match=r"Sequence\.token_ids"):
        _ = s.token_ids
    assert s.exact_output_len == 4 and s.exact_num_computed == 8  # the exact reads pass
    bm.check_invariants(batch.check([s, late]))  # the scheduler's own reads pass
    batch.leave(s)  # materialises it (the batch reads its stored fields)
    assert s.output_len == 4 and s.num_tokens == 9  # exact now: anyone reads


def test_the_paged_schedulers_debug_check_turns_the_read_check_on():
    sched = make_scheduler("vllm", 64, 16)
    assert isinstance(sched, VllmScheduler) and not sched._batch.guarded
    sched.check_invariants()
    assert sched._batch.guarded == (exact_reads.GUARDED is not None)


# ------------------------------------------------------------------ a router handed the schedulers
class StateReadingRouter(Router):
    """Reads every running sequence's stored fields at each arrival (as a router handed the
    schedulers may) and sends the request to the replica with the fewest tokens."""

    name = "state-reading"
    reads = "scheduler"

    def __init__(self) -> None:
        self.seen: list[tuple[float, tuple]] = []

    def route(self, request: Request, replicas: Sequence[Scheduler]) -> int:
        assert all(s.owed == 0 for r in replicas for g in r.running for s in g.seqs)  # materialised
        views = tuple(tuple(sorted((s.seq_id, s.num_computed, s.output_len, s.num_tokens)
                                   for g in r.running for s in g.seqs)) for r in replicas)
        self.seen.append((request.arrival, views))
        loads = [sum(t[3] for t in v) for v in views]
        return loads.index(min(loads))


def _routed(monkeypatch, fast_forward: bool, trace):
    router = StateReadingRouter()
    monkeypatch.setitem(ROUTERS, router.name, lambda: router)
    res = run_simulation(SimConfig(replicas=3, router=router.name, num_gpu_blocks=400,
                                   fast_forward=fast_forward), trace)
    return res, router.seen


def test_a_router_reading_the_schedulers_sees_the_stepped_values(monkeypatch):
    trace = resolve_trace("sharegpt-like", num_requests=150, rate=6.0, seed=5)
    step, seen_step = _routed(monkeypatch, False, trace)
    fast, seen_fast = _routed(monkeypatch, True, trace)
    assert fast.summary["engine"]["skipped_iterations"] > 0  # windows ran between arrivals
    assert seen_fast == seen_step
    pd.testing.assert_frame_equal(fast.requests, step.requests)


# ------------------------------------------------------------------ a queue policy told of service
class ServiceLog(QueuePolicy):
    """FCFS recording, whenever it is told of service, the group's output length as read then."""

    name = "service-log"

    def __init__(self, log: list | None = None) -> None:
        self.log: list[tuple[int, int, int, int]] = log if log is not None else []

    def on_served(self, group: SequenceGroup, prefill_tokens: int, decode_tokens: int) -> None:
        self.log.append((group.group_id, group.output_len, prefill_tokens, decode_tokens))


class StaleServiceLog(ServiceLog):
    """The same, reading a sequence's stored field: stale while the running batch owes it steps."""

    name = "stale-service-log"

    def on_served(self, group: SequenceGroup, prefill_tokens: int, decode_tokens: int) -> None:
        self.log.append((group.group_id, group.seqs[0].output_len, prefill_tokens, decode_tokens))


def _per_iteration(log: list[tuple[int, int, int, int]]) -> dict[int, list[tuple[int, int, int]]]:
    """Each group's records, a window's k decode steps told at once spread over k iterations
    (what the group read at the first, plus one per iteration after)."""
    out: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for gid, out_len, prefill, decode in log:
        if prefill == 0 and decode > 1:
            out[gid] += [(out_len + j, 0, 1) for j in range(decode)]
        else:
            out[gid].append((out_len, prefill, decode))
    return dict(out)


def test_a_queue_policy_reading_output_len_mid_window_gets_the_stepped_value():
    trace = resolve_trace("sharegpt-like", num_requests=200, rate=8.0, seed=2)
    logs = {}
    for ff in (False, True):
        log: list[tuple[int, int, int, int]] = []
        res = run_simulation(SimConfig(num_gpu_blocks=300, policy=f"{__name__}:ServiceLog",
                                       policy_options={"log": log}, fast_forward=ff), trace)
        logs[ff] = (res, log)
    (step, step_log), (fast, fast_log) = logs[False], logs[True]
    assert fast.summary["engine"]["skipped_iterations"] > 0 and len(fast_log) < len(step_log)
    assert _per_iteration(fast_log) == _per_iteration(step_log)
    pd.testing.assert_frame_equal(fast.requests, step.requests)


# ------------------------------------------------------------------ --debug
@checked
def test_debug_names_a_policy_reading_a_stale_field():
    trace = resolve_trace("sharegpt-like", num_requests=120, rate=8.0, seed=2)
    with pytest.raises(StaleReadError, match=r"StaleServiceLog\.on_served \(.*test_exact_reads\.py:\d+\) read "
                                             r"Sequence\.output_len of sequence \d+ .*owes \d+ decode steps"):
        run_simulation(SimConfig(num_gpu_blocks=300, policy=f"{__name__}:StaleServiceLog", debug=True), trace)
    # stepping alone reads no owed field; nor does the same policy reading the exact property
    run_simulation(SimConfig(num_gpu_blocks=300, policy=f"{__name__}:StaleServiceLog", fast_forward=False), trace)
    res = run_simulation(SimConfig(num_gpu_blocks=300, policy=f"{__name__}:ServiceLog", debug=True), trace)
    assert res.summary["engine"]["contract_checked"]


@checked
@pytest.mark.parametrize("cfg", [
    {"policy": "vllm"}, {"policy": "priority"}, {"policy": "sjf"}, {"policy": "srpt", "preemption": "swap"},
    {"policy": "vtc"}, {"policy": "edf"},
    {"policy": "vllm", "replicas": 2, "router": "cache-aware", "prefix_caching": True},
    {"policy": "sjf", "replicas": 2, "router": "least-loaded"},
], ids=lambda c: "-".join(str(v) for v in c.values()))
def test_the_builtin_policies_and_routers_read_nothing_stale_under_debug(cfg):
    trace = resolve_trace("sharegpt-like", num_requests=150, rate=10.0, seed=7)
    blocks = 500 if cfg.get("preemption") == "swap" else 300
    kw = {"num_cpu_blocks": 200} if cfg.get("preemption") == "swap" else {}
    res = run_simulation(SimConfig(num_gpu_blocks=blocks, debug=True, **cfg, **kw), trace)
    assert res.summary["engine"]["contract_checked"] and res.summary["engine"]["skipped_iterations"] > 0
