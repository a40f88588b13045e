"""The paged scheduler's running batch (policies/running_batch.py): members moved on by a decode
clock are exact once materialised, the kept figures follow joins and leaves, and finishes come
off the heap at their clock, stale entries skipped."""

from __future__ import annotations

import pytest

from policies.block_manager import PagedBlockManager
from policies.request import Request, SamplingParams, SequenceGroup
from policies.running_batch import RunningBatch
from policies.scheduler import Scheduler


def plain_decoder(bm: PagedBlockManager, rid: int, prompt: int, keep_token_ids: bool = False) -> SequenceGroup:
    """A group whose single sequence has computed its prompt and sampled one token (a plain
    decoder: one token left to compute), with its blocks allocated; with `keep_token_ids`, its
    token ids are kept (the prompt's 0, 1, ..., then a sampled 7)."""
    ids = list(range(prompt)) if keep_token_ids else None
    g = SequenceGroup(Request(rid, 0.0, prompt, SamplingParams(max_tokens=100, ignore_eos=True), 100,
                              prompt_token_ids=ids), rid)
    s = g.seqs[0]
    bm.allocate(s)
    bm.append_slots(s, prompt)
    s.num_computed, s.output_len = prompt, 1
    if s.token_ids is not None:
        s.token_ids.append(7)
    return g


def decode_steps(batch: RunningBatch, bm: PagedBlockManager, k: int) -> None:
    """k decode steps of every member, as a window applies them: blocks opened in step order."""
    for _ in range(k):
        bm.open_decode_blocks([s.seq_id for s in batch.opening_bucket()])
        bm.add_token_states(batch.size)
        batch.clock += 1


def test_members_are_exact_once_materialised_and_figures_follow_joins_and_leaves():
    bm = PagedBlockManager(200, block_size=4)
    batch = RunningBatch(bm, Scheduler.seq_demand)
    groups = [plain_decoder(bm, i, p) for i, p in enumerate([3, 4, 5, 9])]
    for g in groups[:3]:
        batch.join(g.seqs[0])
    batch.set_finishes(list(batch.unknown), [50] * 3)  # as a plan is told before it is applied
    decode_steps(batch, bm, 5)
    late = groups[3].seqs[0]
    batch.join(late)  # joins at clock 5: owes nothing yet
    batch.set_finishes([late], [50])
    decode_steps(batch, bm, 6)
    owed = batch.check([g.seqs[0] for g in groups])
    assert owed == {0: 11, 1: 11, 2: 11, 3: 6}
    bm.check_invariants(owed)
    # the context sum and the block-phase counts, without walking the members
    assert batch.context() == (3 + 11) + (4 + 11) + (5 + 11) + (9 + 6)
    assert sum(batch.counts) == 4 and batch.demand == 4
    first = groups[0].seqs[0]
    batch.leave(first)
    assert (first.num_computed, first.output_len, first.anchor) == (14, 12, -1)
    assert bm.slots[first.seq_id] == 14 and len(bm.tables[first.seq_id]) == 4  # ceil(14 / 4)
    assert batch.context() == 15 + 16 + 15 and batch.size == 3
    batch.release_all()
    assert [s.num_computed for s in (groups[1].seqs[0], groups[2].seqs[0], late)] == [15, 16, 15]
    bm.check_invariants()


@pytest.mark.parametrize("k", [0, 1, 3, 4, 5, 8, 11])
def test_a_window_opens_the_blocks_of_each_step_in_order(k):
    """open_within(k): each member opening a block in a step gets the next block taken, step by
    step, in bucket order (the order stepping takes their blocks), also over more than one cycle
    of the block size."""
    def setup() -> tuple[PagedBlockManager, RunningBatch]:
        bm = PagedBlockManager(200, block_size=4)
        batch = RunningBatch(bm, Scheduler.seq_demand)
        for i, p in enumerate([3, 4, 5, 7, 11, 2]):
            batch.join(plain_decoder(bm, i, p).seqs[0])
        batch.clock = 2
        return bm, batch

    bm, batch = setup()
    want = bm.tables
    openers = [s for j in range(k) for s in batch.opening_bucket(j)]
    for s, block in zip(openers, bm.pool.take_ids(len(openers)), strict=True):  # one by one, in order
        want[s.seq_id].append(block)
    bm, batch = setup()
    batch.open_within(k)
    assert bm.tables == want and len(openers) == k // 4 * 6 + sum(len(batch.opening_bucket(j)) for j in range(k % 4))
    assert batch.opening_tables(1) == [bm.tables[s.seq_id] for s in batch.opening_bucket(1)]


def test_the_opening_bucket_in_running_order_by_arrival_or_by_a_pass():
    """opening_in_order: the members opening a block next, in the order of the running groups;
    sorted by (arrival, group id) when the running list is in that order, or picked by one pass."""
    bm = PagedBlockManager(200, block_size=4)
    batch = RunningBatch(bm, Scheduler.seq_demand)
    groups = [plain_decoder(bm, i, p) for i, p in enumerate([4, 8, 5, 12, 16, 9])]  # 4, 8, 12, 16: bucket 0
    for g, arrival in zip(groups, [2.0, 1.0, 0.1, 1.0, 0.5, 3.0], strict=True):
        g.request.arrival = arrival
        batch.join(g.seqs[0])
    running = sorted(groups, key=lambda g: (g.request.arrival, g.group_id))
    want = [g.seqs[0] for g in running if g.seqs[0].num_computed % 4 == 0]
    assert [s.seq_id for s in want] == [4, 1, 3, 0]
    assert batch.opening_in_order(running, by_arrival=True) == want
    assert batch.opening_in_order(running) == want
    assert batch.opening_in_order(running[::-1]) == want[::-1]  # the pass follows any order


def test_finishes_come_off_the_heap_at_their_clock_and_stale_entries_are_skipped():
    bm = PagedBlockManager(100, block_size=4)
    batch = RunningBatch(bm, Scheduler.seq_demand)
    a, b, c = (plain_decoder(bm, i, 4).seqs[0] for i in range(3))
    for s in (a, b, c):
        batch.join(s)
    assert batch.first_finish() == float("inf")
    batch.set_finishes([a, b, c], [3, 2, 2])
    assert batch.unknown == [] and batch.first_finish() == 2
    batch.leave(c)  # preempted: its heap entry goes stale
    decode_steps(batch, bm, 2)
    assert batch.finishing() == [b]
    batch.leave(b)
    assert batch.first_finish() == 1 and batch.finishing(ahead=1) == [a]


def test_finish_entries_order_as_their_clock_then_seq_id():
    """The finish heap's entries (a native class compiled) keep the order of (clock, seq id,
    sequence) tuples: the same list after every heapq push and pop, so the same entries come off
    in the same order."""
    import heapq
    import random

    from policies.running_batch import _Finish

    rng = random.Random(5)
    bm = PagedBlockManager(100, block_size=4)
    seqs = [plain_decoder(bm, i, 4).seqs[0] for i in range(40)]
    ours: list = []
    tuples: list = []
    for _ in range(400):
        if tuples and rng.random() < 0.45:
            e, t = heapq.heappop(ours), heapq.heappop(tuples)
            assert (e.at, e.seq_id, e.seq) == t
        else:
            s = rng.choice(seqs)
            at = rng.randrange(12)
            heapq.heappush(ours, _Finish(at, s.seq_id, s))
            heapq.heappush(tuples, (at, s.seq_id, s))
        assert [(e.at, e.seq_id, e.seq) for e in ours] == tuples


def test_the_check_catches_a_member_read_without_settling():
    bm = PagedBlockManager(50, block_size=4)
    batch = RunningBatch(bm, Scheduler.seq_demand)
    s = plain_decoder(bm, 0, 5).seqs[0]
    batch.join(s)
    batch.set_finishes([s], [50])
    decode_steps(batch, bm, 3)
    s.num_computed += 1  # a writer outside the batch: the context base drifts
    with pytest.raises(AssertionError, match="context base drifted"):
        batch.check([s])
