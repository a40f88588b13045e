"""Baselines that reserve contiguous KV memory per request (the vLLM paper's comparisons).

- `OrcaScheduler`: iteration-level batching (Orca) over a `ContiguousAllocator`; a request is
  admitted only when its whole reservation fits, so it never needs preemption.
- `StaticScheduler`: request-level batching (FasterTransformer): a batch is formed when the
  previous one has completely finished, as large as fits in memory with every request padded to
  the batch's longest prompt plus max output; finished requests leave the batch but their slots
  stay idle until the whole batch ends. (FT would also keep computing their padding; leaving it
  out makes this baseline slightly optimistic.)

Forked sequences (n > 1, beam search) cannot share memory here: a group reserves one chunk per
sequence up front, and a fork copies the parent's blocks into a spare chunk (copies are issued
with the next plan).
"""

from __future__ import annotations

from policies.block_manager import AllocStatus
from policies.buddy import next_pow2
from policies.contiguous import ContiguousAllocator
from policies.memory import MemoryBreakdown
from policies.plan import ScheduledSeq, StepPlan, StepResult
from policies.request import Sequence, SequenceGroup
from policies.scheduler import Scheduler


class _ReservingScheduler(Scheduler):
    """Shared mechanics: per-sequence regions (block ranges), spare regions for forks, and the
    scheduling of every running sequence's next tokens."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                 max_model_len: int | None = None) -> None:
        super().__init__(max_num_seqs, max_num_batched_tokens, block_size, max_model_len)
        self.regions: dict[int, range] = {}          # seq id -> its blocks
        self.spares: dict[int, list[range]] = {}     # group id -> unused regions for future forks
        self._pending_copies: list[tuple[int, int]] = []

    def _fork_seq(self, parent: Sequence, child: Sequence) -> None:
        spare = self.spares[parent.group.group_id].pop()
        self.regions[child.seq_id] = spare
        used = -(-parent.num_computed // self.block_size)
        src = self.regions[parent.seq_id]
        self._pending_copies.extend((src[i], spare[i]) for i in range(used))

    def _free_seq(self, seq: Sequence) -> None:
        region = self.regions.pop(seq.seq_id)
        spares = self.spares[seq.group.group_id]
        spares.append(region)
        if not seq.group.seqs or seq.group.seqs == [seq]:  # the group's last sequence
            self._release_group(seq.group)

    def _release_group(self, group: SequenceGroup) -> None:
        """Give the group's memory back (subclasses)."""
        self.spares.pop(group.group_id, None)

    def _schedule_running(self, plan: StepPlan, budget: int | None) -> int:
        """Schedule every running group's next tokens, whole groups only (a beam group advances in
        lockstep), skipping groups that do not fit in the remaining token `budget`."""
        out = plan.seqs
        regions = self.regions
        for group in self.running:
            seqs = group.seqs
            gid = group.group_id
            if len(seqs) == 1:  # the common case, kept lean
                seq = seqs[0]
                start = seq.num_computed
                n = seq.prompt_len + seq.output_len - start
                if budget is not None:
                    if n > budget:
                        continue
                    budget -= n
                out.append(ScheduledSeq(seq.seq_id, gid, start, n, regions[seq.seq_id], True, seq))
                continue
            if budget is not None:
                need = sum(s.num_tokens - s.num_computed for s in seqs)
                if need > budget:
                    continue
                budget -= need
            for seq in seqs:
                out.append(ScheduledSeq(seq.seq_id, gid, seq.num_computed, seq.num_tokens - seq.num_computed,
                                        regions[seq.seq_id], True, seq))
        return budget if budget is not None else 0

    def _too_wide(self, group: SequenceGroup, plan: StepPlan, now: float) -> bool:
        """Reject (True) the queue's head if it is wider than a whole iteration can hold: its
        sequences decode together, one token each."""
        width = group.request.sampling.width
        if width <= self.max_num_seqs and width <= self.max_num_batched_tokens:
            return False
        self.waiting.popleft()
        self._reject(group, f"needs {width} sequences at once but max_num_seqs={self.max_num_seqs} and "
                            f"max_num_batched_tokens={self.max_num_batched_tokens}", plan, now)
        return True

    def _new_plan(self) -> StepPlan:
        plan = StepPlan(block_size=self.block_size)
        plan.copies, self._pending_copies = self._pending_copies, []
        return plan


class OrcaScheduler(_ReservingScheduler):
    name = "orca"

    def __init__(self, num_slots: int, variant: str = "max", block_size: int = 1,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 max_model_len: int | None = None) -> None:
        super().__init__(max_num_seqs, max_num_batched_tokens, block_size, max_model_len)
        self.alloc = ContiguousAllocator(num_slots, variant, block_size)
        self.name = f"orca-{variant}"
        self._offsets: dict[int, list[int]] = {}  # group id -> buddy offsets it holds

    def schedule(self, now: float) -> StepPlan:
        plan = self._new_plan()
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        if not self.waiting:
            return plan
        demand = sum(self.seq_demand(g) for g in self.running)
        while self.waiting:
            group = self.waiting[0]
            status = self.alloc.can_allocate(group)
            width = group.request.sampling.width
            if status is AllocStatus.NEVER:
                self.waiting.popleft()
                units = next_pow2(-(-self.alloc.reservation(group) // self.block_size))
                fits = self.alloc.buddy.capacity // units
                self._reject(group, f"reservation of {width} x {self.alloc.reservation(group)} slots does not fit: "
                                    f"the cache places at most {fits} chunk(s) of {units * self.block_size} slots "
                                    f"(largest chunk {self.alloc.buddy.max_chunk * self.block_size})", plan, now)
                continue
            if self._too_wide(group, plan, now):
                continue
            n = group.request.prompt_len
            if n > self.max_num_batched_tokens:
                self.waiting.popleft()
                self._reject(group, f"prompt of {n} tokens exceeds max_num_batched_tokens="
                                    f"{self.max_num_batched_tokens}", plan, now)
                continue
            if status is AllocStatus.LATER or n > budget or demand + width > self.max_num_seqs:
                break
            self.waiting.popleft()
            self._admit(group)
            demand += width
            group.first_scheduled = now
            seq = group.seqs[0]
            plan.seqs.append(ScheduledSeq(seq.seq_id, group.group_id, 0, n, self.regions[seq.seq_id], True, seq))
            budget -= n
        return plan

    def _admit(self, group: SequenceGroup) -> None:
        slots = self.alloc.reservation(group)
        regions = []
        offsets = []
        for _ in range(group.request.sampling.width):
            off = self.alloc.buddy.allocate(-(-slots // self.block_size))
            assert off is not None, "can_allocate said OK"
            offsets.append(off)
            regions.append(range(off, off + -(-slots // self.block_size)))
        self._offsets[group.group_id] = offsets
        self.regions[group.seqs[0].seq_id] = regions.pop(0)
        self.spares[group.group_id] = regions
        self._insert_running(group)

    def _release_group(self, group: SequenceGroup) -> None:
        super()._release_group(group)
        for off in self._offsets.pop(group.group_id, ()):
            self.alloc.buddy.free(off)

    def memory(self) -> MemoryBreakdown:
        bs = self.block_size
        states = reserved = internal = 0
        for group in self.running:
            slots = self.alloc.reservation(group)
            true_out = group.request.output_len
            eventual = slots if true_out is None else min(slots, group.request.prompt_len + true_out)
            chunk = self.alloc.buddy.allocated[self._offsets[group.group_id][0]] * bs
            for seq in group.seqs:
                used = min(seq.num_computed, slots)
                states += used
                reserved += max(eventual - used, 0)
                internal += chunk - max(eventual, used)
            for _ in self.spares.get(group.group_id, ()):
                reserved += eventual
                internal += chunk - eventual
        external = 0
        if self.waiting:
            want = next_pow2(-(-self.alloc.reservation(self.waiting[0]) // bs))
            if self.alloc.buddy.largest_free() < want:
                external = sum(s for _, s in self.alloc.buddy.free_chunks() if s < want) * bs
        free = self.alloc.buddy.num_free * bs - external
        return MemoryBreakdown(states, reserved, internal, external, free)

    def check_invariants(self) -> None:
        self.alloc.buddy.check_invariants()
        held = sum(len(v) for v in self._offsets.values())
        assert held == len(self.alloc.buddy.allocated), "buddy chunks not owned by any group"


class StaticScheduler(_ReservingScheduler):
    name = "static"

    def __init__(self, num_slots: int, block_size: int = 1, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 4096, max_model_len: int | None = None) -> None:
        super().__init__(max_num_seqs, max_num_batched_tokens, block_size, max_model_len)
        if num_slots < block_size:
            raise ValueError(f"num_slots must be >= block_size ({block_size}), got {num_slots}")
        self.num_blocks = num_slots // block_size
        self.batch_len = 0       # padded slots per sequence in the current batch
        self.batch_blocks = 0    # blocks the current batch occupies

    def _padded(self, groups: list[SequenceGroup]) -> tuple[int, int]:
        length = max(g.request.prompt_len for g in groups) + max(g.request.sampling.max_tokens for g in groups)
        blocks = -(-length // self.block_size)
        return length, blocks * sum(g.request.sampling.width for g in groups)

    def schedule(self, now: float) -> StepPlan:
        plan = self._new_plan()
        if not self.running:
            self._form_batch(plan, now)
        self._schedule_running(plan, None)
        return plan

    def on_step_done(self, plan: StepPlan, result: StepResult, now: float) -> list[SequenceGroup]:
        finished = super().on_step_done(plan, result, now)
        if not self.running:  # the batch is over: its memory is free
            self.batch_len = self.batch_blocks = 0
        return finished

    def _form_batch(self, plan: StepPlan, now: float) -> None:
        """The largest FCFS batch that fits: padded memory within the cache, at most max_num_seqs
        sequences, and its prefill (all prompts, or one token per sequence) within
        max_num_batched_tokens."""
        batch: list[SequenceGroup] = []
        width = tokens = 0
        while self.waiting:
            group = self.waiting[0]
            _, alone = self._padded([group])
            if alone > self.num_blocks:
                self.waiting.popleft()
                self._reject(group, f"padded reservation of {alone * self.block_size} slots exceeds the "
                                    f"cache ({self.num_blocks * self.block_size} slots)", plan, now)
                continue
            if self._too_wide(group, plan, now):
                continue
            if group.request.prompt_len > self.max_num_batched_tokens:
                self.waiting.popleft()
                self._reject(group, f"prompt of {group.request.prompt_len} tokens exceeds max_num_batched_tokens="
                                    f"{self.max_num_batched_tokens}", plan, now)
                continue
            _, blocks = self._padded(batch + [group])
            w = width + group.request.sampling.width
            t = tokens + group.request.prompt_len
            if blocks > self.num_blocks or w > self.max_num_seqs or max(t, w) > self.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            width, tokens = w, t
        if not batch:
            return
        self.batch_len, self.batch_blocks = self._padded(batch)
        per_seq = self.batch_blocks // sum(g.request.sampling.width for g in batch)
        nxt = 0
        for group in batch:
            regions = []
            for _ in range(group.request.sampling.width):
                regions.append(range(nxt, nxt + per_seq))
                nxt += per_seq
            self.regions[group.seqs[0].seq_id] = regions.pop(0)
            self.spares[group.group_id] = regions
            group.first_scheduled = now
            self._insert_running(group)

    def memory(self) -> MemoryBreakdown:
        bs = self.block_size
        states = reserved = 0
        for group in self.running:
            eventual = group.request.prompt_len + group.request.max_output
            for seq in group.seqs:
                states += seq.num_computed
                reserved += max(eventual - seq.num_computed, 0)
        allocated = self.batch_blocks * bs
        internal = max(allocated - states - reserved, 0)
        return MemoryBreakdown(states, reserved, internal, 0, self.num_blocks * bs - allocated)
