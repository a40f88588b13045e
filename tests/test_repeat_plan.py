"""Skip-ahead as part of the scheduler/executor contract (issue 12): a scheduler offers a
RepeatPlan or nothing, the replica step (policies/step.py) decides the window, and any Scheduler
runs, with or without windows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from policies.contiguous_schedulers import OrcaScheduler
from policies.queue_policy import QueuePolicy
from policies.request import Request, SamplingParams, SequenceGroup
from policies.scheduler import Scheduler
from policies.step import ReplicaStep
from policies.vllm_scheduler import VllmScheduler, _block_horizon
from sim.cost_model import ConstantCostModel
from sim.executor import SimulatedExecutor
from sim.run import SimConfig, run_simulation
from traces import resolve_trace


class NoWindows(VllmScheduler):
    """The paged scheduler with the base's answers: no RepeatPlan or DecodeStepPlan, ever."""

    def plan_repeat(self, now: float):
        return Scheduler.plan_repeat(self, now)

    def plan_decode_step(self):
        return Scheduler.plan_decode_step(self)


class ReservingFcfs(OrcaScheduler):
    """A Scheduler that is not the paged one (Orca-max reservations), as an import path builds it."""

    def __init__(self, num_gpu_blocks: int, block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 4096, **paged_options) -> None:
        super().__init__(num_gpu_blocks * block_size, "max", 1, max_num_seqs, max_num_batched_tokens)


class LongestPromptFirst(QueuePolicy):
    """A policy written only against the QueuePolicy API: no fast path of its own."""

    name = "longest-prompt-first"
    reads = "request"  # the key reads the request only

    def key(self, group: SequenceGroup) -> tuple:
        return (-group.request.prompt_len, group.request.arrival, group.group_id)


def _trace():
    return resolve_trace("sharegpt-like", num_requests=150, rate=20.0, seed=5)


@pytest.mark.parametrize("policy", ["tests.test_repeat_plan:NoWindows", "tests.test_repeat_plan:ReservingFcfs"])
def test_a_scheduler_without_windows_runs_stepped(policy):
    tr = _trace()
    cfg = SimConfig(policy=policy, num_gpu_blocks=400)
    res = run_simulation(cfg, tr)
    e = res.summary["engine"]
    assert res.summary["num_finished"] == 150
    assert e["skip_windows"] == e["skipped_iterations"] == 0 and e["stepped_iterations"] == len(res.iterations)
    stepped = run_simulation(dataclasses.replace(cfg, fast_forward=False), tr)
    pd.testing.assert_frame_equal(res.requests, stepped.requests, check_exact=True)
    if policy.endswith("NoWindows"):  # it is the paged scheduler: the same run as vllm stepped
        vllm = run_simulation(dataclasses.replace(cfg, policy="vllm", fast_forward=False), tr)
        pd.testing.assert_frame_equal(res.iterations, vllm.iterations, check_exact=True)


def test_a_queue_policy_gets_windows_without_a_fast_path():
    tr = _trace()
    cfg = SimConfig(policy="tests.test_repeat_plan:LongestPromptFirst", num_gpu_blocks=400)
    a = run_simulation(cfg, tr)
    e = a.summary["engine"]
    assert e["skipped_iterations"] > 0 and e["skip_windows"] > 0
    b = run_simulation(dataclasses.replace(cfg, fast_forward=False), tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)
    fcfs = run_simulation(dataclasses.replace(cfg, policy="vllm"), tr)
    assert not a.requests.first_scheduled.equals(fcfs.requests.first_scheduled)  # the policy's order ran


def _decoding(n: int = 4, out: int = 40) -> tuple[VllmScheduler, SimulatedExecutor, ReplicaStep, float]:
    """A paged scheduler whose n requests have prefilled (stepped by hand, no clock but `now`)."""
    sched = VllmScheduler(num_gpu_blocks=200)
    ex = SimulatedExecutor(ConstantCostModel(prefill_per_token=0.001, decode_per_seq=0.01, base=0.1))
    for i in range(n):
        sched.add_request(Request(i, 0.0, 20 + i, SamplingParams(max_tokens=out + i, ignore_eos=True), out + i))
    rs = ReplicaStep(sched, ex)
    step = rs.begin(0.0)
    now = step.result.duration
    rs.complete(step, now)
    return sched, ex, rs, now


def test_begin_window_runs_to_the_first_finish_without_a_clock():
    sched, _ex, rs, now = _decoding()
    window = rs.begin_window(now)
    # the first request samples 40 tokens, one at prefill: 39 decodes, the last finishing it
    assert len(window.ends) == 39 and not window.exhaustion
    assert window.ends == list(np.cumsum([now] + window.durations)[1:])
    assert len(sched.running) == 3 and sched.done[0].request.request_id == 0
    assert sched.done[0].finish_time == window.ends[-1]
    assert rs.log.rows == 1  # the window's rows are logged once it has passed
    rs.complete_window(window)
    assert rs.log.rows == 1 + 39
    assert (rs.windows, rs.skipped, rs.stepped) == (1, 39, 1)


def test_begin_window_stops_before_an_arrival_that_could_be_admitted():
    _sched, _ex, rs, now = _decoding()
    # nothing waits, so an arrival at t = now + 0.5 would be admitted by the first iteration
    # starting at or after it: the window holds the iterations that start before it
    window = rs.begin_window(now, next_arrival=now + 0.5)
    d = 0.1 + 0.01 * 4
    assert len(window.ends) == int(np.ceil(0.5 / d))
    assert window.ends[-2] < now + 0.5 <= window.ends[-1]
    # behind a router every arrival reads the replica: the window ends before it
    _sched2, _, rs2, now2 = _decoding()
    rs2.routed = True
    window2 = rs2.begin_window(now2, next_arrival=now2 + 0.5)
    assert window2.ends[-1] < now2 + 0.5 and len(window2.ends) == len(window.ends) - 1


def test_apply_repeat_refuses_a_plan_widened_or_not_offered():
    sched, ex, _rs, now = _decoding()
    plan = sched.plan_repeat(now)
    plan.remaining = ex.remaining(plan)
    plan.steps += 1
    with pytest.raises(AssertionError, match="narrowed, not widened"):
        sched.apply_repeat(plan, now, ex.price)
    with pytest.raises(AssertionError, match="offered no RepeatPlan"):
        Scheduler.apply_repeat(sched, plan, now, ex.price)
    step = sched.plan_decode_step()
    with pytest.raises(AssertionError, match="with its remaining counts"):  # the executor's answer is missing
        sched.apply_decode_step(step, now, ex.execute)
    step = sched.plan_decode_step()
    step.remaining = ex.remaining(step)
    sched.schedule(now)  # the offer is stale once the scheduler changes
    with pytest.raises(AssertionError, match="current DecodeStepPlan"):
        sched.apply_decode_step(step, now, ex.execute)


@pytest.mark.parametrize("router", ["least-loaded", "cache-aware"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_routed_windows_run_through_block_exhaustion_once_every_request_has_arrived(router, preemption):
    # all 200 requests arrive within the first second, far above what 3 small replicas serve: the
    # long drain after the last arrival has no router call left to read a replica's state, so its
    # windows end with the preempting iteration as a single replica's do, and still equal stepping
    tr = resolve_trace("sharegpt-like", num_requests=200, rate=400.0, seed=7)
    cfg = SimConfig(num_gpu_blocks=250, replicas=3, router=router, preemption=preemption, debug=True)
    a = run_simulation(cfg, tr)
    e = a.summary["engine"]
    assert e["preempting_in_windows"] > 0 and a.summary["num_finished"] == 200
    b = run_simulation(dataclasses.replace(cfg, fast_forward=False), tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)


@pytest.mark.parametrize("policy", ["vtc", "sjf"])
def test_state_reading_policies_run_through_block_exhaustion_once_every_request_has_arrived(policy):
    # arrivals read these policies' state (on_queued), so their windows end before every arrival;
    # after the last one they keep the preempting iteration, and still equal stepping
    tr = resolve_trace("multi-client", num_requests=120, rate=200.0, seed=3)
    cfg = SimConfig(policy=policy, num_gpu_blocks=150)
    a = run_simulation(cfg, tr)
    assert a.summary["engine"]["preempting_in_windows"] > 0
    b = run_simulation(dataclasses.replace(cfg, fast_forward=False), tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)


def _state(sched: VllmScheduler) -> list:
    """Everything an iteration changes that the tables do not show: each group's sequences and
    their block tables, the free queue, the token states (read settled, as every reader outside
    the scheduler reads a running sequence)."""
    sched.settle()
    bm = sched.bm
    groups = [(g.group_id, g.first_scheduled, g.first_token_time, g.finish_time,
               [(s.num_computed, s.output_len, bm.tables.get(s.seq_id), bm.slots.get(s.seq_id)) for s in g.seqs])
              for q in (sched.running, sched.waiting, sched.done) for g in q]
    return [groups, bm.pool.free, bm.pool.used_filled]


class _RecordingExecutor:
    """An executor that records the (seq id, Sequence) pairs of every plan it executes and passes
    everything to `inner` (a wrapper: the compiled kernel's executor takes no attribute of its own)."""

    def __init__(self, inner, executed: list) -> None:
        self.inner, self.executed = inner, executed

    def execute(self, plan, comp):
        self.executed.append([(ss.seq_id, ss.seq) for ss in plan.seqs])
        return self.inner.execute(plan, comp)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.mark.parametrize("finishing", [False, True])
def test_an_admitting_iteration_is_applied_as_one_window_as_stepping_applies_it(finishing):
    # a request waits that the next iteration admits: no window of plain decodes, but that one
    # iteration (the batch's decodes, the admission, with `finishing` the first group's last token)
    # is applied at once, as begin, execute and complete would step it
    out = 2 if finishing else 40
    (a, _, rs_a, now), (b, _, rs_b, _) = _decoding(out=out), _decoding(out=out)
    for sched in (a, b):
        sched.add_request(Request(10, now, 30, SamplingParams(max_tokens=5, ignore_eos=True), 5))
    executed = []  # the partial plan is all the executor reads: each of its sequences comes with it
    rs_a.executor = _RecordingExecutor(rs_a.executor, executed)
    window = rs_a.begin_window(now)
    assert [[sid for sid, _ in e] for e in executed] == [([0] if finishing else []) + [a.running[-1].seqs[0].seq_id]]
    assert all(seq is not None and seq.seq_id == sid for sid, seq in executed[0])
    assert window is not None and len(window.ends) == 1 and not window.exhaustion
    assert a.running[-1].group_id == 10 and a.running[-1].first_scheduled == now
    # until its end the iteration runs, as stepping's: the finishing group still runs (counted as
    # outstanding by itself, not as departing), its end (complete_window) finishes it
    assert a.departing == 0 and not a.done and len(a.running) == 5 and a.outstanding == 5
    rs_a.complete_window(window)
    assert len(a.running) == 5 - finishing and a.outstanding == 5 - finishing
    step = rs_b.begin(now)
    rs_b.complete(step, now + step.result.duration)
    assert window.ends == [now + step.result.duration] and (rs_a.windows, rs_b.windows) == (1, 0)
    assert [g.group_id for g in a.done] == ([0] if finishing else [])
    assert _state(a) == _state(b)
    pd.testing.assert_frame_equal(rs_a.log.frame(), rs_b.log.frame(), check_exact=True)


def test_block_horizon_counts_the_steps_whose_blocks_fit():
    """_block_horizon against stepping the buckets one decode step at a time: bucket (q - r) mod bs
    opens its blocks at step r + 1 and every bs steps after; the horizon is the last step whose
    blocks, with all before it, fit in the free blocks."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        bs = int(rng.integers(1, 17))
        counts = [int(c) for c in rng.integers(0, 4, size=bs)]
        if not sum(counts):
            counts[int(rng.integers(bs))] = 1
        q, free = int(rng.integers(bs)), int(rng.integers(0, 6 * sum(counts)))
        taken = steps = 0
        while taken + counts[(q - steps) % bs] <= free:
            taken += counts[(q - steps) % bs]
            steps += 1
        assert _block_horizon(counts, q, sum(counts), free) == steps, (counts, q, free)
