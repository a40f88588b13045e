"""policies/per_client.py: a batch counted by client, and the per-client waiting queue, against their
plain definitions (collections.Counter; the smallest (counter, arrival, group id) key), interpreted
and, under PAGESIM_COMPILED=1, compiled."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from policies.per_client import ClientQueues, count_by_client
from policies.queue_policy import VtcPolicy
from policies.request import Request, SequenceGroup


def _group(gid: int, client: str, arrival: float) -> SequenceGroup:
    return SequenceGroup(Request(gid, arrival, 8, output_len=4, client=client), gid)


@pytest.mark.parametrize("seed", range(3))
def test_count_by_client_is_the_counter_of_the_clients(seed):
    rng = random.Random(seed)
    for trial in range(300):
        # equal strings that are distinct objects ("".join) split a run of one client: still one count
        names = ["", "a", "b", "".join(["a"]), "".join(["b", ""])]
        clients = [rng.choice(names) for _ in range(rng.randint(0, 40))]
        groups = [_group(i, c, float(i)) for i, c in enumerate(clients)]
        counts = count_by_client(groups)
        assert counts == dict(Counter(clients)), (seed, trial)
        assert list(counts) == list(dict.fromkeys(clients))  # first-seen order


def _smallest(queued: list[SequenceGroup], counters: dict[str, float]) -> SequenceGroup:
    return min(queued, key=lambda g: (counters[g.request.client], g.request.arrival, g.group_id))


@pytest.mark.parametrize("seed", range(3))
def test_client_queues_give_the_smallest_key_now(seed):
    """Random pushes (front: a preempted group back at its client's head), counter changes and
    pops: the head is always the smallest (counter, arrival, group id) among the clients' heads."""
    rng = random.Random(seed)
    counters = {c: 0.0 for c in "abcd"}
    reads: list[str] = []

    def counter(client: str) -> float:
        reads.append(client)
        return counters[client]

    q = ClientQueues(counter)
    per_client: dict[str, list[SequenceGroup]] = {c: [] for c in counters}  # each client's FIFO
    for gid in range(400):
        op = rng.random()
        if op < 0.45 or not len(q):
            client = rng.choice("abcd" if rng.random() < 0.7 else "a")
            g = _group(gid, client, float(rng.randint(0, 50)))
            front = rng.random() < 0.2
            q.push(g, front)
            per_client[client].insert(0, g) if front else per_client[client].append(g)
        elif op < 0.6:
            counters[rng.choice("abcd")] += rng.choice([0.0, 1.0, 2.5])  # ties on counters too
        else:
            heads = [fifo[0] for fifo in per_client.values() if fifo]
            want = heads[0] if len(heads) == 1 else _smallest(heads, counters)
            assert q[0] is want
            reads.clear()
            assert q.popleft() is want
            if len(heads) == 1:
                assert reads == []  # one client waiting: its head, no counter read
            per_client[want.request.client].remove(want)
        assert len(q) == sum(map(len, per_client.values()))
        assert sorted(g.group_id for g in q) == sorted(g.group_id for f in per_client.values() for g in f)
        assert {g.group_id for g in q.candidates()} == {f[0].group_id for f in per_client.values() if f}


def test_an_empty_client_queue_says_so():
    q = ClientQueues(lambda client: 0.0)
    with pytest.raises(IndexError, match="empty"):
        q.popleft()
    q.push(_group(1, "a", 0.0))
    with pytest.raises(IndexError, match=r"only its head, \[0\]"):
        q[1]


class CountingQueues(ClientQueues):
    """An interpreted subclass of the (possibly compiled) queue: its override is the one called."""

    def __init__(self, counter) -> None:
        super().__init__(counter)
        self.pushed = 0

    def push(self, group: SequenceGroup, front: bool = False) -> None:
        self.pushed += 1
        super().push(group, front)


class CountingVtc(VtcPolicy):
    def new_queue(self) -> CountingQueues:
        return CountingQueues(self.counter)


def test_client_queues_subclass_from_interpreted_code():
    from policies.registry import make_scheduler

    sched = make_scheduler(f"{__name__}:CountingVtc", 100, 16)
    assert type(sched.waiting) is CountingQueues
    for i in range(3):
        sched.waiting.push(_group(i, "ab"[i % 2], float(i)))
    assert sched.waiting.pushed == 3 and len(sched.waiting) == 3 and sched.waiting[0].group_id == 0


def test_vtc_binds_its_compiled_counts_unless_a_subclass_gives_its_own() -> None:
    """VtcPolicy's hooks run its counts' methods directly; a subclass's own counter still orders
    the queue (here reversed: the client served most comes first)."""

    class MostServedFirst(VtcPolicy):
        def counter(self, client: str) -> float:
            return -super().counter(client)

    for cls, first in ((VtcPolicy, "b"), (MostServedFirst, "a")):
        policy = cls()
        queue = policy.new_queue()
        a, b = _group(0, "a", 0.0), _group(1, "b", 1.0)
        policy.on_admitted(a, 0.0)  # client a charged its prompt
        for g in (a, b):
            queue.push(g)
        assert queue[0].request.client == first
        assert policy.tokens["a"][0] == a.request.prompt_len and policy.counter("a") == (
            -1 if cls is MostServedFirst else 1) * a.request.prompt_len
