"""Unit tests of policies/ (issue 2), with small worked examples whose numbers are checked by hand.

Block ids are predictable: the free queue starts as 0, 1, 2, ...; a freed block that holds no
cached content goes back to the front (reused first), a freed cached block to the back (LRU).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest

from policies import request as request_module
from policies._compiled import running_compiled
from policies.block_manager import AllocStatus, BlockPool, PagedBlockManager
from policies.buddy import BuddyAllocator, next_pow2
from policies.contiguous import ContiguousAllocator
from policies.contiguous_schedulers import OrcaScheduler, StaticScheduler
from policies.memory import MemoryBreakdown
from policies.plan import ScheduledSeq, SeqOutcome, StepPlan, StepResult
from policies.registry import POLICIES, make_scheduler
from policies.replica_config import ReplicaConfig, build_scheduler
from policies.request import Request, SamplingParams, SeqStatus, Sequence, SequenceGroup
from policies.vllm_scheduler import VllmScheduler
from tests.policy_helpers import req, run_to_completion

_ids = itertools.count(1000)


def group(prompt: int, out: int = 8, *, ids: list[int] | None = None, n: int = 1, beam: int = 1,
          max_tokens: int | None = None, rid: int | None = None, **kw) -> SequenceGroup:
    sp = SamplingParams(max_tokens=max_tokens or out, n=n, beam_width=beam)
    rid = next(_ids) if rid is None else rid
    return SequenceGroup(Request(rid, 0.0, prompt, sp, output_len=out, prompt_token_ids=ids, **kw), next(_ids))


def prefill(bm: PagedBlockManager, seq: Sequence) -> int:
    """Allocate and compute a waiting sequence's prompt, as the scheduler does. Returns cached tokens."""
    cached = bm.allocate(seq)
    seq.num_computed = cached
    assert bm.append_slots(seq, seq.num_tokens - cached) == []
    seq.num_computed = seq.num_tokens
    return cached


def decode(bm: PagedBlockManager, seq: Sequence, tok: int | None = None) -> list[tuple[int, int]]:
    """Sample one token and compute it (one decode step). Returns the copy-on-write copies."""
    seq.append(tok)
    copies = bm.append_slots(seq, 1)
    assert copies is not None
    seq.num_computed += 1
    return copies


def fork(bm: PagedBlockManager, parent: Sequence) -> Sequence:
    g = parent.group
    child = Sequence(next(_ids), g, parent.prompt_len, parent.target_len,
                     None if parent.token_ids is None else list(parent.token_ids), parent.output_len)
    child.num_computed = parent.num_computed
    bm.fork(parent, child)
    g.seqs.append(child)
    return child


def mem(bm) -> tuple[int, int, int, int, int]:
    m = bm.memory()
    return (m.token_states, m.reserved, m.internal_frag, m.external_frag, m.free)


def steps_of(run, gid: int) -> list[tuple[int, int, int, bool]]:
    """(step, start, num_new_tokens, samples) of every scheduled chunk of group `gid`."""
    return [(i, s.start, s.num_new_tokens, s.samples) for i, p in enumerate(run.plans) for s in p.seqs
            if s.group_id == gid]


# ============================================================================ requests
def test_sampling_params_width_and_validation():
    assert SamplingParams(n=3).width == 3 and SamplingParams(beam_width=4).width == 4
    for kw, word in [({"n": 0}, "n must be >= 1"), ({"beam_width": 0}, "beam_width must be >= 1"),
                     ({"max_tokens": 0}, "max_tokens"), ({"n": 2, "beam_width": 2}, "not both"),
                     ({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature")]:
        with pytest.raises(ValueError, match=word):
            SamplingParams(**kw)


def test_request_validation_and_max_output():
    with pytest.raises(ValueError, match="prompt_len must be >= 1"):
        Request(0, 0.0, 0)
    with pytest.raises(ValueError, match="output_len must be >= 1"):
        Request(0, 0.0, 4, output_len=0)
    with pytest.raises(ValueError, match="prompt_token_ids has 3 ids but prompt_len is 4"):
        Request(0, 0.0, 4, prompt_token_ids=[1, 2, 3])
    assert Request(0, 0.0, 4, SamplingParams(max_tokens=50), output_len=20).max_output == 20
    assert Request(0, 0.0, 4, SamplingParams(max_tokens=50), output_len=80).max_output == 50
    assert Request(0, 0.0, 4, SamplingParams(max_tokens=50)).max_output == 50
    # max_tokens bounds the output with ignore_eos too (it was output_len=80 before the fix)
    assert Request(0, 0.0, 4, SamplingParams(max_tokens=50, ignore_eos=True), output_len=80).max_output == 50


def test_request_init_takes_its_fields_in_order_with_their_defaults():
    """Request's __init__ is written out (so that it compiles): it must stay the one dataclasses
    would generate, field for field, and keep a keyword-built request equal to a positional one."""
    fields = dataclasses.fields(Request)
    if not running_compiled(request_module):  # a compiled __init__ shows no signature (the source's is checked)
        params = list(inspect.signature(Request.__init__).parameters.values())[1:]
        assert [p.name for p in params] == [f.name for f in fields]
        for p, f in zip(params, fields):
            if f.default is not dataclasses.MISSING:
                assert p.default == f.default, f.name
            elif f.default_factory is not dataclasses.MISSING:
                assert p.default is None and getattr(Request(0, 0.0, 1), f.name) == f.default_factory(), f.name
            else:
                assert p.default is inspect.Parameter.empty, f.name
    assert Request(0, 0.0, 1).sampling == SamplingParams() and Request(0, 0.0, 1).client == ""
    values = dict(request_id=3, arrival=1.5, prompt_len=7, sampling=SamplingParams(max_tokens=9), output_len=4,
                  prompt_token_ids=list(range(7)), prefix_hashes=(1, 2), hash_block_size=4, priority=2,
                  reject_reason=None, client="c", slo_ttft=0.5, slo_tpot=0.1)
    r = Request(**values)
    assert r == Request(*values.values()) and dataclasses.asdict(r)["prefix_hashes"] == (1, 2)
    assert dataclasses.replace(r, priority=5).priority == 5


def test_sequence_group_starts_waiting_with_one_sequence():
    g = group(5, 3, ids=[1, 2, 3, 4, 5], n=2)
    (s,) = g.seqs
    assert (s.num_tokens, s.num_computed, s.status, g.status) == (5, 0, SeqStatus.WAITING, SeqStatus.WAITING)
    s.append(9)
    assert s.num_tokens == 6 and s.token_ids[-1] == 9 and g.output_len == 1
    assert g.request.prompt_token_ids == [1, 2, 3, 4, 5]  # the request's ids are not aliased


# ============================================================================ paged block manager
def test_request_grows_across_block_boundaries():
    bm = PagedBlockManager(8, block_size=4)
    s = group(6).seqs[0]
    assert prefill(bm, s) == 0
    assert bm.block_table(s.seq_id) == [0, 1]                 # 4 + 2 slots
    assert mem(bm) == (6, 0, 2, 0, 24)                        # the unused tail of block 1 is internal frag
    decode(bm, s)
    decode(bm, s)                                             # 8 tokens: block 1 is full, no new block
    assert bm.block_table(s.seq_id) == [0, 1] and mem(bm) == (8, 0, 0, 0, 24)
    decode(bm, s)                                             # the 9th token opens block 2
    assert bm.block_table(s.seq_id) == [0, 1, 2] and mem(bm) == (9, 0, 3, 0, 20)
    assert bm.num_free_blocks == 5
    bm.check_invariants()
    bm.free(s)
    bm.assert_empty()


def test_fork_then_divergent_appends_copy_on_write():
    bm = PagedBlockManager(8, block_size=4)
    p = group(6).seqs[0]
    prefill(bm, p)
    c = fork(bm, p)
    assert bm.block_table(c.seq_id) == [0, 1]
    assert [bm.pool.blocks[b].ref_count for b in (0, 1)] == [2, 2]
    assert bm.num_free_blocks == 6                            # a fork takes no block
    # the parent writes first into the shared partial block 1: it is copied to block 2
    assert decode(bm, p, 7) == [(1, 2)]
    assert bm.block_table(p.seq_id) == [0, 2] and bm.pool.blocks[1].ref_count == 1
    # the child now owns block 1 alone and writes in place
    assert decode(bm, c, 8) == []
    assert bm.block_table(c.seq_id) == [0, 1]
    for _ in range(2):
        decode(bm, p)
        decode(bm, c)
    assert bm.block_table(p.seq_id) == [0, 2, 3] and bm.block_table(c.seq_id) == [0, 1, 4]
    assert bm.pool.blocks[0].ref_count == 2                   # the full prompt block stays shared
    assert mem(bm) == (14, 0, 6, 0, 12)                       # 4 + (4 + 1) + (4 + 1) states in 5 blocks
    bm.check_invariants()
    bm.free(p)
    bm.free(c)
    bm.assert_empty()


def test_fork_at_a_full_block_needs_no_copy():
    bm = PagedBlockManager(8, block_size=4)
    p = group(8).seqs[0]
    prefill(bm, p)
    c = fork(bm, p)
    assert decode(bm, p) == [] and decode(bm, c) == []
    assert bm.block_table(p.seq_id) == [0, 1, 2] and bm.block_table(c.seq_id) == [0, 1, 3]
    assert bm.can_append(p, 1) == 0


def test_can_append_counts_the_copy_of_a_shared_partial_block():
    bm = PagedBlockManager(8, block_size=4)
    p = group(6).seqs[0]
    prefill(bm, p)
    c = fork(bm, p)
    p.append(1)
    c.append(2)
    assert bm.can_append(p, 1) == 1 and bm.can_append(c, 1) == 1   # each alone would copy block 1
    assert bm.append_slots(p, 1) == [(1, 2)]
    p.num_computed += 1
    assert bm.can_append(c, 1) == 0                                # ...but only the first one does


def test_append_slots_out_of_blocks_changes_nothing():
    bm = PagedBlockManager(2, block_size=4)
    s = group(8).seqs[0]
    prefill(bm, s)
    s.append(None)
    assert bm.append_slots(s, 1) is None
    assert bm.block_table(s.seq_id) == [0, 1] and bm.slots[s.seq_id] == 8
    bm.check_invariants()


def test_swap_out_and_back_in_keeps_shared_blocks_shared():
    bm = PagedBlockManager(8, block_size=4, num_cpu_blocks=8)
    g = group(6)
    p = g.seqs[0]
    prefill(bm, p)
    c = fork(bm, p)
    decode(bm, p, 7)
    decode(bm, c, 8)                                          # p: [0, 2], c: [0, 1], block 0 shared
    old = {s.seq_id: list(bm.block_table(s.seq_id)) for s in g.seqs}
    assert bm.can_swap_out(g)
    out = bm.swap_out(g)
    assert out == [(0, 0), (2, 1), (1, 2)]                    # 3 distinct blocks -> 3 cpu blocks
    assert bm.cpu_tables == {p.seq_id: [0, 1], c.seq_id: [0, 2]}
    assert bm.cpu.ref[:3] == [2, 1, 1] and bm.num_free_blocks == 8
    bm.check_invariants()
    assert bm.can_swap_in(g)
    back = bm.swap_in(g)
    assert back == [(0, 0), (1, 1), (2, 2)]
    g2c, c2g = dict(out), dict(back)
    for s in g.seqs:                                          # every block's content came home
        assert bm.block_table(s.seq_id) == [c2g[g2c[b]] for b in old[s.seq_id]]
    assert bm.block_table(p.seq_id)[0] == bm.block_table(c.seq_id)[0]
    assert bm.pool.blocks[bm.block_table(p.seq_id)[0]].ref_count == 2
    assert bm.cpu.num_free == 8 and not bm.cpu_tables
    assert mem(bm)[0] == 4 + 3 + 3                            # token states survive the round trip
    bm.check_invariants()


def test_can_swap_in_counts_blocks_for_the_rest_of_a_chunked_prompt():
    # a group preempted by swap in the middle of a chunked prefill needs blocks for the rest of its
    # prompt when it comes back, not just one block (the old rule, which let append_slots fail)
    bm = PagedBlockManager(6, block_size=4, num_cpu_blocks=8)
    g = group(20)
    s = g.seqs[0]
    bm.allocate(s)
    bm.append_slots(s, 8)
    s.num_computed = 8                                       # 2 blocks, 12 prompt tokens to go
    bm.swap_out(g)
    other = group(12).seqs[0]
    prefill(bm, other)                                        # 3 of 6 blocks left
    assert not bm.can_swap_in(g)                              # 2 back + 3 more > 3 free
    bm.free(other)
    assert bm.can_swap_in(g)
    bm.swap_in(g)
    assert bm.append_slots(s, 12) == []


def test_free_releases_only_unshared_blocks():
    bm = PagedBlockManager(8, block_size=4)
    p = group(6).seqs[0]
    prefill(bm, p)
    c = fork(bm, p)
    bm.free(p)
    assert bm.num_free_blocks == 6 and bm.block_table(c.seq_id) == [0, 1]
    bm.free(p)                                                # freeing twice is a no-op
    bm.free(c)
    bm.assert_empty()


def test_double_release_is_detected():
    bm = PagedBlockManager(4, block_size=4)
    s = group(4).seqs[0]
    prefill(bm, s)
    bm.pool.release(bm.pool.blocks[0])
    with pytest.raises(AssertionError, match="freed twice"):
        bm.pool.release(bm.pool.blocks[0])


def test_can_allocate_ok_later_never():
    bm = PagedBlockManager(10, block_size=4, watermark=0.0)
    assert bm.can_allocate(group(20, 20)) is AllocStatus.OK          # 40 tokens = the whole cache
    assert bm.can_allocate(group(20, 21)) is AllocStatus.NEVER       # 41 tokens = 11 blocks > 10
    prefill(bm, group(24, 1).seqs[0])                                # 6 blocks in use, 4 free
    assert bm.can_allocate(group(20, 1)) is AllocStatus.LATER        # 5 blocks > 4 free
    assert bm.can_allocate(group(16, 1)) is AllocStatus.OK           # 4 blocks
    assert bm.can_allocate(group(20, 1), num_new_tokens=8) is AllocStatus.OK  # first chunk: 2 blocks
    # beam search: the shared prompt block plus, per beam, its output blocks and a copied block
    assert bm.max_blocks_needed(group(4, 4, beam=4)) == 1 + 4 * 2
    assert bm.can_allocate(group(4, 4, beam=5)) is AllocStatus.NEVER  # 1 + 5 * 2 = 11 > 10


def test_watermark():
    bm = PagedBlockManager(100, block_size=1, watermark=0.05)
    assert bm.watermark_blocks == 5
    assert bm.can_allocate(group(94, 1)) is AllocStatus.OK           # leaves 6 free
    assert bm.can_allocate(group(95, 1)) is AllocStatus.NEVER        # 96 > 100 - 5
    prefill(bm, group(10, 1).seqs[0])
    assert bm.can_allocate(group(85, 1)) is AllocStatus.OK           # 90 - 85 = 5 stay free
    assert bm.can_allocate(group(86, 1)) is AllocStatus.LATER        # would leave 4 < 5


# ---------------------------------------------------------------------------- prefix caching
def test_prefix_hit_on_a_half_shared_prompt_token_ids():
    bm = PagedBlockManager(16, block_size=4, enable_prefix_caching=True)
    a_ids = list(range(100, 116))
    a = group(16, ids=a_ids).seqs[0]
    assert prefill(bm, a) == 0
    assert bm.block_table(a.seq_id) == [0, 1, 2, 3]
    assert len(bm.pool.cached) == 4                                   # all 4 full blocks named
    b = group(16, ids=a_ids[:8] + list(range(200, 208))).seqs[0]
    assert bm.can_allocate(b.group) is AllocStatus.OK
    assert prefill(bm, b) == 8                                        # half the prompt is cached
    assert bm.block_table(b.seq_id) == [0, 1, 4, 5]
    assert [bm.pool.blocks[i].ref_count for i in range(6)] == [2, 2, 1, 1, 1, 1]
    assert (bm.prefix_hits, bm.prefix_queries) == (2, 3 + 3)
    bm.check_invariants()


def test_last_prompt_token_is_always_computed():
    bm = PagedBlockManager(16, block_size=4, enable_prefix_caching=True)
    ids = list(range(16))
    prefill(bm, group(16, ids=ids).seqs[0])
    same = group(16, ids=list(ids)).seqs[0]
    assert bm.allocate(same) == 12                 # 3 of 4 blocks: the last block is recomputed
    longer = group(17, ids=ids + [99]).seqs[0]
    assert bm.allocate(longer) == 16               # all 4 blocks; the 17th token is computed
    one_block = group(4, ids=ids[:4]).seqs[0]
    assert bm.allocate(one_block) == 0             # a one-block prompt computes its last token


def test_prefix_hit_with_prefix_hashes_512_over_blocks_of_16():
    bm = PagedBlockManager(300, block_size=16, enable_prefix_caching=True)

    def g(prompt, hashes):
        return group(prompt, prefix_hashes=hashes, hash_block_size=512).seqs[0]

    a = g(1024, (11, 12))
    assert prefill(bm, a) == 0 and len(bm.pool.cached) == 64
    assert prefill(bm, g(1024, (11, 13))) == 512   # first hash block shared: 32 blocks of 16
    assert prefill(bm, g(700, (11, 14))) == 512    # a partial last hash block
    assert prefill(bm, g(1024, (11, 12))) == 1008  # identical: 63 blocks, the last one recomputed
    assert prefill(bm, g(1024, (21, 12))) == 0     # hashes chain: a different first block shares nothing
    bm.check_invariants()


def test_prefix_hashes_when_blocks_straddle_hash_blocks():
    # block size 24 does not divide 512: block 21 covers tokens 504..527 across two hash blocks.
    # The chained hash of the later hash block names it, so sharing 1024 tokens hits 42 blocks.
    bm = PagedBlockManager(300, block_size=24, enable_prefix_caching=True)
    a = group(1500, prefix_hashes=(11, 12, 13), hash_block_size=512).seqs[0]
    prefill(bm, a)
    b = group(1500, prefix_hashes=(11, 12, 14), hash_block_size=512).seqs[0]
    assert prefill(bm, b) == 42 * 24                # 1008 tokens; block 42 (1008..1031) differs
    c = group(1500, prefix_hashes=(11, 15, 13), hash_block_size=512).seqs[0]
    assert prefill(bm, c) == 21 * 24                # block 21 ends in the second hash block


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = PagedBlockManager(4, block_size=2, enable_prefix_caching=True)
    a = group(4, 1, ids=[1, 2, 3, 4]).seqs[0]
    d = group(4, 1, ids=[5, 6, 7, 8]).seqs[0]
    prefill(bm, a)                                  # blocks 0, 1
    prefill(bm, d)                                  # blocks 2, 3
    bm.free(a)
    bm.free(d)
    assert list(bm.pool.free) == [1, 0, 3, 2]       # cached blocks queue in the order they were freed
    assert len(bm.pool.cached) == 4 and bm.num_free_blocks == 4
    # a hit revives a freed cached block (it leaves the free queue) and refreshes its recency
    a2 = group(5, 1, ids=[1, 2, 3, 4, 9]).seqs[0]
    assert bm.can_allocate(a2.group) is AllocStatus.OK
    assert bm.allocate(a2) == 4 and bm.num_free_blocks == 2
    bm.free(a2)
    assert list(bm.pool.free) == [3, 2, 1, 0]       # now d's blocks are the least recently used
    e = group(4, 1, ids=[9, 9, 9, 9]).seqs[0]
    prefill(bm, e)                                   # evicts d's two blocks
    assert bm.block_table(e.seq_id) == [3, 2] and bm.pool.evictions == 2
    assert bm.allocate(group(5, 1, ids=[5, 6, 7, 8, 1]).seqs[0]) == 0     # d's prefix is gone
    assert bm.allocate(group(5, 1, ids=[1, 2, 3, 4, 1]).seqs[0]) == 4     # a's prefix survived


@pytest.mark.parametrize("num_blocks", [12, 400])
def test_block_pool_free_queue_matches_one_ordered_queue(num_blocks: int):
    """The pool's two-part free queue (never-cached stack, idle cached LRU) takes, evicts and
    revives blocks exactly as one queue would: never-cached blocks at the front (a freed one
    first), cached ones behind in the order they were freed; blocks never taken yet (made on
    first take) lie in id order right after the freed never-cached ones."""
    import random
    from collections import OrderedDict

    rng = random.Random(7)
    pool = BlockPool(num_blocks)
    queue = OrderedDict.fromkeys(range(num_blocks))  # the reference: one ordered free queue
    hashes: dict[int, int] = {}  # the reference's block -> hash
    used: list[int] = []
    used_ever: set[int] = set()
    for step in range(3000):
        op = rng.random()
        if op < 0.4 and queue:
            n = rng.randint(1, len(queue))
            want = []
            for _ in range(n):
                b, _ = queue.popitem(last=False)
                hashes.pop(b, None)
                want.append(b)
            assert pool.take_ids(n) == want
            used.extend(want)
            used_ever.update(want)
        elif op < 0.5 and used:  # name a block's content, as prefix caching does to full blocks
            b = rng.choice(used)
            h = rng.randint(0, 30)
            if b not in hashes and h not in hashes.values():
                hashes[b] = h
            pool.register(pool.blocks[b], h)
        elif op < 0.6 and hashes:  # a prefix hit revives an idle cached block (or shares a used one)
            b = rng.choice(list(hashes))
            if b in queue:
                del queue[b]
            used.append(b)
            pool.touch(pool.blocks[b])
        elif used:
            rng.shuffle(used)
            k = rng.randint(1, len(used))
            gone, used = used[:k], used[k:]
            backwards = rng.random() < 0.5  # as a freed table is released: last block first
            order = gone[::-1] if backwards else gone
            for i, b in enumerate(order):
                if b not in used and b not in order[i + 1:]:  # its last reference
                    queue[b] = None
                    if b not in hashes:
                        queue.move_to_end(b, last=False)
            pool.release_ids(gone, backwards=backwards)
        assert list(pool.free) == list(queue), step
        assert pool.num_free == len(queue)
        assert len(pool.blocks) == max(used_ever, default=-1) + 1  # made on first take, not before
    assert pool.evictions > 0


def test_remove_group_removes_that_group_only_by_identity():
    """Scheduler.remove_group is list.remove for groups (equal only to themselves): the tail, one in
    the middle, the head; a group not in the list raises ValueError as list.remove does."""
    from policies.scheduler import remove_group

    groups = [group(i + 1, 4) for i in range(5)]
    running = list(groups)
    remove_group(running, groups[4])
    assert running == groups[:4]
    remove_group(running, groups[1])
    assert running == [groups[0], groups[2], groups[3]]
    remove_group(running, groups[0])
    assert running == [groups[2], groups[3]]
    with pytest.raises(ValueError, match=f"group {groups[0].group_id} is not in the list"):
        remove_group(running, groups[0])
    assert running == [groups[2], groups[3]]


def test_a_huge_pool_makes_only_the_blocks_taken():
    """A small model on a large GPU: millions of blocks, of which a run takes a few; the pool makes
    a block when it is first taken (in id order, after the freed ones), and its checks walk only
    those."""
    bm = PagedBlockManager(5_000_000, block_size=4)
    seqs = [group(10 + i, 1).seqs[0] for i in range(3)]  # 3 blocks each
    for s in seqs:
        prefill(bm, s)
    assert [bm.block_table(s.seq_id) for s in seqs] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert len(bm.pool.blocks) == 9 and bm.num_free_blocks == 5_000_000 - 9
    bm.check_invariants()
    bm.free(seqs[1])
    late = group(17, 1).seqs[0]  # 5 blocks: the 3 freed ones, then 2 never taken
    prefill(bm, late)
    assert sorted(bm.block_table(late.seq_id)[:3]) == [3, 4, 5] and bm.block_table(late.seq_id)[3:] == [9, 10]
    assert len(bm.pool.blocks) == 11
    bm.check_invariants()
    bm.pool.blocks[4].ref_count += 1  # a miscount the check must see
    with pytest.raises(AssertionError, match="block 4"):
        bm.check_invariants()


def test_idle_cached_hits_count_as_blocks_taken_from_the_free_queue():
    bm = PagedBlockManager(3, block_size=2, enable_prefix_caching=True, watermark=0.0)
    a = group(4, 1, ids=[1, 2, 3, 4]).seqs[0]
    prefill(bm, a)
    prefill(bm, group(2, 1, ids=[7, 7]).seqs[0])       # 1 block in use, 2 cached blocks idle
    bm.free(a)
    assert bm.num_free_blocks == 2
    # 2 hits, both idle: they leave the free queue, plus 1 new block for the 5th token = 3 > 2
    assert bm.can_allocate(group(5, 1, ids=[1, 2, 3, 4, 5])) is AllocStatus.LATER
    assert bm.can_allocate(group(3, 1, ids=[1, 2, 5])) is AllocStatus.OK     # 1 hit + 1 new


def test_simulated_tokens_are_cached_as_their_sequences_own_content():
    """Issue 26: a block of simulated (-1) tokens is cached, named by the sequence that generated
    them, so that no prompt whose ids spell the same -1s finds it."""
    bm = PagedBlockManager(8, block_size=2, enable_prefix_caching=True)
    s = group(2, ids=[1, 2]).seqs[0]
    prefill(bm, s)
    decode(bm, s, None)
    decode(bm, s, None)                              # block 1 full of simulated (-1) tokens
    assert len(bm.pool.cached) == 2
    assert bm.allocate(group(5, ids=[1, 2, -1, -1, 3]).seqs[0]) == 2   # the prompt block only


# ============================================================================ buddy allocator
def test_buddy_splits_merges_and_external_fragmentation():
    b = BuddyAllocator(16)
    assert b.allocate(3) == 0                                   # 16 -> 8 + 8 -> 4 + 4: [0, 4)
    assert b.free_chunks() == [(4, 4), (8, 8)]
    assert b.allocate(4) == 4
    assert b.allocate(1) == 8                                   # 8 -> 4 + 4 -> 2 + 2 -> 1 + 1
    assert b.free_chunks() == [(9, 1), (10, 2), (12, 4)]
    assert b.num_free == 7 and b.largest_free() == 4
    assert not b.can_allocate(5) and b.allocate(5) is None      # 7 free units, but no 8-chunk
    b.check_invariants()
    b.free(4)                                                   # buddy 0 is in use: no merge
    assert b.free_chunks() == [(4, 4), (9, 1), (10, 2), (12, 4)]
    b.free(0)                                                   # merges with 4 into [0, 8)
    assert b.free_chunks() == [(0, 8), (9, 1), (10, 2), (12, 4)]
    b.free(8)                                                   # 1+1 -> 2+2 -> 4+4 -> 8+8 -> 16
    assert b.free_chunks() == [(0, 16)] and b.num_free == 16
    b.check_invariants()
    with pytest.raises(ValueError, match="not an allocated chunk"):
        b.free(8)


def test_buddy_capacity_not_a_power_of_two():
    b = BuddyAllocator(12)
    assert b.roots == [(0, 8), (8, 4)] and b.max_chunk == 8
    assert b.allocate(5) == 0 and b.allocate(4) == 8 and b.allocate(1) is None
    b.free(8)
    b.free(0)
    assert b.free_chunks() == [(0, 8), (8, 4)]                  # roots never merge with each other
    b.check_invariants()
    assert [next_pow2(x) for x in (0, 1, 2, 3, 4, 5, 1000)] == [1, 1, 2, 4, 4, 8, 1024]


# ============================================================================ contiguous allocator
@pytest.mark.parametrize("variant, slots, chunk, internal", [
    ("max", 10 + 100, 128, 128 - 30),      # prompt + max_tokens
    ("pow2", 10 + 32, 64, 64 - 30),        # prompt + next_pow2(true output 20)
    ("oracle", 10 + 20, 32, 32 - 30),      # prompt + true output
])
def test_contiguous_reservations(variant, slots, chunk, internal):
    alloc = ContiguousAllocator(1024, variant)
    g = group(10, 20, max_tokens=100)
    assert alloc.reservation(g) == slots
    s = g.seqs[0]
    alloc.allocate(g, s)
    assert alloc.buddy.allocated[0] == chunk
    s.num_computed = 10
    m = alloc.memory()
    # 10 prompt states; 20 slots reserved for the true output; the rest of the chunk is never used
    assert (m.token_states, m.reserved, m.internal_frag, m.external_frag, m.free) == \
        (10, 20, internal, 0, 1024 - chunk)
    assert m.total == 1024
    alloc.check_invariants()
    alloc.free(s)
    assert alloc.buddy.num_free == 1024


def test_contiguous_needs_true_length_for_pow2_and_oracle():
    g = SequenceGroup(Request(1, 0.0, 10, SamplingParams(max_tokens=50)), 0)
    assert ContiguousAllocator(128, "max").reservation(g) == 60
    for variant in ("pow2", "oracle"):
        with pytest.raises(ValueError, match="needs the true output length"):
            ContiguousAllocator(128, variant).reservation(g)


def test_contiguous_external_fragmentation_for_a_pending_request():
    alloc = ContiguousAllocator(64, "oracle")
    gs = [group(8, 8) for _ in range(4)]
    for g in gs:
        alloc.allocate(g, g.seqs[0])                            # 4 chunks of 16
    alloc.free(gs[0].seqs[0])
    alloc.free(gs[2].seqs[0])                                   # free: [0, 16) and [32, 48)
    assert alloc.can_allocate(group(16, 16)) is AllocStatus.LATER
    assert alloc.can_allocate(group(40, 30)) is AllocStatus.NEVER   # 70 slots -> a 128-chunk > 64
    m = alloc.memory(pending_slots=32)
    assert (m.external_frag, m.free, m.total) == (32, 0, 64)   # 32 free slots, none usable for 32
    assert alloc.memory(pending_slots=16).external_frag == 0


def test_contiguous_can_allocate_width_needs_every_chunk():
    alloc = ContiguousAllocator(160, "oracle")                  # roots 128 + 32
    assert alloc.can_allocate(group(10, 22, n=2)) is AllocStatus.OK      # 2 x 32
    assert alloc.can_allocate(group(10, 25, n=3)) is AllocStatus.NEVER   # 3 x 64 > 160
    assert alloc.can_allocate(group(10, 22, n=5)) is AllocStatus.OK      # 4 in the 128 root, 1 in 32
    assert alloc.can_allocate(group(10, 22, n=6)) is AllocStatus.NEVER


# ============================================================================ memory accounting
def test_memory_breakdown_adds_up():
    m = MemoryBreakdown(10, 20, 5, 3, 62)
    assert m.total == 100 and m.used == 38
    assert sum(m.fractions().values()) == pytest.approx(1.0)
    assert m.usage_of_allocated() == pytest.approx(10 / 38)
    assert MemoryBreakdown(0, 0, 0, 0, 10).usage_of_allocated() == 1.0


@pytest.mark.parametrize("name", list(POLICIES))
def test_memory_categories_add_up_for_every_policy_every_step(name):
    reqs = [req(i, 5 + 3 * i, 2 + i, arrival=i * 0.5, max_tokens=12) for i in range(6)]
    sched = make_scheduler(name, 16, 4, max_num_seqs=4)
    total = 16 * 4
    seen = []

    def after(s, plan, result):
        m = s.memory()
        seen.append(m)
        assert m.total == total, m
        assert min(m.token_states, m.reserved, m.internal_frag, m.external_frag, m.free) >= 0, m

    run_to_completion(sched, reqs, after=after)
    assert any(m.token_states for m in seen) and sched.memory().free == total


# ============================================================================ vllm scheduler
def vllm(num_blocks: int, block_size: int = 4, **kw) -> VllmScheduler:
    kw.setdefault("watermark", 0.0)
    return make_scheduler("vllm", num_blocks, block_size, **kw)


def test_vllm_admits_fcfs_within_budgets():
    s = vllm(64, max_num_seqs=2, max_num_batched_tokens=16)
    reqs = [req(0, 6, 2), req(1, 6, 2), req(2, 6, 2, arrival=0.5), req(3, 3, 1, arrival=0.7)]
    run = run_to_completion(s, reqs)
    # step 0: 0 and 1 (max_num_seqs=2); 2 and 3 wait until both finish; 3 is shorter but stays
    # behind 2 (FCFS)
    assert [[x.group_id for x in p.seqs] for p in run.plans] == [[0, 1], [0, 1], [2, 3], [2]]
    assert run.admission_order == [0, 1, 2, 3] and run.finish_order == [0, 1, 3, 2]
    s.check_conservation()
    s.bm.assert_empty()


def test_vllm_token_budget_defers_the_next_prompt():
    s = vllm(64, max_num_batched_tokens=16)
    run = run_to_completion(s, [req(0, 10, 3), req(1, 10, 3), req(2, 4, 3)])
    # 10 + 10 > 16: request 1 waits a step; FCFS keeps request 2 behind it although it would fit
    assert [[(x.group_id, x.num_new_tokens) for x in p.seqs] for p in run.plans][:2] == \
        [[(0, 10)], [(0, 1), (1, 10), (2, 4)]]


def test_vllm_preempts_latest_arrival_by_recompute_at_the_exact_step():
    s = vllm(4, max_num_batched_tokens=64)
    run = run_to_completion(s, [req(0, 4, 8), req(1, 4, 8, arrival=0.0)])
    # two 4-token prompts, one block each; at step 1 both take their second block (cache full);
    # at step 5 the 9th token of request 0 needs a third block: request 1 (latest) is preempted
    assert run.preemptions() == [(5, 1, "recompute")]
    assert [x.group_id for x in run.plans[5].seqs] == [0]
    # request 1 waits (3 blocks needed, 1 free) until 0 finishes at step 7, then recomputes its
    # prompt and 5 generated tokens in one prefill
    assert steps_of(run, 1)[-4:] == [(4, 7, 1, True), (8, 0, 9, True), (9, 9, 1, True), (10, 10, 1, True)]
    assert run.finish_order == [0, 1] and run.steps == 11
    g1 = next(g for g in s.done if g.group_id == 1)
    assert g1.num_preemptions == 1 and g1.output_len == 8
    s.check_conservation()
    s.bm.assert_empty()


def test_vllm_preemption_by_swap():
    s = vllm(4, num_cpu_blocks=4, preemption="swap")
    run = run_to_completion(s, [req(0, 4, 8), req(1, 4, 8)])
    assert run.preemptions() == [(5, 1, "swap")]
    # request 0 holds [0, 2], request 1 [1, 3]; both of 1's blocks go to cpu 0 and 1
    assert run.plans[5].swap_out == [(1, 0), (3, 1)]
    # back in at step 8 (after 0 finishes), into the blocks 0 freed; no recompute: one token
    assert run.plans[8].swap_in == [(0, 0), (1, 2)]
    assert steps_of(run, 1)[-3:] == [(8, 8, 1, True), (9, 9, 1, True), (10, 10, 1, True)]
    assert run.plans[8].seqs[0].block_table == [0, 2, 1]
    assert run.finish_order == [0, 1] and run.steps == 11
    g1 = next(g for g in s.done if g.group_id == 1)
    assert (g1.num_preemptions, g1.num_swaps) == (1, 1)
    s.bm.assert_empty()


def test_vllm_no_admission_while_a_group_is_swapped_out():
    s = vllm(4, num_cpu_blocks=4, preemption="swap")
    run = run_to_completion(s, [req(0, 4, 8), req(1, 4, 8), req(2, 1, 1, arrival=5.5)])
    # request 2 (1 block) arrives at t=5.5 and a block is free at steps 6 and 7, but 1 is swapped
    # out until step 8: 2 is admitted in the step that swaps 1 back in
    assert run.first_step_of(2) == 8
    assert run.plans[8].swap_in and [x.group_id for x in run.plans[8].seqs] == [1, 2]


def test_vllm_chunked_prefill_chunk_sizes():
    s = vllm(64, max_num_batched_tokens=8, chunked_prefill=True)
    run = run_to_completion(s, [req(0, 20, 2), req(1, 6, 2)])
    chunks = [[(x.group_id, x.start, x.num_new_tokens, x.samples) for x in p.seqs] for p in run.plans]
    assert chunks == [
        [(0, 0, 8, False)],
        [(0, 8, 8, False)],
        [(0, 16, 4, True), (1, 0, 4, False)],   # the rest of 0, and 1 fills the budget
        [(0, 20, 1, True), (1, 4, 2, True)],
        [(1, 6, 1, True)],
    ]
    for p in run.plans:
        assert sum(x.num_new_tokens for x in p.seqs) <= 8


def test_vllm_rejects_a_request_larger_than_the_cache_while_others_finish():
    s = vllm(4)
    run = run_to_completion(s, [req(0, 4, 4), req(1, 20, 1), req(2, 4, 4)])
    reason = run.rejections()[1]
    assert "needs 6 blocks" in reason and "holds 4" in reason
    assert run.plans[0].rejected == [(1, reason)]
    assert [x.group_id for x in run.plans[0].seqs] == [0, 2]
    assert run.finish_order == [0, 2]
    g1 = next(g for g in s.done if g.group_id == 1)
    assert g1.rejected == reason and g1.status == SeqStatus.FINISHED
    s.check_conservation()
    s.bm.assert_empty()


def test_vllm_rejects_beam_width_the_cache_cannot_hold():
    s = vllm(10)
    run = run_to_completion(s, [req(0, 4, 4, beam=5), req(1, 4, 4, beam=4)])
    assert list(run.rejections()) == [0]
    assert run.finish_order == [1]


def test_vllm_prompt_longer_than_token_budget():
    s = vllm(64, max_num_batched_tokens=16)
    run = run_to_completion(s, [req(0, 20, 2), req(1, 16, 2)])
    assert "prompt of 20 tokens exceeds max_num_batched_tokens=16" in run.rejections()[0]
    assert run.finish_order == [1]
    s = vllm(64, max_num_batched_tokens=16, chunked_prefill=True)
    run = run_to_completion(s, [req(0, 20, 2), req(1, 16, 2)])
    assert [n for _, _, n, _ in steps_of(run, 0)] == [16, 4, 1]
    assert not run.rejections() and run.finish_order == [0, 1]


def test_vllm_prefix_caching_through_the_scheduler():
    s = vllm(32, prefix_caching=True)
    ids = list(range(12))
    run = run_to_completion(s, [req(0, 12, 2, ids=ids), req(1, 12, 2, arrival=5.0, ids=list(ids))])
    # request 1 finds 2 of its 3 blocks cached: it computes only its last 4 tokens
    assert steps_of(run, 1)[0][1:3] == (8, 4)
    g1 = next(g for g in s.done if g.group_id == 1)
    assert g1.prefix_hit_tokens == 8
    assert s.bm.prefix_hits == 2
    s.bm.assert_empty()


def test_vllm_parallel_sampling_shares_the_prompt():
    s = vllm(32, max_num_seqs=8)
    run = run_to_completion(s, [req(0, 6, 4, n=3)])
    assert [len(p.seqs) for p in run.plans] == [1, 3, 3, 3]
    # after the fork the three samples each copy the shared partial block 1 (the last writes in place)
    assert len(run.plans[1].copies) == 2 and all(src == 1 for src, _ in run.plans[1].copies)
    tables = [x.block_table for x in run.plans[1].seqs]
    assert len({t[0] for t in tables}) == 1                   # full prompt block 0 shared by all
    g = s.done[0]
    assert len(g.finished_seqs) == 3 and g.output_len == 4
    s.bm.assert_empty()


def test_vllm_beam_search_forks_prunes_and_frees():
    s = vllm(64, max_num_seqs=8)
    run = run_to_completion(s, [req(0, 5, 6, beam=3)], seed=3)
    assert [len(p.seqs) for p in run.plans] == [1, 3, 3, 3, 3, 3]
    assert any(p.copies for p in run.plans)
    assert len(s.done[0].finished_seqs) == 3
    s.check_conservation()
    s.bm.assert_empty()


def test_vllm_restart_of_a_forked_group_without_swap_space():
    s = vllm(9, max_num_seqs=8)
    run = run_to_completion(s, [req(0, 4, 10, n=2), req(1, 4, 6, n=2)])
    # at step 5 both samples of each request need a third block: 8 + 2 > 9, so request 1 (forked,
    # no CPU pool) restarts from its prompt (its samples and outputs are dropped) at step 6, and
    # again at step 9 when request 0's samples open their fourth blocks
    assert run.preemptions() == [(5, 1, "restart"), (9, 1, "restart")]
    assert [c for c in steps_of(run, 1) if c[1] == 0] == [(0, 0, 4, True), (6, 0, 4, True), (10, 0, 4, True)]
    assert run.finish_order == [0, 1]
    assert len(s.done[1].finished_seqs) == 2 and s.done[1].output_len == 6
    s.check_conservation()
    s.bm.assert_empty()


# ============================================================================ contiguous schedulers
def test_orca_max_vs_oracle_admission():
    workload = [req(0, 10, 3, max_tokens=50), req(1, 10, 5, max_tokens=50), req(2, 10, 2, max_tokens=20)]
    s = make_scheduler("orca-max", 8, 16)                    # 128 slots
    run = run_to_completion(s, workload)
    # max reserves 60 -> 64, 60 -> 64, 30 -> 32: request 2 waits until 0 finishes (after step 2)
    assert [run.first_step_of(g) for g in (0, 1, 2)] == [0, 0, 3]
    assert run.plans[0].seqs[0].block_table == list(range(60))
    s = make_scheduler("orca-oracle", 8, 16)
    run = run_to_completion(s, workload)
    assert [run.first_step_of(g) for g in (0, 1, 2)] == [0, 0, 0]   # 13, 15, 12 -> 16 each
    s = make_scheduler("orca-pow2", 8, 16)
    assert s.alloc.reservation(SequenceGroup(workload[1], 0)) == 10 + 8


def test_orca_variants_reserve_max_pow2_oracle():
    # 128 slots; three requests of prompt 10 and true output 17, max_tokens 100
    workload = [req(i, 10, 17, max_tokens=100) for i in range(3)]
    first = {}
    for name in ("orca-max", "orca-pow2", "orca-oracle"):
        run = run_to_completion(make_scheduler(name, 8, 16), workload)
        first[name] = [run.first_step_of(g) for g in range(3)]
    # max: 110 -> a 128-chunk each, one at a time (each runs 17 steps)
    # pow2: 10 + 32 = 42 -> 64-chunks, two at a time; oracle: 27 -> 32-chunks, all three at once
    assert first == {"orca-max": [0, 17, 34], "orca-pow2": [0, 0, 17], "orca-oracle": [0, 0, 0]}


def test_orca_external_fragmentation_is_real():
    s = make_scheduler("orca-max", 8, 16)                    # 128 slots, chunks of 32
    reqs = [req(i, 10, out, max_tokens=22) for i, out in enumerate((1, 10, 1, 10))]
    reqs.append(req(4, 10, 5, max_tokens=40))                # needs a 64-chunk
    seen = []
    run = run_to_completion(s, reqs, after=lambda sc, p, r: seen.append(sc.memory()))
    # after step 0: 0 and 2 finished, freeing [0, 32) and [64, 96): 64 slots free but no 64-chunk
    m = seen[0]
    assert (m.token_states, m.reserved, m.internal_frag, m.external_frag, m.free) == (20, 20, 24, 64, 0)
    assert run.first_step_of(4) == 10                        # when 1 frees [32, 64), [0, 64) merges
    assert s.alloc.buddy.num_free == 128


def test_orca_counts_the_width_of_unforked_groups_against_max_num_seqs():
    s = make_scheduler("orca-max", 64, 16, max_num_seqs=4)
    run = run_to_completion(s, [req(0, 4, 3, n=4), req(1, 4, 3)])
    assert max(len(p.seqs) for p in run.plans) == 4
    assert run.first_step_of(1) == 3                          # after the 4 samples finish


@pytest.mark.parametrize("name", ["orca-max", "orca-oracle", "static"])
@pytest.mark.parametrize("kind", ["n", "beam"])
def test_contiguous_forks_copy_into_spare_chunks(name, kind):
    s = make_scheduler(name, 64, 16, max_num_seqs=8)
    run = run_to_completion(s, [req(0, 20, 6, **{kind: 3}), req(1, 5, 4)], seed=2, vary_children=True)
    first_fork = next(i for i, p in enumerate(run.plans) if sum(x.group_id == 0 for x in p.seqs) > 1)
    # the children copy the parent's 20 computed prompt slots (alloc unit 1) before the step that
    # runs them
    assert len(run.plans[first_fork].copies) == 2 * 20
    s.check_conservation()
    assert s.memory().free == 64 * 16


def test_static_batches_requests_until_the_whole_batch_ends():
    workload = [req(0, 10, 2, max_tokens=20), req(1, 20, 6, max_tokens=20), req(2, 30, 1, max_tokens=20)]
    s = make_scheduler("static", 8, 16)                      # 128 slots
    mems = []
    run = run_to_completion(s, workload, after=lambda sc, p, r: mems.append(sc.memory()))
    # [0, 1] padded to 20 + 20 each = 80 slots; adding 2 (50 each x 3 = 150) does not fit
    assert [(x.group_id, x.num_new_tokens) for x in run.plans[0].seqs] == [(0, 10), (1, 20)]
    assert run.first_step_of(2) == 6                         # only when all of batch [0, 1] is done
    m = mems[2]                                              # after step 2: request 1 alone, 22 states
    assert (m.token_states, m.reserved, m.internal_frag, m.external_frag, m.free) == (22, 4, 54, 0, 48)
    assert s.memory().free == 128                            # the last batch's memory is released
    s = make_scheduler("orca-max", 8, 16)
    assert run_to_completion(s, workload).first_step_of(2) == 2    # Orca admits it when 0 finishes


def test_static_rejects_what_can_never_run():
    s = make_scheduler("static", 8, 16, max_num_seqs=2, max_num_batched_tokens=32)
    run = run_to_completion(s, [req(0, 120, 20), req(1, 40, 1), req(2, 4, 2, n=3), req(3, 4, 2)])
    rej = run.rejections()
    assert "padded reservation of 140 slots exceeds the cache (128 slots)" in rej[0]
    assert "prompt of 40 tokens exceeds max_num_batched_tokens=32" in rej[1]
    assert "needs 3 sequences at once but max_num_seqs=2" in rej[2]
    assert run.finish_order == [3]
    s.check_conservation()


def test_orca_rejects_what_can_never_run():
    s = make_scheduler("orca-max", 8, 16, max_num_seqs=2, max_num_batched_tokens=32)
    run = run_to_completion(s, [req(0, 120, 20), req(1, 40, 1), req(2, 4, 2, n=3), req(3, 4, 2)])
    rej = run.rejections()
    assert "reservation of 1 x 140 slots does not fit" in rej[0]
    assert "prompt of 40 tokens exceeds max_num_batched_tokens=32" in rej[1]
    assert "needs 3 sequences at once" in rej[2]
    assert run.finish_order == [3]


# ============================================================================ the step contract
def test_on_step_done_needs_an_outcome_for_every_sampling_sequence():
    s = vllm(8)
    s.add_request(req(0, 4, 2))
    plan = s.schedule(0.0)
    with pytest.raises(ValueError, match="no outcome for sampling sequence"):
        s.on_step_done(plan, StepResult(1.0), 1.0)


def test_a_dropped_parent_with_children_continues_as_its_first_child():
    for name in ("vllm", "orca-max"):
        s = make_scheduler(name, 32, 4)
        g = s.add_request(req(0, 4, 4, beam=2))
        plan = s.schedule(0.0)
        (sid,) = [x.seq_id for x in plan.seqs]
        s.on_step_done(plan, StepResult(1.0, {sid: SeqOutcome(sid, 5, children=[6])}), 1.0)
        plan = s.schedule(1.0)
        a, b = (x.seq_id for x in plan.seqs)
        # beam a is dropped but has two children, beam b is pruned: 2 beams remain, a's memory reused
        s.on_step_done(plan, StepResult(1.0, {a: SeqOutcome(a, None, keep=False, children=[7, 8]),
                                              b: SeqOutcome(b, None, keep=False)}), 2.0)
        assert len(g.seqs) == 2 and g.seqs[0].seq_id == a
        assert [x.output_len for x in g.seqs] == [2, 2]
        s.check_conservation()


def test_children_born_finished_end_at_once_and_free_their_blocks():
    # n = 3 with a one-token limit: the first step samples three tokens, and all three samples end
    for name in ("vllm", "orca-max"):
        s = make_scheduler(name, 32, 4)
        g = s.add_request(req(0, 6, 1, n=3))
        plan = s.schedule(0.0)
        (sid,) = [x.seq_id for x in plan.seqs]
        out = SeqOutcome(sid, 5, children=[6, 7], finished=True, children_finished=[True, True])
        done = s.on_step_done(plan, StepResult(1.0, {sid: out}), 1.0)
        assert done == [g] and not g.seqs and sorted(x.output_len for x in g.finished_seqs) == [1, 1, 1]
        assert not s.has_unfinished()
        s.check_conservation()
        if name == "vllm":
            s.bm.assert_empty()


def test_plan_composition():
    plan = StepPlan(seqs=[ScheduledSeq(0, 0, 0, 10, [], True, None), ScheduledSeq(1, 1, 4, 4, [], False, None),
                          ScheduledSeq(2, 2, 20, 1, [], True, None)], copies=[(1, 2)], swap_in=[(0, 3)])
    c = plan.composition()
    assert (c.num_prefill_seqs, c.prefill_tokens, c.prefill_context_tokens) == (2, 14, 4)
    assert c.prefill_attn_pairs == 55 + (4 * 4 + 10)
    assert (c.num_decode_seqs, c.decode_context_tokens, c.num_tokens) == (1, 21, 15)
    assert (c.copy_blocks, c.swap_in_blocks, c.swap_out_blocks) == (1, 1, 0)
    assert StepPlan().is_empty and not plan.is_empty


def test_driver_fails_clearly_on_a_stalled_scheduler():
    class Stuck(OrcaScheduler):
        def schedule(self, now):
            return StepPlan()

    with pytest.raises(AssertionError, match=r"stalled at t=.*waiting=\[0\]"):
        run_to_completion(Stuck(64), [req(0, 4, 2)])
    with pytest.raises(AssertionError, match="not done after 3 steps"):
        run_to_completion(make_scheduler("vllm", 8, 4), [req(0, 4, 8)], max_steps=3)


# ============================================================================ bad input
@pytest.mark.parametrize("make, word", [
    (lambda: PagedBlockManager(8, block_size=0), "block_size must be >= 1"),
    (lambda: PagedBlockManager(0), "num_gpu_blocks must be >= 1"),
    (lambda: PagedBlockManager(-3), "num_gpu_blocks must be >= 1"),
    (lambda: PagedBlockManager(8, num_cpu_blocks=-1), "num_cpu_blocks must be >= 0"),
    (lambda: PagedBlockManager(8, watermark=1.0), r"watermark must be in \[0, 1\)"),
    (lambda: BuddyAllocator(0), "capacity must be >= 1"),
    (lambda: ContiguousAllocator(0), "num_slots must be >= block_size"),
    (lambda: ContiguousAllocator(64, block_size=0), "block_size must be >= 1"),
    (lambda: ContiguousAllocator(64, "best"), "variant must be one of max, pow2, oracle"),
    (lambda: OrcaScheduler(0), "num_slots"),
    (lambda: StaticScheduler(0), "num_slots must be >= block_size"),
    (lambda: make_scheduler("vllm", 0), "num_blocks must be >= 1"),
    (lambda: make_scheduler("vllm", 8, max_num_seqs=0), "max_num_seqs must be >= 1"),
    (lambda: make_scheduler("vllm", 8, 16, max_num_batched_tokens=8),
     r"max_num_batched_tokens must be >= block_size \(16\), got 8"),
    (lambda: make_scheduler("vllm", 8, preemption="kill"), "preemption must be one of recompute, swap"),
    (lambda: make_scheduler("vllm", 8, preemption="swap"), "num_cpu_blocks >= 1"),
    (lambda: make_scheduler("vllm", 8, num_cpu_blocks=-2), "num_cpu_blocks must be >= 0"),
    (lambda: make_scheduler("vllm", 8, bogus=1), "unknown parameter 'bogus' for policy 'vllm'"),
    (lambda: make_scheduler("orca-max", 8, bogus=1), "unknown parameter 'bogus'"),
    (lambda: make_scheduler("orca-max", 8, chunked_prefill=True), "applies to the paged 'vllm' policy only"),
    (lambda: make_scheduler("static", 8, max_num_seqs=-1), "max_num_seqs must be >= 1"),
    (lambda: SamplingParams(n=0), "n must be >= 1"),
    (lambda: SamplingParams(beam_width=-1), "beam_width must be >= 1"),
])
def test_invalid_parameters_name_the_parameter(make, word):
    with pytest.raises(ValueError, match=word):
        make()


@pytest.mark.parametrize("name", list(POLICIES))
def test_block_size_below_one_is_rejected_for_every_policy(name):
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        make_scheduler(name, 8, 0)


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown policy 'orca'") as e:
        make_scheduler("orca", 8)
    for name in ("vllm", "orca-max", "orca-pow2", "orca-oracle", "static"):
        assert name in str(e.value)
    assert set(POLICIES) == {"vllm", "orca-max", "orca-pow2", "orca-oracle", "static", "priority", "sjf", "srpt",
                             "vtc", "edf"}


def test_registry_builds_the_expected_classes():
    assert isinstance(make_scheduler("vllm", 8), VllmScheduler)
    s = make_scheduler("orca-pow2", 8, 16, max_num_seqs=3)
    assert isinstance(s, OrcaScheduler) and s.alloc.variant == "pow2" and s.alloc.num_slots == 128
    assert s.max_num_seqs == 3 and s.name == "orca-pow2"
    assert isinstance(make_scheduler("static", 8), StaticScheduler)


# ============================================================================ known bugs in vllm_scheduler.py
def test_vllm_max_num_seqs_counts_the_width_of_unforked_groups():
    s = vllm(64, max_num_seqs=4)
    run = run_to_completion(s, [req(0, 4, 3, n=2), req(1, 4, 3, n=2), req(2, 4, 3, n=2)])
    assert max(len(p.seqs) for p in run.plans) <= 4


def test_vllm_rejects_a_group_wider_than_an_iteration():
    s = vllm(64, block_size=2, max_num_batched_tokens=2, chunked_prefill=True)
    run = run_to_completion(s, [req(0, 2, 4, n=3), req(1, 2, 2)])
    assert 0 in run.rejections() and run.finish_order == [1]


def test_vllm_group_swapped_mid_chunked_prefill_comes_back():
    s = vllm(8, max_num_batched_tokens=8, chunked_prefill=True, preemption="swap", num_cpu_blocks=16)
    run = run_to_completion(s, [req(0, 4, 28), req(1, 30, 1)])
    assert run.preemptions() == [(3, 1, "swap")]
    assert run.finish_order == [0, 1]


def test_vllm_recompute_does_not_reject_a_request_that_was_running():
    s = vllm(6, max_num_batched_tokens=16)
    run = run_to_completion(s, [req(0, 4, 12), req(1, 12, 8)])
    assert run.preemptions() and run.preemptions()[0][1] == 1
    assert not run.rejections() and sorted(run.finish_order) == [0, 1]


def test_a_subclass_seq_demand_rule_is_what_admission_counts():
    """The paged scheduler counts plain groups inline for speed, but only while seq_demand is the
    base rule: a subclass that reserves two sequences a group gets its own rule applied."""
    class Reserving(VllmScheduler):
        @staticmethod
        def seq_demand(group: SequenceGroup) -> int:
            return 2

    def running_after_two_steps(cls: type[VllmScheduler]) -> int:
        s = cls(num_gpu_blocks=100, block_size=4, max_num_seqs=4)
        for i in range(2):
            s.add_request(req(i, 4, 8))
        s.schedule(0.0)  # both admitted: 2 running groups, whose demand the rule then decides
        for i in range(2, 4):
            s.add_request(req(i, 4, 8))
        s.schedule(1.0)
        return len(s.running)

    assert running_after_two_steps(VllmScheduler) == 4
    assert running_after_two_steps(Reserving) == 2  # 2 x 2 reserved: no room for another


# ---------------------------------------------------------------- the replica front door


@pytest.mark.parametrize("options, says", [
    ({"num_gpu_blocks": 0}, "num_gpu_blocks must be an integer >= 1, got 0 (--num-gpu-blocks)"),
    ({"num_cpu_blocks": -1}, "num_cpu_blocks must be an integer >= 0, got -1 (--num-cpu-blocks)"),
    ({"block_size": 0}, "block_size must be an integer >= 1, got 0 (--block-size)"),
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0 (--max-num-seqs)"),
    ({"max_num_batched_tokens": 8}, "max_num_batched_tokens must be >= block_size (16), got 8 "
                                    "(--max-num-batched-tokens)"),
    ({"preemption": "drop"}, "preemption must be one of recompute, swap; got 'drop' (--preemption)"),
    ({"preemption": "swap"}, "preemption='swap' (--preemption) needs num_cpu_blocks >= 1"),
    ({"slo_ttft": float("inf")}, "slo_ttft must be a finite number of seconds > 0, got inf (--slo-ttft)"),
    ({"watermark": 1.0}, "watermark must be in [0, 1), got 1.0"),
    ({"max_model_len": 0}, "max_model_len must be >= 1, got 0"),
    ({"policy": "orca-max", "chunked_prefill": True},
     "chunked_prefill=True applies to the paged 'vllm' policy only, not 'orca-max' (--chunked-prefill)"),
])
def test_replica_config_refuses_what_no_replica_can_use_naming_field_and_flag(options, says):
    with pytest.raises(ValueError) as refused:
        ReplicaConfig(**{"num_gpu_blocks": 8, **options})
    assert says in str(refused.value)


def test_build_scheduler_gives_the_constructor_every_option():
    paged = build_scheduler(ReplicaConfig(64, 8, num_cpu_blocks=4, max_num_seqs=3, max_num_batched_tokens=32,
                                          preemption="swap", chunked_prefill=True, prefix_caching=True,
                                          watermark=0.25, max_model_len=100))
    assert (paged.max_num_seqs, paged.max_num_batched_tokens, paged.preemption, paged.chunked_prefill) == \
        (3, 32, "swap", True)
    assert paged.max_model_len == 100 and paged.bm.enable_prefix_caching and paged.bm.watermark_blocks == 16
    assert paged.bm.cpu.num_blocks == 4
    orca = build_scheduler(ReplicaConfig(64, 8, "orca-max", num_cpu_blocks=4, max_model_len=50, alloc_unit=8))
    assert orca.max_model_len == 50 and orca.block_size == 8 and orca.alloc.buddy.capacity == 64


def test_a_plan_hands_the_executor_its_sequences():
    """Executors hold no scheduler: each scheduled sequence comes with its Sequence."""
    sched = make_scheduler("vllm", 32, 4)
    for i in range(3):
        sched.add_request(Request(i, 0.0, 5 + i, SamplingParams(max_tokens=4, ignore_eos=True), 4,
                                  prompt_token_ids=list(range(5 + i))))
    plan = sched.schedule(0.0)
    assert len(plan.seqs) == 3
    for ss in plan.seqs:
        assert ss.seq is sched.seqs[ss.seq_id] and ss.seq.group.group_id == ss.group_id
        assert ss.seq.token_ids[ss.start:ss.start + ss.num_new_tokens] == list(range(ss.num_new_tokens))


def test_fcfs_is_another_name_for_vllm() -> None:
    from policies.registry import ALIASES
    assert ALIASES["fcfs"] == "vllm"
    sched = make_scheduler("fcfs", 64, 16)
    assert type(sched) is type(make_scheduler("vllm", 64, 16)) and sched.policy.name == "fcfs"
    with pytest.raises(ValueError, match=r"unknown policy 'fcfz'; known: vllm"):
        make_scheduler("fcfz", 64, 16)


@pytest.mark.parametrize("on_instance", [False, True])
def test_a_hook_overridden_by_class_or_instance_is_called(on_instance):
    """The scheduler skips only QueuePolicy's own no-op hooks: one a subclass defines, or one set
    on the instance, is called for every group (queued, preempted back, admitted, finished)."""
    from policies.queue_policy import QueuePolicy

    seen: list[tuple[str, int]] = []

    class Logging(QueuePolicy):
        if not on_instance:
            def on_queued(self, group):
                seen.append(("queued", group.group_id))

            def on_admitted(self, group, now):
                seen.append(("admitted", group.group_id))

            def on_finished(self, group):
                seen.append(("finished", group.group_id))

    policy = Logging()
    if on_instance:
        policy.on_queued = lambda group: seen.append(("queued", group.group_id))
        policy.on_admitted = lambda group, now: seen.append(("admitted", group.group_id))
        policy.on_finished = lambda group: seen.append(("finished", group.group_id))
    sched = VllmScheduler(num_gpu_blocks=64, block_size=4, policy=policy)
    run_to_completion(sched, [req(i, 8, 5, arrival=0.0) for i in range(3)])
    for kind in ("queued", "admitted", "finished"):
        assert sorted(g for k, g in seen if k == kind) == [0, 1, 2]
    plain = VllmScheduler(num_gpu_blocks=64, block_size=4)
    assert not (plain._tells_queued or plain._tells_admitted or plain._tells_finished)
