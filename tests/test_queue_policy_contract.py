"""The queue-policy contract (policies/queue_policy.py): a policy declares what its decisions read,
and nothing depends on which of its methods it overrides."""

from __future__ import annotations

from collections import deque

import pandas as pd
import pytest

from policies.queue_policy import (
    BUILTIN,
    KeyedQueue,
    QueuePolicy,
    ReorderingQueue,
    ShortestFirstPolicy,
    VtcPolicy,
)
from policies.registry import make_scheduler
from policies.request import SequenceGroup
from sim.run import SimConfig, run_simulation
from traces import resolve_trace


class LoggingFcfs(QueuePolicy):
    """FCFS that records every hook call: a hook only records, so windows run as under FCFS."""

    name = "logging-fcfs"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_queued(self, group: SequenceGroup) -> None:
        self.calls.append(("queued", group.group_id))

    def on_served(self, group: SequenceGroup, prefill_tokens: int, decode_tokens: int) -> None:
        self.calls.append(("served", group.group_id))


class PerInstance(QueuePolicy):
    """A declaration set per instance, and misspelt."""

    def __init__(self) -> None:
        self.reads = "sometimes"


def test_overriding_a_hook_changes_neither_results_nor_windows():
    tr = resolve_trace("sharegpt-like", num_requests=300, rate=8.0, seed=4)
    base = run_simulation(SimConfig(num_gpu_blocks=500), tr)
    logged = run_simulation(SimConfig(num_gpu_blocks=500, policy=f"{__name__}:LoggingFcfs"), tr)
    pd.testing.assert_frame_equal(base.requests, logged.requests, check_exact=True)
    assert base.summary["engine"] == logged.summary["engine"]  # the same windows, the same steps


def test_on_served_is_called_when_a_policy_defines_it():
    assert LoggingFcfs.tracks_service and VtcPolicy.tracks_service
    assert not QueuePolicy.tracks_service and not BUILTIN["priority"].tracks_service
    s = make_scheduler(f"{__name__}:LoggingFcfs", 100, 16)
    assert isinstance(s.waiting, deque) and s.fifo_queue and not s.queues_by_state


def test_the_queue_follows_from_the_declaration():
    assert type(make_scheduler("priority", 100, 16).waiting) is KeyedQueue
    assert type(make_scheduler("vtc", 100, 16).waiting).__name__ == "ClientQueues"  # its own, faster
    declared = type("Live", (QueuePolicy,), {"reads": "state", "key": lambda self, g: (g.group_id,)})
    assert type(declared().new_queue()) is ReorderingQueue
    # a stateless predictor reads the request only; a fitted one what it learned
    assert ShortestFirstPolicy("oracle").reads == "request"
    assert ShortestFirstPolicy("fitted").reads == "state-when-queued"
    assert make_scheduler("sjf", 100, 16, policy_options={"predictor": "fitted"}).queues_by_state


def test_a_key_without_a_declaration_is_refused():
    with pytest.raises(TypeError, match=r"Mine defines key\(\): declare what it reads.*'request'"):
        type("Mine", (QueuePolicy,), {"key": lambda self, g: (g.group_id,)})


@pytest.mark.parametrize("old", ["arrival_order", "dynamic_order", "head_candidates", "queues_by_state",
                                 "overrides_victim"])
def test_window_bookkeeping_names_are_refused_with_their_replacement(old):
    with pytest.raises(TypeError, match=rf"Old\.{old}: no longer part of the QueuePolicy contract"):
        type("Old", (QueuePolicy,), {old: False})


def test_a_bad_declaration_names_the_class():
    with pytest.raises(ValueError, match=r"Odd\.reads = 'often': must be one of 'request'"):
        type("Odd", (QueuePolicy,), {"reads": "often"})

    with pytest.raises(ValueError, match=r"PerInstance\.reads = 'sometimes'"):
        make_scheduler(f"{__name__}:PerInstance", 100, 16)


def test_reordering_queue_gives_the_smallest_key_now():
    keys = {1: 5, 2: 3, 3: 4}
    q = ReorderingQueue(lambda g: (keys[g], g))
    for g in (1, 2, 3):
        q.push(g)
    assert q[0] == 2 and sorted(q.candidates()) == [1, 2, 3]
    keys[1] = 0  # the key changed while it waited
    assert q.popleft() == 1 and q.popleft() == 2 and len(q) == 1
