"""A decode step (the one-iteration window, policies/step.py) passes arrivals under a policy that reads
its own state (issue 23): its start is applied at begin_window, its end (the policy told the
service, the finishes) at complete_window, so an arrival during it reads the policy and the running
members as stepping's iteration leaves them while it runs. The runs below have arrivals inside
decode steps; each equals stepping bit for bit and steps fewer iterations than the rule before
(which a replica whose arrivals read its whole state still follows: decode steps stepped while
arrivals remain). Applied whole at its start instead (the end half too), both policies' runs
differ from stepping on this trace (checked by hand when this was written)."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import simpy

from policies.plan import DecodeStepResult, StepPlan
from policies.queue_policy import QueuePolicy
from policies.request import Request, SamplingParams, SequenceGroup
from policies.trace_requests import requests_from_trace
from sim.cluster import run_replicas, sim_replica
from sim.engine import ArrivalFeed, Replica
from sim.run import SimConfig, build_cost_model, run_simulation
from tests.test_repeat_plan import _decoding
from traces import resolve_trace


class RunningLengthsAtQueueing(QueuePolicy):
    """reads "state": a queued group's key comes from what the policy sees when it is queued: the
    exact output lengths of the groups it admitted and that have not finished, and the decode
    tokens it was told (on_served). Shown the running batch after an iteration's decodes (or
    without its finishes) instead of during it, the order changes."""

    name = "running-lengths-at-queueing"
    reads = "state"

    def __init__(self) -> None:
        self.admitted: dict[int, SequenceGroup] = {}
        self.served = 0
        self.seen: dict[int, int] = {}  # group id -> what on_queued read

    def on_queued(self, group: SequenceGroup) -> None:
        lengths = sum(g.output_len for g in self.admitted.values())  # exact reads (SequenceGroup.output_len)
        self.seen[group.group_id] = lengths + self.served

    def on_admitted(self, group: SequenceGroup, now: float) -> None:
        self.admitted[group.group_id] = group

    def on_served(self, group: SequenceGroup, prefill_tokens: int, decode_tokens: int) -> None:
        self.served += decode_tokens

    def on_finished(self, group: SequenceGroup) -> None:
        self.admitted.pop(group.group_id, None)

    def key(self, group: SequenceGroup) -> tuple:
        return (self.seen.get(group.group_id, 0) % 5, group.request.arrival, group.group_id)


POLICY = "tests.test_decode_step_arrivals:RunningLengthsAtQueueing"


def _config(policy: str) -> SimConfig:
    return SimConfig(policy=policy, num_gpu_blocks=300, max_num_seqs=24)


def _trace():
    # arrivals at about the rate the replica serves them: a short queue, admissions at many
    # iterations (decode steps), arrivals falling inside them
    return resolve_trace("multi-client", num_requests=160, rate=12.0, seed=1)


def _replica(cfg: SimConfig, trace, fast_forward: bool, reads_replica: bool) -> Replica:
    """One replica run to the end; `reads_replica`: its arrivals read its whole state (as behind a
    router that reads more than counts), so decode steps do not pass them."""
    env = simpy.Environment()
    config = cfg.replica()
    feed = ArrivalFeed(requests_from_trace(trace, config.max_model_len, cfg.n, cfg.beam_width))
    replica = sim_replica(env, config, build_cost_model(cfg), cfg.seed, routed=reads_replica,
                          fast_forward=fast_forward, debug=True)
    run_replicas(env, feed, [replica], None)
    return replica


def _groups(replica: Replica) -> list[tuple]:
    return sorted((g.group_id, g.first_scheduled, g.first_token_time, g.finish_time, g.output_len, g.rejected,
                   g.num_preemptions) for g in replica.scheduler.done)


@pytest.mark.parametrize("policy", ["vtc", POLICY])
def test_decode_steps_pass_arrivals_as_stepping_and_step_fewer_iterations(policy: str) -> None:
    cfg, trace = _config(policy), _trace()
    passing = _replica(cfg, trace, fast_forward=True, reads_replica=False)
    before = _replica(cfg, trace, fast_forward=True, reads_replica=True)
    stepped = _replica(cfg, trace, fast_forward=False, reads_replica=False)
    want = stepped.log.frame()
    for run in (passing, before):
        pd.testing.assert_frame_equal(run.log.frame(), want, check_exact=True)
        assert _groups(run) == _groups(stepped)
    # the same iterations, fewer of them stepped: those holding an arrival became decode steps
    assert passing.windows > before.windows
    assert passing.stepped < before.stepped
    assert passing.stepped + passing.skipped == before.stepped + before.skipped == stepped.stepped
    if policy == POLICY:  # what on_queued read (mid-iteration state) is stepping's, group by group
        assert passing.scheduler.policy.seen == stepped.scheduler.policy.seen


@pytest.mark.parametrize("policy", ["vtc", POLICY])
def test_run_tables_equal_stepping(policy: str) -> None:
    cfg, trace = _config(policy), _trace()
    a = run_simulation(cfg, trace)
    b = run_simulation(dataclasses.replace(cfg, fast_forward=False), trace)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)
    assert a.summary["engine"]["stepped_iterations"] < b.summary["engine"]["stepped_iterations"]



def test_a_decode_step_begun_must_be_completed_before_the_scheduler_moves_on() -> None:
    sched, _ex, rs, now = _decoding()
    sched.add_request(Request(10, now, 30, SamplingParams(max_tokens=5, ignore_eos=True), 5))
    window = rs.begin_window(now)  # the admitting iteration: a decode step
    assert window is not None and window.decode is not None
    for call in (lambda: sched.schedule(now), lambda: sched.plan_repeat(now), sched.plan_decode_step):
        with pytest.raises(AssertionError, match="begun and not completed"):
            call()
    other = DecodeStepResult(window.decode.comp, window.decode.result, StepPlan(), None, 0)
    with pytest.raises(AssertionError, match="the decode step this scheduler began"):
        sched.complete_decode_step(other, window.ends[0])
    rs.complete_window(window)
    assert sched.running[-1].group_id == 10 and sched.running[-1].seqs[0].output_len == 1  # its first token
    assert not rs.begin(window.ends[0]).idle  # the scheduler moves on
