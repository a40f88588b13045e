"""Property tests (hypothesis) of policies/: random operation sequences on the paged block manager
checked against a shadow model of block contents, and random workloads through every scheduler.

Known bugs in vllm_scheduler.py (see the xfail tests at the end of test_policies_unit.py) are kept
out of the vllm workloads here: max_num_seqs leaves room for every fork, no group is wider than
max_num_batched_tokens, and swap preemption is not combined with chunked prefill.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from policies.block_manager import AllocStatus, PagedBlockManager
from policies.buddy import BuddyAllocator
from policies.plan import StepPlan
from policies.registry import POLICIES, make_scheduler
from policies.request import Request, SamplingParams, Sequence, SequenceGroup
from policies.scheduler import Scheduler
from tests.fuzz_budget import fuzz_examples
from tests.policy_helpers import req, run_to_completion

PREFIXES = [[(i * 7 + k) % 3 for i in range(48)] for k in range(3)]   # prompts share prefixes


def _chain(tokens: list[int], hbs: int) -> tuple[int, ...]:
    """Chained hashes of `tokens` in blocks of `hbs` (the last one partial), as Mooncake traces give."""
    out, h = [], 0
    for k in range(0, len(tokens), hbs):
        h = hash((h, tuple(tokens[k:k + hbs])))
        out.append(h)
    return tuple(out)


# ============================================================================ block manager
class BlockManagerModel:
    """Random allocate / decode / fork / free / swap-out / swap-in on a PagedBlockManager, with a
    shadow copy of what every physical (and CPU) block holds, written only where the manager says
    a token goes."""

    def __init__(self, num_blocks, bs, num_cpu, caching, hbs_kind):
        self.bm = PagedBlockManager(num_blocks, bs, num_cpu, watermark=0.0, enable_prefix_caching=caching)
        self.bs = bs
        self.hbs = {"same": bs, "double": 2 * bs, "odd": bs + 1}[hbs_kind]
        self.gpu: dict[int, list] = {}       # block id -> token per slot (None = never written)
        self.cpu: dict[int, list] = {}
        self.tokens: dict[int, list[int]] = {}  # seq id -> its true tokens (the model)
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.next_id = 0

    # ---------------------------------------------------------------- helpers
    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _seqs(self) -> list[Sequence]:
        return [s for g in self.running for s in g.seqs]

    def _write(self, seq: Sequence, old_table: list[int], copies: list[tuple[int, int]], start: int, stop: int):
        """Apply an append: copies first, fresh blocks blank, then tokens [start, stop) written."""
        bm, bs = self.bm, self.bs
        for src, dst in copies:
            assert bm.pool.blocks[src].ref_count >= 1, "copy source was freed"
            self.gpu[dst] = list(self.gpu[src])
        table = bm.block_table(seq.seq_id)
        dsts = {d for _, d in copies}
        for b in table[len(old_table):]:
            if b not in dsts:
                self.gpu[b] = [None] * bs
        toks = self.tokens[seq.seq_id]
        for p in range(start, stop):
            b = table[p // bs]
            # a shared block is never written in place
            assert bm.pool.blocks[b].ref_count == 1, f"seq {seq.seq_id} writes shared block {b}"
            others = [s.seq_id for s in self._seqs() if s is not seq and b in bm.tables.get(s.seq_id, ())]
            assert not others, f"block {b} written by {seq.seq_id} is also in {others}"
            self.gpu[b][p % bs] = toks[p]

    # ---------------------------------------------------------------- rules
    def allocate(self, prefix, length, tail, use_hashes):
        toks = PREFIXES[prefix][:length] + tail
        if use_hashes:   # the manager sees only chained hashes of hash blocks; the shadow knows the tokens
            r = Request(self._id(), 0.0, len(toks), SamplingParams(max_tokens=4), output_len=4,
                        prefix_hashes=_chain(toks, self.hbs), hash_block_size=self.hbs)
        else:
            r = Request(self._id(), 0.0, len(toks), SamplingParams(max_tokens=4), output_len=4,
                        prompt_token_ids=list(toks))
        g = SequenceGroup(r, self._id())
        seq = g.seqs[0]
        status = self.bm.can_allocate(g)
        if status is not AllocStatus.OK:
            assert status is AllocStatus.NEVER or self.bm.max_blocks_needed(g) <= self.bm.num_gpu_blocks
            return
        self.tokens[seq.seq_id] = list(toks)
        cached = self.bm.allocate(seq)
        assert cached % self.bs == 0 and cached < seq.num_tokens   # the last prompt token is computed
        table = list(self.bm.block_table(seq.seq_id))
        for p in range(cached):   # a prefix hit maps to blocks holding exactly these tokens
            assert self.gpu[table[p // self.bs]][p % self.bs] == toks[p], f"prefix hit with other content at {p}"
        if cached:
            event(f"prefix hit ({'hashes' if use_hashes else 'token ids'})")
        seq.num_computed = cached
        copies = self.bm.append_slots(seq, seq.num_tokens - cached)
        assert copies == [], "can_allocate said OK but the prompt did not get its blocks"
        self._write(seq, table, copies, cached, seq.num_tokens)
        seq.num_computed = seq.num_tokens
        self.running.append(g)

    def decode(self, i, tok):
        seqs = self._seqs()
        if not seqs:
            return
        seq = seqs[i % len(seqs)]
        before = list(self.bm.block_table(seq.seq_id))
        free_before = self.bm.num_free_blocks
        seq.append(tok)
        self.tokens[seq.seq_id].append(tok)
        copies = self.bm.append_slots(seq, 1)
        if copies is None:   # out of blocks: nothing changed; take the token back
            assert self.bm.block_table(seq.seq_id) == before and self.bm.num_free_blocks == free_before
            seq.output_len -= 1
            if seq.token_ids is not None:
                seq.token_ids.pop()
            self.tokens[seq.seq_id].pop()
            return
        if copies:
            event("copy-on-write")
        self._write(seq, before, copies, seq.num_computed, seq.num_computed + 1)
        seq.num_computed += 1

    def fork(self, i):
        seqs = self._seqs()
        if not seqs:
            return
        parent = seqs[i % len(seqs)]
        g = parent.group
        child = Sequence(self._id(), g, parent.prompt_len, parent.target_len,
                         None if parent.token_ids is None else list(parent.token_ids), parent.output_len)
        child.num_computed = parent.num_computed
        free_before = self.bm.num_free_blocks
        self.bm.fork(parent, child)
        assert self.bm.num_free_blocks == free_before
        assert self.bm.block_table(child.seq_id) == self.bm.block_table(parent.seq_id)
        self.tokens[child.seq_id] = list(self.tokens[parent.seq_id])
        g.seqs.append(child)

    def free(self, i):
        seqs = self._seqs()
        if not seqs:
            return
        seq = seqs[i % len(seqs)]
        self.bm.free(seq)
        seq.group.seqs.remove(seq)
        if not seq.group.seqs:
            self.running.remove(seq.group)

    def swap_out(self, i):
        if not self.running or not self.bm.cpu.num_blocks:
            return
        g = self.running[i % len(self.running)]
        if not self.bm.can_swap_out(g):
            return
        distinct = {b for s in g.seqs for b in self.bm.block_table(s.seq_id)}
        mapping = self.bm.swap_out(g)
        assert len(mapping) == len(distinct) and {b for b, _ in mapping} == distinct   # sharing kept
        event("swap out of a forked group" if len(g.seqs) > 1 else "swap out")
        for b, c in mapping:
            self.cpu[c] = list(self.gpu[b])
        self.running.remove(g)
        self.swapped.append(g)

    def swap_in(self, i):
        if not self.swapped:
            return
        g = self.swapped[i % len(self.swapped)]
        if not self.bm.can_swap_in(g):
            return
        distinct = {c for s in g.seqs for c in self.bm.cpu_tables[s.seq_id]}
        mapping = self.bm.swap_in(g)
        assert {c for c, _ in mapping} == distinct and len({b for _, b in mapping}) == len(distinct)
        event("swap in")
        for c, b in mapping:
            self.gpu[b] = list(self.cpu[c])
        self.swapped.remove(g)
        self.running.append(g)

    # ---------------------------------------------------------------- invariants
    def consistent(self):
        bm, bs = self.bm, self.bs
        bm.check_invariants()   # reference counts match the tables, free queue = idle blocks, cpu too
        used = sum(b.ref_count > 0 for b in bm.pool.blocks)
        assert bm.num_free_blocks + used == bm.num_gpu_blocks
        assert all(b.ref_count >= 0 for b in bm.pool.blocks)
        assert set(bm.pool.cached.values()) <= set(range(bm.num_gpu_blocks))
        live = {s.seq_id for s in self._seqs()}
        assert set(bm.tables) == live
        assert set(bm.cpu_tables) == {s.seq_id for g in self.swapped for s in g.seqs}
        for s in self._seqs():   # each table covers exactly its tokens, with the right content
            table = bm.block_table(s.seq_id)
            assert bm.slots[s.seq_id] == s.num_computed == s.num_tokens
            assert len(table) == -(-s.num_tokens // bs)
            toks = self.tokens[s.seq_id]
            assert [self.gpu[table[p // bs]][p % bs] for p in range(s.num_tokens)] == toks
            for j, b in enumerate(table):
                assert bm.pool.blocks[b].filled == min(bs, s.num_tokens - j * bs)
        for g in self.swapped:
            for s in g.seqs:
                ct = bm.cpu_tables[s.seq_id]
                assert [self.cpu[ct[p // bs]][p % bs] for p in range(s.num_tokens)] == self.tokens[s.seq_id]
        m = bm.memory()
        assert m.total == bm.num_gpu_blocks * bs
        assert m.token_states == sum(bm.pool.blocks[b].filled for b in {b for t in bm.tables.values() for b in t})

    def teardown(self):
        for g in self.running:
            for s in g.seqs:
                self.bm.free(s)
        for g in self.swapped:   # with the GPU empty, every swapped group fits back
            assert self.bm.can_swap_in(g)
            self.bm.swap_in(g)
            for s in g.seqs:
                self.bm.free(s)
        self.bm.assert_empty()   # no block leaked, on the GPU or in the CPU pool


_ID = st.integers(0, 10 ** 6)
OPS = st.one_of(
    st.tuples(st.just("allocate"), st.integers(0, 2), st.integers(1, 16), st.lists(st.integers(0, 2), max_size=4),
              st.booleans()),
    st.tuples(st.just("decode"), _ID, st.integers(0, 2)),
    st.tuples(st.just("decode"), _ID, st.integers(0, 2)),
    st.tuples(st.just("fork"), _ID),
    st.tuples(st.just("free"), _ID),
    st.tuples(st.just("swap_out"), _ID),
    st.tuples(st.just("swap_in"), _ID),
)


@settings(max_examples=fuzz_examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(6, 40), bs=st.integers(1, 4), num_cpu=st.sampled_from([0, 6, 24]),
       caching=st.booleans(), hbs_kind=st.sampled_from(["same", "double", "odd"]),
       ops=st.lists(OPS, min_size=20, max_size=60))
def test_block_manager_random_operations(num_blocks, bs, num_cpu, caching, hbs_kind, ops):
    model = BlockManagerModel(num_blocks, bs, num_cpu, caching, hbs_kind)
    for name, *args in ops:
        getattr(model, name)(*args)
        model.consistent()
    model.teardown()


# ============================================================================ buddy allocator
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 100), st.lists(st.tuples(st.booleans(), st.integers(1, 64)), max_size=40))
def test_buddy_allocator_random_operations(capacity, ops):
    b = BuddyAllocator(capacity)
    live: dict[int, int] = {}
    for alloc, x in ops:
        if alloc or not live:
            want = 1 << (x - 1).bit_length()
            fits = b.can_allocate(x)
            off = b.allocate(x)
            assert (off is not None) == fits
            if off is not None:
                assert off % want == 0, "chunks are aligned to their size"
                assert all(off + want <= o or o + s <= off for o, s in live.items()), "overlap"
                live[off] = want
        else:
            off = sorted(live)[x % len(live)]
            b.free(off)
            del live[off]
        b.check_invariants()
        assert b.num_free == capacity - sum(live.values())
    for off in list(live):
        b.free(off)
    assert b.free_chunks() == b.roots   # everything merged back into the roots


# ============================================================================ schedulers
@st.composite
def workloads(draw, policy: str):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    # vllm gets smaller caches (preemption); a contiguous cache that small would reject nearly everything
    num_blocks = max(2, draw(st.integers(8, 120) if policy == "vllm" else st.integers(48, 400)) // bs)
    kw: dict = {"max_num_seqs": draw(st.integers(1, 10)),
                "max_num_batched_tokens": max(bs, draw(st.sampled_from(
                    [1, 12, 24, 48, 256] if policy == "vllm" else [24, 48, 256, 256])))}
    if policy == "vllm":
        kw["chunked_prefill"] = draw(st.booleans())
        kw["prefix_caching"] = draw(st.booleans())
        kw["watermark"] = draw(st.sampled_from([0.0, 0.01, 0.1]))
        if draw(st.booleans()) and not kw["chunked_prefill"]:
            kw["preemption"] = "swap"
        if kw.get("preemption") == "swap" or draw(st.booleans()):
            kw["num_cpu_blocks"] = draw(st.integers(1, 48))
    reqs = []
    t = 0.0
    for i in range(draw(st.integers(2, 10))):
        t += draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.5]))
        prompt = draw(st.integers(1, 40))
        out = draw(st.integers(1, 16))
        kind = draw(st.sampled_from(["one", "one", "one", "n", "beam"]))
        width = 1 if kind == "one" else draw(st.integers(2, 3))
        ids = None
        if draw(st.booleans()):
            ids = PREFIXES[draw(st.integers(0, 2))][:prompt]
            ids = ids + [0] * (prompt - len(ids))
        extra = draw(st.sampled_from([0, 0, 4]))
        reqs.append(req(i, prompt, out, t, ids=ids, max_tokens=out + extra,
                        **({kind: width} if width > 1 else {})))
    if policy == "vllm":   # keep clear of the known vllm_scheduler bugs (see the module docstring)
        widths = [r.sampling.width for r in reqs]
        if max(widths) > 1:
            kw["max_num_seqs"] = max(kw["max_num_seqs"], sum(widths))
            kw["max_num_batched_tokens"] = max(kw["max_num_batched_tokens"], max(widths))
    return bs, num_blocks, kw, reqs, draw(st.integers(0, 3))


def _plan_checks(sched: Scheduler, plan: StepPlan) -> None:
    assert len(plan.seqs) <= sched.max_num_seqs, f"{len(plan.seqs)} sequences > max_num_seqs"
    tokens = sum(s.num_new_tokens for s in plan.seqs)
    assert tokens <= sched.max_num_batched_tokens, f"{tokens} tokens > max_num_batched_tokens"
    assert len({s.seq_id for s in plan.seqs}) == len(plan.seqs), "a sequence scheduled twice"
    assert not {g for g, _ in plan.preempted} & {s.group_id for s in plan.seqs}, "a preempted group runs"
    bm = getattr(sched, "bm", None)
    written: set[tuple[int, int]] = set()
    readers: dict[int, int] = {}   # block -> sequences in this plan reading it as a computed prefix
    for s in plan.seqs:
        if bm is not None:
            for b in s.block_table[:s.start // sched.block_size]:
                readers[b] = readers.get(b, 0) + 1
    for s in plan.seqs:
        assert s.num_new_tokens >= 1
        seq = sched.seqs[s.seq_id]
        assert s.start == seq.num_computed and s.start + s.num_new_tokens <= seq.num_tokens
        assert s.samples == (s.start + s.num_new_tokens == seq.num_tokens)
        bs = sched.block_size
        assert len(s.block_table) * bs >= s.start + s.num_new_tokens, "block table too short"
        if bm is None:
            continue
        assert list(s.block_table) == bm.block_table(s.seq_id)
        assert len(s.block_table) == -(-(s.start + s.num_new_tokens) // bs)
        end = s.start + s.num_new_tokens
        for p in range(s.start, end):   # writes go to unshared blocks only...
            b = s.block_table[p // bs]
            blk = bm.pool.blocks[b]
            if blk.ref_count > 1:
                # ...except a full block this step computes and names (prefix caching) that a group
                # admitted later in the same step already maps as cached: the executor must store
                # each layer's new keys and values before that layer's attention (as vLLM does)
                assert blk.hash is not None and end >= (p // bs + 1) * bs, \
                    f"seq {s.seq_id} writes shared block {b}"
                assert blk.ref_count == 1 + readers.get(b, 0), f"block {b} shared beyond this step's hits"
            assert (b, p % bs) not in written, f"two sequences write slot {p % bs} of block {b}"
            written.add((b, p % bs))
    if bm is not None:
        bm.check_invariants()
        for src, dst in plan.copies:   # a copy's destination is fresh (or hit this step, as above)
            assert bm.pool.blocks[dst].ref_count == 1 + readers.get(dst, 0)
            assert src != dst


def _run_workload(policy: str, case) -> None:
    bs, num_blocks, kw, reqs, seed = case
    sched = make_scheduler(policy, num_blocks, bs, **kw)
    total = num_blocks * bs

    def after(s, plan, result):
        m = s.memory()
        assert m.total == total and min(m.token_states, m.reserved, m.internal_frag, m.external_frag,
                                        m.free) >= 0, m

    run = run_to_completion(sched, reqs, seed=seed, vary_children=True, check=_plan_checks, after=after,
                            keep_plans=False)
    for kind in ("recompute", "restart", "swap"):
        if any(m == kind for _, _, m in run.preemptions()):
            event(f"preemption by {kind}")
    if len(run.rejections()) * 2 > len(reqs):
        event("most requests rejected")
    sched.check_conservation()   # every request finished or rejected, exactly once
    assert len(sched.done) == len(reqs) and not sched.seqs
    rejected = {g.group_id for g in sched.done if g.rejected is not None}
    for g in sched.done:
        if g.rejected is None:
            assert g.output_len == g.request.max_output or g.request.sampling.beam_width > 1 \
                or g.request.sampling.n > 1
            assert g.finish_time is not None and g.first_token_time is not None
    # FCFS: first admissions follow arrival order
    key = {r.request_id: (r.arrival, r.request_id) for r in reqs}
    assert run.admission_order == sorted(run.admission_order, key=key.__getitem__)
    assert set(run.admission_order) | rejected == set(key)
    if policy == "vllm":
        sched.bm.assert_empty()
    elif policy == "static":
        assert sched.memory().free == total and not sched.regions
    else:
        assert sched.alloc.buddy.num_free == sched.alloc.buddy.capacity and not sched.regions
        sched.check_invariants()


def _make_test(policy: str, examples: int):
    @settings(max_examples=fuzz_examples(examples), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=workloads(policy))
    def test(case):
        _run_workload(policy, case)

    test.__name__ = f"test_random_workloads_{policy.replace('-', '_')}"
    return test


test_random_workloads_vllm = _make_test("vllm", 400)
test_random_workloads_orca_max = _make_test("orca-max", 100)
test_random_workloads_orca_pow2 = _make_test("orca-pow2", 80)
test_random_workloads_orca_oracle = _make_test("orca-oracle", 80)
test_random_workloads_static = _make_test("static", 100)
assert set(POLICIES) == {"vllm", "orca-max", "orca-pow2", "orca-oracle", "static", "priority", "sjf", "srpt", "vtc", "edf"}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(num_blocks=st.integers(4, 24), bs=st.integers(1, 4),
       prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20)), min_size=1, max_size=12))
def test_cached_prefix_query_predicts_admission_and_changes_nothing(num_blocks, bs, prompts):
    """`cached_prefix_blocks` (what a cache-aware router asks) is a pure query, and the cached
    blocks an admission right after it maps are exactly the ones it counted."""
    bm = PagedBlockManager(num_blocks, bs, enable_prefix_caching=True)
    seq_ids = iter(range(10**6))
    live: list[Sequence] = []
    for i, (prefix, n) in enumerate(prompts):
        ids = [100 + prefix] * 8 + list(range(n))  # four prefixes of 8 tokens, then private tokens
        r = Request(i, 0.0, len(ids), SamplingParams(max_tokens=1), prompt_token_ids=ids)
        before = (dict(bm.pool.cached), bm.num_free_blocks, bm.prefix_hits, bm.prefix_queries)
        predicted = bm.cached_prefix_blocks(r)
        assert (dict(bm.pool.cached), bm.num_free_blocks, bm.prefix_hits, bm.prefix_queries) == before
        bm.check_invariants()
        seq = SequenceGroup(r, next(seq_ids)).seqs[0]
        if bm.can_allocate(seq.group) != AllocStatus.OK:
            if live:  # make room: free the oldest (its full blocks stay cached until evicted)
                bm.free(live.pop(0))
            continue
        cached = bm.allocate(seq)  # as the vllm scheduler admits: map the cached prefix, then the rest
        assert cached == predicted * bs
        seq.num_computed = cached
        if bm.append_slots(seq, seq.num_tokens - cached) is None:
            bm.free(seq)
            continue
        seq.num_computed = seq.num_tokens
        live.append(seq)
    for s in live:
        bm.free(s)
    bm.check_invariants()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(num_blocks=st.integers(2, 20), bs=st.integers(1, 4),
       prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30)), min_size=1, max_size=10))
def test_injected_prefix_is_found_by_the_next_admission(num_blocks, bs, prompts):
    """A transferred prompt's KV (`inject_prefix`) is what `cached_prefix_blocks` then finds, up to
    what the cache can hold; nothing is left in use and the invariants hold."""
    bm = PagedBlockManager(num_blocks, bs, enable_prefix_caching=True)
    for i, (prefix, n) in enumerate(prompts):
        ids = [100 + prefix] * 6 + [i] * n
        r = Request(i, 0.0, len(ids), SamplingParams(max_tokens=1), prompt_token_ids=ids)
        injected = bm.inject_prefix(r)
        assert injected == min((len(ids) - 1) // bs, num_blocks)
        assert bm.cached_prefix_blocks(r) == injected
        assert bm.num_free_blocks == num_blocks  # cached but idle: every block still free to take
        bm.check_invariants()
    bm.assert_empty()


@settings(max_examples=80, deadline=None, derandomize=True)
@given(bs=st.integers(1, 5), contexts=st.lists(st.integers(1, 40), min_size=1, max_size=6), k=st.integers(1, 12))
def test_bulk_decodes_leave_the_state_of_k_stepped_decodes(bs, contexts, k):
    """Skip-ahead's bulk path (open the blocks in stepping's order, count the token states, settle)
    ends in exactly the state k single-token append_slots calls per sequence reach."""
    def start():
        bm = PagedBlockManager(sum(-(-(c + k) // bs) for c in contexts), bs)
        seqs = []
        for i, c in enumerate(contexts):
            g = SequenceGroup(Request(i, 0.0, c, SamplingParams(max_tokens=k + 1, ignore_eos=True)), i)
            s = g.seqs[0]
            bm.allocate(s)
            assert bm.append_slots(s, c) is not None
            s.num_computed = c
            seqs.append(s)
        return bm, seqs

    stepped, seqs_a = start()
    for _ in range(k):  # batch order within a step, as the scheduler appends
        for s in seqs_a:
            assert stepped.append_slots(s, 1) == []
            s.num_computed += 1
    bulk, seqs_b = start()
    # the sequences that open a block at step j, in batch order: stepping's take order
    bulk.open_decode_blocks(s.seq_id for j in range(k) for s in seqs_b if (s.num_computed + j) % bs == 0)
    bulk.add_token_states(k * len(seqs_b))
    bulk.settle_decodes(seqs_b, k)
    for s in seqs_b:
        s.num_computed += k
    assert bulk.tables == stepped.tables and bulk.slots == stepped.slots
    assert [b.filled for b in bulk.pool.blocks] == [b.filled for b in stepped.pool.blocks]
    assert bulk.memory() == stepped.memory()
    bulk.check_invariants()
