"""Scheduler.abort: a request ended from outside (client gone, server stopping) leaves every queue,
frees its memory through the block pool, and is recorded once as aborted with the reason."""

from __future__ import annotations

import pytest

from policies.registry import make_scheduler
from policies.request import Request, SamplingParams
from tests.policy_helpers import ToyExecutor


def _req(i: int, prompt: int = 40, out: int = 30, n: int = 1, arrival: float = 0.0) -> Request:
    return Request(i, arrival, prompt, SamplingParams(max_tokens=out, ignore_eos=True, n=n), output_len=out,
                   prompt_token_ids=[1 + (i + j) % 7 for j in range(prompt)])


def _step(sched, ex, now: float) -> None:
    plan = sched.schedule(now)
    sched.on_step_done(plan, ex.execute(plan), now + 1.0)


def _whole(sched) -> None:
    """No request left: every block free, no table, nothing counted twice."""
    sched.check_conservation()
    sched.bm.assert_empty()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_abort_running_and_waiting_leaves_the_pool_whole(prefix_caching):
    # 12 blocks of 16: room for two 40+30-token requests at once, the third waits
    sched = make_scheduler("vllm", 14, 16, prefix_caching=prefix_caching, max_num_seqs=2)
    ex = ToyExecutor(sched)
    for i in range(3):
        sched.add_request(_req(i))
    for t in range(4):
        _step(sched, ex, float(t))
    assert [g.group_id for g in sched.running] == [0, 1] and [g.group_id for g in sched.waiting] == [2]
    assert sched.abort(1, 5.0, "aborted: client disconnected").group_id == 1  # running
    assert sched.abort(2, 5.0, "aborted: client disconnected").group_id == 2  # waiting
    assert sched.abort(2, 5.0) is None  # already done: nothing happens twice
    assert sched.abort(99, 5.0) is None  # never added
    sched.bm.check_invariants()
    assert [g.group_id for g in sched.running] == [0] and not sched.waiting
    aborted = {g.group_id: g for g in sched.done}
    assert aborted[1].rejected == "aborted: client disconnected" and aborted[1].output_len == 4
    assert aborted[1].aborted and aborted[1].first_token_time is not None  # what it got before is kept
    assert aborted[2].output_len == 0 and aborted[2].finish_time == 5.0
    sched.abort(0, 6.0)
    _whole(sched)
    assert len(sched.done) == 3


def test_abort_forked_group_frees_shared_blocks():
    sched = make_scheduler("vllm", 32, 16)
    ex = ToyExecutor(sched)
    sched.add_request(_req(0, n=3))
    for t in range(3):
        _step(sched, ex, float(t))
    (group,) = sched.running
    assert len(group.seqs) == 3
    sched.abort(0, 3.0)
    _whole(sched)
    assert len(group.finished_seqs) == 3 and group.output_len == 3


def test_abort_swapped_group_frees_its_cpu_blocks():
    # recompute-free swap preemption: the later request is swapped out when blocks run short
    sched = make_scheduler("vllm", 8, 16, num_cpu_blocks=8, preemption="swap", watermark=0.0)
    ex = ToyExecutor(sched)
    sched.add_request(_req(0, prompt=40, out=60))
    sched.add_request(_req(1, prompt=40, out=60))
    t = 0.0
    while not sched.swapped:
        _step(sched, ex, t)
        t += 1
        assert t < 100, "no swap happened"
    gid = sched.swapped[0].group_id
    assert sched.bm.cpu.num_free < 8
    sched.abort(gid, t, "aborted: client disconnected")
    sched.bm.check_invariants()
    assert sched.bm.cpu.num_free == 8 and not sched.swapped
    while sched.has_unfinished():
        _step(sched, ex, t)
        t += 1
    _whole(sched)


def test_abort_on_a_contiguous_scheduler():
    sched = make_scheduler("orca-max", 64, 16, alloc_unit=16)
    ex = ToyExecutor(sched)
    for i in range(2):
        sched.add_request(_req(i))
    _step(sched, ex, 0.0)
    for g in list(sched.running) + list(sched.waiting):
        sched.abort(g.group_id, 1.0)
    sched.check_conservation()
    assert sched.memory().free == 64 * 16


@pytest.mark.parametrize("policy", ["vllm", "sjf", "priority", "edf", "vtc", "srpt"])
def test_abort_a_waiting_request_under_every_queue(policy):
    # the waiting queue is a deque (vllm), a heap on a fixed key (sjf, priority, edf), one FIFO per
    # client (vtc) or a queue re-read as keys change: each must let an aborted request out, and the
    # rest still come out in the policy's order
    sched = make_scheduler(policy, 14, 16, max_num_seqs=1)
    ex = ToyExecutor(sched)
    for i in range(4):
        sched.add_request(_req(i, out=3 + i, arrival=0.1 * i))
    before = [g.group_id for g in sched.waiting]
    assert sched.abort(2, 0.5, "aborted: client disconnected").group_id == 2
    assert sched.abort(2, 0.5) is None
    assert sorted(g.group_id for g in sched.waiting) == sorted(i for i in before if i != 2)
    assert len(sched.waiting) == 3
    order = []
    t = 1.0
    while sched.has_unfinished():
        _step(sched, ex, t)
        t += 1.0
        order.extend(g.group_id for g in sched.done if g.group_id not in order and g.group_id != 2)
    assert sorted(order) == [0, 1, 3]
    assert {g.group_id: g.aborted for g in sched.done} == {0: False, 1: False, 2: True, 3: False}
    _whole(sched)
