"""The paged scheduler's running batch, kept incrementally for skip-ahead (issue 23).

A plain decoder is a running group of one sequence whose only uncomputed token is its last
sampled one (it computes exactly one token per iteration and owns its partly filled last block).
Such sequences join the batch (`join`) and are then moved on in bulk: the batch keeps a decode
`clock`, and a member's stored counters (num_computed, output_len, its slots and last block's fill
level) are those of the clock at its `anchor`; its true length is stored + clock - anchor.
`materialise` pays a member what it is owed (counters, token ids, blocks' fill levels) so that its
own fields are exact; `leave` does so and drops it; `materialise_all` pays every member, keeping
them members (what a reader outside the scheduler is handed, at an iteration boundary). A member's
`batch` is this batch, so its exact reads (`Sequence.exact_output_len`, ...) add what it is owed;
`guard_reads` (--debug) makes reads of owed fields from outside the scheduler raise
(policies/exact_reads.py). Every member's blocks are in its table already
(a window opens them as stepping would), and the pool's token-state count is kept exact by the
caller, so only the per-sequence fields are owed.

Prefix caching: stepping names each full block as it fills (PagedBlockManager.append_slots); a
member's blocks filled while it was owed are named when it is materialised, in one go. That is the
same cache: what a member's decode fills is its own output, at positions its lineage never reached
before (a recomputed sequence refills its earlier blocks stepped, as a prefill), so its hash is new
(registering it cannot fail, then or later) and only the member itself could look it up, which it
does only after leaving; and nothing reads a block's hash while the block is in use.

Kept as the batch changes (never recomputed by walking it):
- `size`, the members' context sum (`context()`: base + size * clock) and their seat demand;
- the members by block residue: a member whose true count is c sits in bucket (c - clock) % bs,
  which a decode step leaves unchanged; the bucket of -(clock + r) % bs opens a block in r + 1,
  r + 1 + bs, ... decode steps (`opening_bucket(r)`, `open_within`), and `counts` holds
  each bucket's size;
- the finish heap: `_Finish` entries (the clock at which a member samples its last token, seq id, sequence), with
  lazy deletion (an entry is live while its sequence is a member with that finish), for members
  whose remaining count the executor has told (`set_finish`); the others are `unknown`.

A member's block table is its own (`Sequence.block_table`, the block manager's list): a window
opens blocks and a member settles without a lookup by seq id.

Invariants (`check`): every member has anchor >= 0 and is in exactly one bucket; bucket sizes
sum to size; base is the sum over members of (stored
num_computed - anchor); a member's stored num_computed equals its slots in the block manager (owed
together).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from heapq import heappop, heappush  # module globals: `heapq.x` is a generic attribute read compiled

from policies.block_manager import PagedBlockManager, table_of
from policies.exact_reads import GUARDED, guard
from policies.request import Sequence, SequenceGroup


class _Finish:
    """A finish heap entry: `seq` samples its last token at the batch's clock `at` (live while
    `seq` is a member with that finish: lazy deletion). Ordered by (at, seq id), which heapq
    compares: compiled, a native comparison (a tuple's compares its items generically); equal keys
    are the same sequence (seq ids are unique)."""

    __slots__ = ("at", "seq", "seq_id")

    def __init__(self, at: int, seq_id: int, seq: Sequence) -> None:
        self.at = at
        self.seq_id = seq_id
        self.seq = seq

    def __lt__(self, other: _Finish) -> bool:
        return self.at < other.at or (self.at == other.at and self.seq_id < other.seq_id)


class RunningBatch:
    """Plain decoding sequences of one replica moved on by a shared decode clock (see module)."""

    def __init__(self, bm: PagedBlockManager, demand_of: Callable[[SequenceGroup], int]) -> None:
        self.bm = bm
        self.bs = bm.block_size
        self.demand_of = demand_of
        self.clock = 0
        self.size = 0
        self.base = 0     # sum over members of (stored num_computed - anchor)
        self.demand = 0   # the members' groups' seq_demand
        self.buckets: list[list[Sequence]] = [[] for _ in range(self.bs)]
        self.counts = [0] * self.bs  # len(buckets[q]), kept so that windows read no list sizes
        self.heap: list[_Finish] = []
        self.unknown: list[Sequence] = []  # members whose finish the executor has not told yet
        self.exact_at = 0       # the clock at the last materialise_all (every member exact while equal)
        self.guarded = False    # --debug: members' owed fields check their readers (guard_reads)

    # ---------------------------------------------------------------- membership
    def join(self, seq: Sequence) -> None:
        """Make a settled plain decoder a member anchored at the clock (finish unknown)."""
        c = seq.num_computed
        clock = self.clock
        seq.anchor = clock
        seq.finish_at = -1
        seq.batch = self
        if self.guarded:
            guard(seq)
        q = (c - clock) % self.bs
        self.buckets[q].append(seq)
        self.counts[q] += 1
        self.size += 1
        self.base += c - clock
        self.demand += self.demand_of(seq.group)
        self.unknown.append(seq)

    def materialise(self, seq: Sequence) -> None:
        """Pay a member its owed decode steps: its counters, token ids and blocks' fill levels
        become exact; its anchor moves to the clock."""
        k = self.clock - seq.anchor
        if k:
            self.bm.settle_decode(seq, table_of(seq), k)
            seq.num_computed += k
            seq.output_len += k
            seq.cum_logprob = 0.0  # as on_step_done: simulated tokens have no log-probability
            if seq.token_ids is not None:
                seq.token_ids.extend([-1] * k)
            seq.anchor = self.clock
            if self.bm.enable_prefix_caching:  # the blocks filled meanwhile are named now (see module)
                self.bm.register_decoded(seq, seq.num_computed - k)

    def leave(self, seq: Sequence) -> None:
        """Materialise a member and drop it (it finishes, is preempted or stepped again)."""
        q = (seq.num_computed - seq.anchor) % self.bs  # its bucket (phase_of), unchanged by paying it
        self.materialise(seq)
        c = seq.num_computed
        self.buckets[q].remove(seq)
        self.counts[q] -= 1
        self.size -= 1
        self.base -= c - seq.anchor
        self.demand -= self.demand_of(seq.group)
        if seq.finish_at < 0:
            self.unknown.remove(seq)
        seq.anchor = seq.finish_at = -1
        seq.batch = None

    def materialise_all(self) -> None:
        """Pay every member what it is owed, keeping it a member (buckets, base and finishes are
        unchanged: a member's stored count less its anchor does not move). Only at an iteration
        boundary, where every member's table covers exactly the clock. O(1) when nothing is owed."""
        if self.exact_at != self.clock and self.size:
            for bucket in self.buckets:
                for s in bucket:
                    self.materialise(s)
        self.exact_at = self.clock

    def guard_reads(self) -> None:
        """--debug: from now on a read of a member's owed field from outside the scheduler raises
        (policies/exact_reads.py); said once when this build cannot check (the compiled kernel)."""
        if self.guarded:
            return
        self.guarded = all(guard(s) for b in self.buckets for s in b) and GUARDED is not None
        if not self.guarded and self.size:  # an empty batch (a run's final checks) has no read to miss
            warnings.warn("--debug: reads of running sequences' owed fields are not checked with the compiled "
                          "kernel (PAGESIM_COMPILED=0 runs the sources, which check them)", stacklevel=2)

    def release_all(self) -> None:
        """Materialise every member and empty the batch (a stepped iteration reads them all)."""
        for bucket in self.buckets:
            for s in bucket:
                self.materialise(s)
                s.anchor = s.finish_at = -1
                s.batch = None
            bucket.clear()
        self.size = self.base = self.demand = 0
        self.counts = [0] * self.bs
        self.heap.clear()
        self.unknown.clear()

    # ---------------------------------------------------------------- finishes
    def set_finishes(self, seqs: list[Sequence], remaining: list[int]) -> None:
        """The executor's remaining counts (tokens each samples before it finishes, from the
        clock) for members whose finish was unknown."""
        clock = self.clock
        for i in range(len(seqs)):  # by index: zip is a generic iterator compiled
            s = seqs[i]
            if s.anchor >= 0 and s.finish_at < 0:
                s.finish_at = at = clock + remaining[i]
                heappush(self.heap, _Finish(at, s.seq_id, s))
        self.unknown = [s for s in self.unknown if s.finish_at < 0]

    def first_finish(self) -> float:
        """Decode steps from the clock to the earliest known finish (inf when none is known)."""
        heap = self.heap
        while heap:
            top = heap[0]
            s = top.seq
            if s.anchor >= 0 and s.finish_at == top.at:
                return top.at - self.clock
            heappop(heap)  # stale: its sequence left, or finishes at another time now
        return math.inf

    def finishing(self, ahead: int = 0) -> list[Sequence]:
        """The members whose last token is the one computed at the clock + `ahead` (in heap
        order); each still a member (the caller orders them and lets them leave)."""
        heap, clock = self.heap, self.clock + ahead
        out: list[Sequence] = []
        while heap and heap[0].at <= clock:
            entry: _Finish = heappop(heap)
            s = entry.seq
            if s.anchor >= 0 and s.finish_at == entry.at and s not in out:
                out.append(s)
        return out

    # ---------------------------------------------------------------- reads for windows
    def context(self) -> int:
        """The members' computed tokens, summed (true counts)."""
        return self.base + self.size * self.clock

    def opening_bucket(self, steps: int = 0) -> list[Sequence]:
        """The members that open a block in the decode step `steps` + 1 from the clock (their
        true count is then a multiple of the block size)."""
        return self.buckets[-(self.clock + steps) % self.bs]

    def opening_tables(self, steps: int = 0) -> list[list[int]]:
        """The tables of `opening_bucket(steps)`, in its order (the members' own lists)."""
        return [table_of(s) for s in self.buckets[-(self.clock + steps) % self.bs]]

    def open_within(self, k: int) -> None:
        """Open the blocks of the next `k` decode steps (the caller has counted them against the
        free blocks): each member opening a block in a step gets one, step 1's bucket first, each
        in bucket order (the order stepping takes them), also over more than one cycle of the
        block size. The ids are taken at once and appended to the members' own tables."""
        bs, counts, buckets = self.bs, self.counts, self.buckets
        first = -self.clock % bs  # step j + 1 opens bucket -(clock + j) % bs: one down per step, wrapping
        n = k // bs * self.size  # every bs steps each member opens one
        q = first
        for _j in range(k % bs):
            n += counts[q]
            q = q - 1 if q else bs - 1
        ids = self.bm.take_opening_ids(n)
        i = 0
        q = first
        for _j in range(k):
            if counts[q]:
                for s in buckets[q]:
                    table_of(s).append(ids[i])
                    i += 1
            q = q - 1 if q else bs - 1

    def opening_in_order(self, groups: list[SequenceGroup], by_arrival: bool = False) -> list[Sequence]:
        """`opening_bucket()` in the order of `groups` (single-sequence groups, every one a
        member). `by_arrival`: `groups` is in (request arrival, group id) order (the scheduler's
        running order under FCFS), so the few in the bucket are sorted by that key; else one pass
        over `groups` picks them (a pointer comparison with each in the bucket, until all are
        found), where sorting the bucket by each group's position would search `groups` once per
        member."""
        bucket = self.buckets[-self.clock % self.bs]
        m = len(bucket)
        out = list(bucket)
        if m < 2:
            return out
        if by_arrival:  # an insertion sort of a handful (most buckets hold one or two)
            for i in range(1, m):
                s = out[i]
                arrival, gid = s.group.request.arrival, s.group.group_id
                j = i
                while j:
                    other = out[j - 1].group
                    a = other.request.arrival
                    if not (arrival < a or (arrival == a and gid < other.group_id)):
                        break
                    out[j] = out[j - 1]
                    j -= 1
                out[j] = s
            return out
        out = []
        for g in groups:
            s = g.seqs[0]
            for b in bucket:
                if b is s:
                    out.append(s)
                    break
            if len(out) == m:
                break
        return out

    def phase_of(self, seq: Sequence) -> int:
        """The residue bucket of a member."""
        return (seq.num_computed - seq.anchor) % self.bs

    # ---------------------------------------------------------------- checks
    def check(self, members: list[Sequence]) -> dict[int, int]:
        """Raise AssertionError unless the kept figures match the members (`members`: every
        running sequence that should be one); returns each member's owed decode steps by seq id
        (what the block manager's own check must add to its slots and fill levels)."""
        seen = [s for b in self.buckets for s in b]
        assert len(seen) == self.size == len(set(map(id, seen))), "running batch: bucket sizes != size"
        assert self.counts == [len(b) for b in self.buckets], "running batch: bucket counts drifted"
        assert {id(s) for s in seen} == {id(s) for s in members}, "running batch: members differ from the running ones"
        assert sum(s.num_computed - s.anchor for s in seen) == self.base, "running batch: context base drifted"
        assert sum(self.demand_of(s.group) for s in seen) == self.demand, "running batch: seat demand drifted"
        for q, b in enumerate(self.buckets):
            for s in b:
                assert 0 <= s.anchor <= self.clock and self.phase_of(s) == q, f"sequence {s.seq_id}: wrong bucket"
                assert s.num_slots == s.num_computed, f"sequence {s.seq_id}: slots not owed with counters"
                assert s.finish_at < 0 or s.finish_at > self.clock, f"sequence {s.seq_id}: finish passed"
        for s in self.unknown:
            assert s.anchor == self.clock and s.finish_at < 0, f"sequence {s.seq_id}: finish asked at another clock"
        return {s.seq_id: self.clock - s.anchor for s in seen}
