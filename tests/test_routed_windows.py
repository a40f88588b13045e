"""Routed skip-ahead: behind a router that reads only outstanding counts, replicas skip ahead
across other replicas' arrivals, and the router still sees at every arrival the counts stepping
gives; an arrival at exactly an iteration's end is routed before that iteration's finishes count."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import pytest

from policies.registry import make_scheduler
from policies.request import Request, SamplingParams
from policies.router import (
    ROUTERS,
    LeastLoadedRouter,
    ReplicaCounts,
    Router,
    outstanding,
    reads_counts,
    replica_views,
)
from policies.scheduler import Scheduler
from sim.cost_model import ConstantCostModel
from sim.run import SimConfig, run_simulation
from traces import resolve_trace
from traces.trace import Trace


class RecordingRouter(Router):
    """Least outstanding (first on ties), recording the counts it saw at each arrival."""

    name = "recording"
    reads = "counts"

    def __init__(self) -> None:
        self.seen: list[tuple[float, tuple[int, ...]]] = []

    def route(self, request: Request, replicas: Sequence[Scheduler]) -> int:
        counts = tuple(outstanding(r) for r in replicas)
        self.seen.append((request.arrival, counts))
        return counts.index(min(counts))


class StateRecordingRouter(RecordingRouter):
    """The same, handed the schedulers themselves (as a router that reads more would be)."""

    name = "recording-state"
    reads = "scheduler"


class PeekingRouter(RecordingRouter):
    """Inherits the counts view but reads a replica's queue: refused, never silently different."""

    name = "peeking"

    def route(self, request: Request, replicas: Sequence[Scheduler]) -> int:
        return min(range(len(replicas)), key=lambda i: len(replicas[i].waiting))


def _run(monkeypatch, cls: type[RecordingRouter], trace: Trace, fast_forward: bool, **kw):
    router = cls()
    monkeypatch.setitem(ROUTERS, cls.name, lambda: router)
    cost = kw.pop("cost", None)
    cfg = SimConfig(replicas=kw.pop("replicas", 4), router=cls.name, fast_forward=fast_forward, **kw)
    return run_simulation(cfg, trace, cost_model=cost), router.seen


def test_a_router_is_handed_the_view_it_declares():
    assert reads_counts(LeastLoadedRouter()) and reads_counts(RecordingRouter())
    assert not reads_counts(StateRecordingRouter())
    assert not reads_counts(ROUTERS["cache-aware"]())  # reads the replicas' prefix caches
    sched = [make_scheduler("vllm", 64, 16)]
    sched[0].add_request(Request(0, 0.0, 8, SamplingParams(max_tokens=4)))
    view = replica_views(RecordingRouter(), sched)[0]
    assert type(view) is ReplicaCounts and outstanding(view) == sched[0].outstanding == 1
    assert replica_views(StateRecordingRouter(), sched) == sched
    assert type(replica_views(ROUTERS["cache-aware"](), sched)[0]).__name__ == "ReplicaCache"


def test_a_subclass_reading_more_than_its_view_is_refused(monkeypatch):
    trace = resolve_trace("sharegpt-like", num_requests=20, rate=50, seed=1)
    with pytest.raises(AttributeError, match=r"PeekingRouter reads replica\.waiting.*reads = 'counts'"):
        _run(monkeypatch, PeekingRouter, trace, True)


def test_the_old_flag_is_refused_with_its_replacement():
    with pytest.raises(TypeError, match=r"reads_counts_only: no longer part.*reads = 'counts'"):
        type("Old", (Router,), {"reads_counts_only": True, "route": lambda self, r, reps: 0})
    with pytest.raises(ValueError, match="reads = 'everything'"):
        type("Bad", (Router,), {"reads": "everything", "route": lambda self, r, reps: 0})


# sjf by the oracle reads the request only; by a fitted predictor it reads what it learned, so that
# arrivals must see it as stepping leaves it: its windows of 2 or more iterations end before every
# arrival anyway, but its decode steps pass arrivals behind a counts router (not behind one that
# reads more), so it too steps fewer iterations
@pytest.mark.parametrize("kw", [{}, {"preemption": "swap", "num_gpu_blocks": 300}, {"policy": "sjf"},
                                {"policy": "sjf", "policy_options": {"predictor": "fitted"}}])
def test_counts_seen_in_windows_equal_stepping(monkeypatch, kw):
    trace = resolve_trace("sharegpt-like", num_requests=600, rate=300, seed=3)
    fast, seen_fast = _run(monkeypatch, RecordingRouter, trace, True, **dict(kw))
    step, seen_step = _run(monkeypatch, RecordingRouter, trace, False, **dict(kw))
    assert seen_fast == seen_step
    pd.testing.assert_frame_equal(fast.requests, step.requests)
    pd.testing.assert_frame_equal(fast.iterations, step.iterations)
    # the counts router's windows run across arrivals: fewer iterations stepped than behind a
    # router that (as far as the simulator knows) reads more, with the same result
    state, seen_state = _run(monkeypatch, StateRecordingRouter, trace, True, **dict(kw))
    assert seen_state == seen_step
    pd.testing.assert_frame_equal(state.requests, step.requests)
    stepped = fast.summary["engine"]["stepped_iterations"], state.summary["engine"]["stepped_iterations"]
    assert stepped[0] < stepped[1], stepped


def test_arrival_at_an_iteration_end_is_routed_before_its_finishes(monkeypatch):
    cost = ConstantCostModel(prefill_per_token=0.001, decode_per_seq=0.01, base=0.1)
    arrivals, prompts, outputs = [0.0, 0.0, 0.01, 0.02], [10, 10, 10, 10], [40, 200, 200, 200]
    tr = Trace(arrival=np.array(arrivals), prompt_len=np.array(prompts), output_len=np.array(outputs), name="tie")
    first, _ = _run(monkeypatch, RecordingRouter, tr, True, replicas=2, num_gpu_blocks=100, cost=cost)
    r0 = first.requests.set_index("request_id").loc[0]
    end = float(r0.finish_time)  # request 0's last iteration ends here
    its = first.iterations[first.iterations.replica == r0.replica]
    last_start = float(its.start[np.isclose(its.start + its.duration, end)].iloc[0])
    # one request arrives during that last iteration (so the next arrival's event is created after
    # the engine's, which SimPy alone would order first), and one at exactly its end
    extra = [(last_start + end) / 2, end]
    tie = Trace(arrival=np.array([*arrivals, *extra]), prompt_len=np.array([*prompts, 10, 10]),
                output_len=np.array([*outputs, 300, 5]), name="tie")
    runs = {ff: _run(monkeypatch, RecordingRouter, tie, ff, replicas=2, num_gpu_blocks=100, cost=cost)
            for ff in (True, False)}
    for res, seen in runs.values():
        req = res.requests.set_index("request_id")
        assert float(req.loc[0].finish_time) == end
        at, counts = seen[-1]
        assert at == end
        # request 0 still counts on its replica: the arrival is routed before the engine resumes
        # at the end of request 0's last iteration
        here = req[(req.replica == r0.replica) & (req.index < len(arrivals) + 1)]
        assert counts[int(r0.replica)] == len(here) and len(here) >= 2
    assert runs[True][1] == runs[False][1]
    pd.testing.assert_frame_equal(runs[True][0].iterations, runs[False][0].iterations)
