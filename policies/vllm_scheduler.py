"""vLLM's scheduler on the paged block manager: iteration-level FCFS with preemption.

One token-budget rule covers everything: each iteration, running groups first (in arrival order),
then swapped groups, then waiting ones, each taking the tokens it needs (one per decoding
sequence; a prompt, a recompute, or with chunked prefill a piece of one) while the budgets
`max_num_seqs` and `max_num_batched_tokens` and the free blocks allow. When a running group cannot
get its blocks, the most recently arrived running group is preempted, whole: by `recompute` (its
blocks are freed and its tokens recomputed later) or by `swap` (its blocks move to the CPU pool;
nothing new is admitted while any group is swapped out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from mypy_extensions import mypyc_attr

from policies.block_manager import PagedBlockManager, table_of
from policies.memory import MemoryBreakdown
from policies.plan import (
    DecodeStepPlan,
    DecodeStepResult,
    RepeatPlan,
    RepeatResult,
    ScheduledSeq,
    StepComposition,
    StepPlan,
    StepResult,
)
from policies.queue_policy import ADMIT, DEFER, QueuePolicy
from policies.request import Request, SeqStatus, Sequence, SequenceGroup
from policies.running_batch import RunningBatch
from policies.scheduler import Scheduler, remove_group

PREEMPTION_MODES = ("recompute", "swap")

# what `_admission` answers for the waiting group considered first (Final: the compiled kernel
# inlines them, where a plain module global is a dict lookup at every use)
ADMITTED: Final = "admitted"
DEFERRED: Final = "deferred"
BLOCKED: Final = "blocked"
OVER_BUDGET: Final = "over budget"
REJECTED: Final = "rejected"


@dataclass(slots=True)
class Admission:
    """`_admission`'s answer: the verdict, the running sequences it counted (None: not needed),
    and by verdict the first chunk (ADMITTED), the prefix-cache hit (ADMITTED, OVER_BUDGET) or
    the reason (REJECTED)."""

    verdict: str
    demand: int | None
    chunk: int
    cached: int
    reason: str

    def __init__(self, verdict: str, demand: int | None, chunk: int = 0, cached: int = 0, reason: str = "") -> None:
        # written out, not generated (nor a NamedTuple, whose __new__ runs interpreted): the compiled
        # kernel builds one per admission question as a native object (see policies/plan.py)
        self.verdict = verdict
        self.demand = demand
        self.chunk = chunk
        self.cached = cached
        self.reason = reason


@mypyc_attr(allow_interpreted_subclasses=True)  # policies subclass it, when compiled (build_compiled.py)
class VllmScheduler(Scheduler):
    name = "vllm"

    def __init__(self, num_gpu_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 preemption: str = "recompute", chunked_prefill: bool = False,
                 prefix_caching: bool = False, watermark: float = 0.01,
                 policy: QueuePolicy | None = None, max_model_len: int | None = None) -> None:
        super().__init__(max_num_seqs, max_num_batched_tokens, block_size, max_model_len, policy=policy)
        if policy is not None:
            self.name = policy.name
        # the running tail is the victim unless the policy picks its own
        self._custom_victim = type(self.policy).victim is not QueuePolicy.victim
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}; got {preemption!r}")
        if preemption == "swap" and num_cpu_blocks < 1:
            raise ValueError("preemption='swap' needs num_cpu_blocks >= 1 (the CPU swap space)")
        self.preemption = preemption
        self.chunked_prefill = chunked_prefill
        self.bm = PagedBlockManager(num_gpu_blocks, block_size, num_cpu_blocks, watermark, prefix_caching)
        # the last plan_repeat's plan, its steps and exhausts as offered (until applied or stale)
        self._offer: tuple[RepeatPlan, int, bool] | None = None
        self._decode_offer: DecodeStepPlan | None = None  # the last plan_decode_step's offer
        # a decode step begun (apply_decode_step) whose end is not applied yet (complete_decode_step)
        self._decode_begun: DecodeStepResult | None = None
        # the plain decoders, moved on in bulk by skip-ahead, and the running groups not yet in it
        self._batch = RunningBatch(self.bm, self.seq_demand)
        self._loose: list[SequenceGroup] = []
        # the last group _never_fits judged and its answer (a function of the request and this
        # scheduler's fixed settings): a blocked waiting head is asked about at every iteration
        self._fits_memo: tuple[SequenceGroup, str | None] | None = None

    # ---------------------------------------------------------------- memory hooks
    def _free_seq(self, seq: Sequence) -> None:
        self.bm.free(seq)

    def _fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.bm.fork(parent, child)

    def memory(self) -> MemoryBreakdown:
        return self.bm.memory()

    def cached_prefix_tokens(self, request: Request) -> int:
        return self.bm.cached_prefix_blocks(request) * self.block_size

    @property
    def prefix_hits(self) -> int:
        return self.bm.prefix_hits

    def check_invariants(self) -> None:
        """The running batch's kept figures, conservation, and the block manager's invariants with
        the batch's owed decode steps counted in (nothing is settled: a debug run keeps the batch)."""
        self._batch.guard_reads()  # debug: from now on a stale read of a member raises
        owed = self._batch.check([g.seqs[0] for g in self.running if g.seqs and g.seqs[0].anchor >= 0])
        self.check_conservation()
        self.bm.check_invariants(owed)

    def refusal(self, request: Request) -> str | None:
        return self.refusal_on_arrival(request) or self._never_fits(SequenceGroup(request, -1))

    def _never_fits(self, group: SequenceGroup) -> str | None:
        """Why a waiting group can never run on this cache and budget (rejected when it comes up),
        or None: more blocks than the cache holds, more parallel sequences than the batch may hold,
        or an unchunkable prompt over the token budget."""
        memo = self._fits_memo
        if memo is not None and memo[0] is group:
            return memo[1]
        reason = self._never_fits_reason(group)
        self._fits_memo = (group, reason)
        return reason

    def _never_fits_reason(self, group: SequenceGroup) -> str | None:
        width = group.request.sampling.width
        if width > self.max_num_seqs or width > self.max_num_batched_tokens:
            return (f"{width} parallel sequences exceed max_num_seqs={self.max_num_seqs} or "
                    f"max_num_batched_tokens={self.max_num_batched_tokens}")
        need, have = self.bm.max_blocks_needed(group), self.capacity_tokens // self.block_size
        if need > have:
            return f"needs {need} blocks but the cache holds {have} (after the watermark)"
        req = group.request
        if not self.chunked_prefill and req.prompt_len > self.max_num_batched_tokens:
            return (f"prompt of {req.prompt_len} tokens exceeds max_num_batched_tokens="
                    f"{self.max_num_batched_tokens} and chunked prefill is off")
        return None

    @property
    def capacity_tokens(self) -> int:
        return (self.bm.num_gpu_blocks - self.bm.watermark_blocks) * self.block_size

    def assert_drained(self) -> None:
        self.check_conservation()
        self.bm.assert_empty()

    def inject_prefix(self, request: Request) -> int:
        """Hold the request's prompt KV as cached blocks (a transfer from another replica); see
        PagedBlockManager.inject_prefix."""
        return self.bm.inject_prefix(request)

    def abort(self, group_id: int, now: float, reason: str = "aborted") -> SequenceGroup | None:
        # the batch a plan describes may lose a group (the base settles the running batch first)
        return super().abort(group_id, now, reason)

    def block_usage(self) -> tuple[int, int]:
        """(logical blocks: the sum of every sequence's table length, physical blocks in use): what
        sharing saves is 1 - physical / logical."""
        bm = self.bm
        return sum(len(t) for t in bm.tables.values()), bm.num_gpu_blocks - bm.num_free_blocks

    # ---------------------------------------------------------------- scheduling
    def schedule(self, now: float) -> StepPlan:
        self.settle()  # the running set is about to change: every sequence exact, no offer stands
        plan = StepPlan(block_size=self.block_size)
        budget = [self.max_num_batched_tokens]
        preempted = self._schedule_running(plan, budget)
        if not preempted:
            self._schedule_swapped(plan, budget, now)
        if not preempted and not self.swapped:
            self._schedule_waiting(plan, budget, now)
        return plan

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = seq.num_tokens - seq.num_computed
        if n <= budget:
            return n
        return budget if self._chunkable(seq) else 0

    def _emit(self, plan: StepPlan, seq: Sequence, n: int) -> None:
        # the plan carries the block manager's own table lists: valid until the next schedule()
        plan.seqs.append(ScheduledSeq(seq.seq_id, seq.group.group_id, seq.num_computed, n,
                                      table_of(seq), seq.num_computed + n == seq.num_tokens, seq))

    def _schedule_running(self, plan: StepPlan, budget: list[int]) -> bool:
        """Give running groups their tokens, preempting from the tail when blocks run out."""
        preempted = False
        bm = self.bm
        blocks = bm.pool.blocks
        bs = self.block_size
        in_place = not bm.enable_prefix_caching  # else a filled block may need registering
        emit = plan.seqs.append
        running = self.running  # _preempt removes from this very list (the iterator sees that)
        left = budget[0]  # a local while the loop runs: nothing it calls reads the budget
        for group in running:
            seqs = group.seqs
            if len(seqs) == 1:  # the common case, kept lean
                seq = seqs[0]
                start = seq.num_computed
                known = seq.prompt_len + seq.output_len
                n = known - start
                if n > left:
                    n = left if self._chunkable(seq) else 0
                if n == 0:
                    continue
                sid = seq.seq_id
                table = table_of(seq)
                cur = seq.num_slots
                end = start + n
                if in_place and cur % bs and cur < end <= len(table) * bs and blocks[table[-1]].ref_count == 1:
                    # a decode into the sequence's own partly filled block: append_slots' first
                    # case, checked here as it is most of the work of a step
                    bm.extend_own_block(seq, end, cur, table)
                else:
                    while True:
                        copies = bm.append_slots(seq, n)
                        if copies is not None:
                            break
                        preempted = True
                        if self._preempt(self._victim(), plan) is group:
                            break
                    if copies is None:
                        break
                    if copies:
                        plan.copies.extend(copies)
                left -= n
                emit(ScheduledSeq(sid, group.group_id, start, n, table, end == known, seq))
                continue
            chunks = [self._chunk(s, left) for s in seqs]
            if sum(chunks) > left or 0 in chunks:
                continue
            while sum(bm.can_append(s, n) for s, n in zip(seqs, chunks)) > bm.num_free_blocks:
                preempted = True
                if self._preempt(self._victim(), plan) is group:
                    break
            if group.status != SeqStatus.RUNNING:
                break
            for s, n in zip(seqs, chunks):
                plan.copies.extend(bm.append_slots(s, n))  # type: ignore[arg-type]  # None: not here
                self._emit(plan, s, n)
            left -= sum(chunks)
        budget[0] = left
        return preempted

    def _victim(self) -> SequenceGroup:
        return self.policy.victim(self.running) if self._custom_victim else self.running[-1]

    def _preempt(self, group: SequenceGroup, plan: StepPlan) -> SequenceGroup:
        """Preempt a whole group. Swap keeps a forked group's sharing; without room in the CPU pool
        a single sequence is recomputed, and a forked group restarts from its prompt (mode
        "restart"), as vLLM cannot recompute forked groups either."""
        remove_group(self.running, group)
        group.num_preemptions += 1
        self.num_preemptions += 1
        mode = self.preemption
        if len(group.seqs) > 1 and self.bm.cpu.num_blocks:
            mode = "swap"
        if mode == "swap" and not self.bm.can_swap_out(group):
            mode = "recompute"
        if mode == "recompute" and (len(group.seqs) > 1 or group.finished_seqs):
            mode = "restart"
        plan.preempted.append((group.group_id, mode))
        if mode == "swap":
            plan.swap_out.extend(self.bm.swap_out(group))
            group.status = SeqStatus.SWAPPED
            group.num_swaps += 1
            for s in group.seqs:
                s.status = SeqStatus.SWAPPED
            self.swapped.append(group)
            return group
        for s in group.seqs:
            self.bm.free(s)
            s.num_computed = 0
            s.status = SeqStatus.WAITING
        if mode == "restart":
            for s in group.seqs[1:]:
                self.seqs.pop(s.seq_id, None)
            first = group.seqs[0]
            first.output_len = 0
            first.cum_logprob = 0.0
            if first.token_ids is not None:
                del first.token_ids[first.prompt_len:]
            del first.block_hashes[first.prompt_len // self.block_size:]
            first.restart_origins(group.num_preemptions)  # resampled outputs: new content
            group.seqs = [first]
            group.finished_seqs = []
        group.status = SeqStatus.WAITING
        self._enqueue(group, front=True)
        return group

    def _schedule_swapped(self, plan: StepPlan, budget: list[int], now: float) -> None:
        while self.swapped:
            group = self.swapped[0]
            chunks = [self._chunk(s, budget[0] // len(group.seqs)) for s in group.seqs]
            if 0 in chunks or self._demand() + len(group.seqs) > self.max_num_seqs:
                return
            if not self.bm.can_swap_in(group):
                return
            self.swapped.popleft()
            plan.swap_in.extend(self.bm.swap_in(group))
            self._insert_running(group)
            for s, n in zip(group.seqs, chunks):
                plan.copies.extend(self.bm.append_slots(s, n))  # type: ignore[arg-type]  # None: not here
                self._emit(plan, s, n)
            budget[0] -= sum(chunks)

    def _demand(self) -> int:
        if type(self).seq_demand is not Scheduler.seq_demand:  # a subclass's own rule counts every group
            demand = self.seq_demand
            return sum(demand(g) for g in self.running)
        total = 0
        for g in self.running:
            sp = g.request.sampling
            # seq_demand's common case inline: one sequence, no parallel samples or beams
            total += 1 if len(g.seqs) == 1 and sp.n == 1 and sp.beam_width == 1 else self.seq_demand(g)
        return total

    def _chunkable(self, seq: Sequence) -> bool:
        """Chunked prefill is on, or the work can never fit one iteration (a recompute of a
        sequence that grew past the budget), which is then computed in pieces anyway."""
        return self.chunked_prefill or seq.num_tokens - seq.num_computed > self.max_num_batched_tokens

    def _schedule_waiting(self, plan: StepPlan, budget: list[int], now: float, demand: int | None = None) -> None:
        """Admit or reject from the head of the queue while the budget lasts; `demand`: the running
        sequences' seat demand when the caller knows it (else summed only when needed)."""
        while self.waiting and budget[0] > 0:
            group: SequenceGroup = self.waiting[0]  # typed: the queue is Any (native reads below)
            answer = self._admission(group, budget[0], demand, now)
            demand = answer.demand
            if answer.verdict == REJECTED:
                self.waiting.popleft()
                self._reject(group, answer.reason, plan, now)
                continue
            if answer.verdict != ADMITTED:
                return
            self._admit(group, plan, answer.chunk, answer.cached)
            budget[0] -= answer.chunk
            demand += group.request.sampling.width  # type: ignore[operator]  # counted by ADMITTED
            self.waiting.popleft()
            if group.first_scheduled is None:
                group.first_scheduled = now
                if self._tells_admitted:
                    self.policy.on_admitted(group, now)

    def _admission(self, group: SequenceGroup, left: int, demand: int | None, now: float) -> Admission:
        """The one admission rule, for the waiting group considered first, with `left` tokens of the
        iteration's budget and `demand` sequences running (None: count them when needed). Stepping
        acts on it (`_schedule_waiting`) and windows ask it of the iteration they would skip
        (`_stays_blocked`). Pure: no block is touched and no prefix lookup counted.

        REJECTED: it can never run here, or the policy rejects it; DEFERRED: the policy holds it
        back (nothing behind it is admitted); BLOCKED: free blocks or seats refuse it now;
        OVER_BUDGET: its first chunk, less the `cached` tokens the prefix cache holds, does not fit
        the token budget; ADMITTED: its first chunk (`chunk` tokens after `cached`) runs now."""
        reason = self._never_fits(group)
        if reason is None and not self._admits_all:
            decision = self.policy.admit(group, now)
            if decision == DEFER:
                return Admission(DEFERRED, demand)
            if decision != ADMIT:
                reason = decision
        if reason is not None:
            return Admission(REJECTED, demand, reason=reason)
        (seq,) = group.seqs  # waiting groups always hold one sequence (see _preempt)
        # never NEVER here: _never_fits checks the same bound
        if not self.bm.fits_now(seq, left if self._chunkable(seq) else None):
            return Admission(BLOCKED, demand)
        if demand is None:
            demand = self._demand()
        if demand + group.request.sampling.width > self.max_num_seqs:
            return Admission(BLOCKED, demand)
        cached = self.bm.prefix_hit_tokens(seq)
        n = self._first_chunk(seq, cached, left)
        return Admission(ADMITTED if n else OVER_BUDGET, demand, n, cached)

    def _first_chunk(self, seq: Sequence, cached: int, budget: int) -> int:
        """The first chunk of a waiting sequence whose first `cached` tokens the prefix cache holds:
        the rest of it, or a budget-sized piece when chunkable (as `_chunk`), or 0."""
        n = seq.num_tokens - cached
        if n <= budget:
            return n
        return budget if self.chunked_prefill or n > self.max_num_batched_tokens else 0

    def _admit(self, group: SequenceGroup, plan: StepPlan, n: int, cached: int) -> None:
        """Allocate the (single) waiting sequence's table, `cached` tokens of it found in the
        prefix cache, and schedule its first chunk of `n` tokens (as `_admission` sized it)."""
        bm = self.bm
        (seq,) = group.seqs
        if bm.allocate(seq) != cached:
            raise AssertionError(f"group {group.group_id}: the prefix lookup changed during admission")
        seq.num_computed = cached
        group.prefix_hit_tokens += cached
        copies = bm.append_slots(seq, n)
        if copies is None:  # can_allocate said OK, so this is a bookkeeping bug
            raise AssertionError(f"group {group.group_id}: blocks vanished during admission")
        if copies:
            plan.copies.extend(copies)
        self._insert_running(group)
        self._emit(plan, seq, n)

    # ---------------------------------------------------------------- skipping ahead
    # The running batch (policies/running_batch.py) holds the plain decoders, moved on by its
    # clock; groups inserted into `running` since are `_loose` until a window's plan joins them.
    def _insert_running(self, group: SequenceGroup) -> None:
        super()._insert_running(group)
        self._loose.append(group)

    def settle(self) -> None:
        """Materialise every running sequence's owed decode steps and empty the running batch
        (every running group is loose again): what stepping and abort read."""
        self._check_no_decode_step_open()
        if self._batch.size:
            self._batch.release_all()
        self._loose = list(self.running)
        self._offer = self._decode_offer = None

    def materialise(self) -> None:
        """Pay every running-batch member its owed decode steps, keeping the batch."""
        self._batch.materialise_all()

    def _join_loose(self) -> bool:
        """Join the loose running groups that are plain decoders to the batch; False when one is
        not (a prefill or recompute in flight, or forked sequences): that group is stepped."""
        loose = self._loose
        if not loose:
            return True
        batch = self._batch
        left = []
        for g in loose:
            if g.status != SeqStatus.RUNNING or len(g.seqs) != 1:
                if g.status == SeqStatus.RUNNING:
                    left.append(g)
                continue
            s = g.seqs[0]
            if s.anchor >= 0:
                continue  # joined already (listed twice: preempted and admitted again)
            if s.prompt_len + s.output_len - s.num_computed != 1 or not s.output_len:
                left.append(g)
                continue
            batch.join(s)
        self._loose = left
        return not left

    def _check_no_decode_step_open(self) -> None:
        """A decode step begun (apply_decode_step) must be completed before the scheduler settles,
        schedules or offers again."""
        if self._decode_begun is not None:
            raise AssertionError("a decode step was begun and not completed (complete_decode_step)")

    def _take_offer_remaining(self) -> None:
        """The finishes the executor told for the last offer (asked once, kept by the batch even
        when the replica step then declined the window)."""
        self._check_no_decode_step_open()
        offer = self._offer[0] if self._offer is not None else self._decode_offer
        if offer is not None and offer.remaining is not None and offer.seqs:
            self._batch.set_finishes(offer.seqs, offer.remaining)
        self._offer = self._decode_offer = None

    def plan_repeat(self, now: float) -> RepeatPlan | None:
        """Offer the running batch's coming plain decodes (see RepeatPlan), or None when the next
        iteration must be scheduled normally: `steps` iterations whose blocks are certain, in which
        nothing waiting can be admitted or rejected (it stays refused while the batch only grows,
        or the policy defers it until its wake time, where the replica step ends the window), and
        `exhausts` when the iteration after them, in which free blocks run out, can be applied too
        (the running tail is the victim: a policy that picks its own gets that iteration stepped).
        When something waiting could be admitted, only an iteration that runs out of blocks at
        once (it admits nothing) is offered. Reads the running batch's kept figures, never the
        sequences.
        """
        self._take_offer_remaining()
        running = self.running
        if not running or self.swapped or len(running) > self.max_num_batched_tokens:
            return None
        # whichever waiting group could come first while the batch decodes must stay refused
        waiting = self.waiting
        if not waiting:
            head_blocked = True
        elif self._fcfs_order:  # the head stays the head while nothing arrives ahead of it
            head_blocked = self._stays_blocked(waiting[0], len(running), now)
        else:
            head_blocked = all(self._stays_blocked(g, len(running), now) for g in self.head_candidates())
        free = self.bm.pool.num_free
        if not head_blocked and free >= len(running):
            return None  # an admission comes next, and no group can run out of blocks first
        if self._loose and not self._join_loose():
            return None
        batch = self._batch
        h = _block_horizon(batch.counts, -batch.clock % self.block_size, len(running), free)
        if not head_blocked and h > 0:
            return None
        unknown = list(batch.unknown)
        plan = RepeatPlan(len(running), batch.context(), h, not self._custom_victim,
                          unknown, None if unknown else [], batch.first_finish())
        self._offer = (plan, h, plan.exhausts)
        return plan

    def _stays_blocked(self, head: SequenceGroup, num_running: int, now: float) -> bool:
        """True if the waiting group `head`, considered first in a plain decode iteration of
        `num_running` single sequences, is refused by `_admission` for a reason that persists
        while those sequences only grow (free blocks only shrink, counts and budgets stay), or
        deferred by the policy (until its wake_time, where the window ends)."""
        if len(head.seqs) != 1 or head.rejected is not None:
            return False
        answer = self._admission(head, self.max_num_batched_tokens - num_running, num_running, now)
        if answer.verdict != OVER_BUDGET:
            return answer.verdict in (BLOCKED, DEFERRED)
        # the prompt less its prefix-cache hit does not fit: decodes can only evict that hit (the
        # need grows); unless the growth could make a sequence too long for one iteration, and so
        # chunkable, the refusal persists
        return not answer.cached or self.chunked_prefill or head.seqs[0].num_tokens <= self.max_num_batched_tokens

    def plan_decode_step(self) -> DecodeStepPlan | None:
        """Offer the next iteration to be applied at once (see DecodeStepPlan) when every running
        group is a single sequence decoding one token, the budget holds them all, nothing is
        swapped out, the free blocks cover every block the batch opens (so nothing is preempted)
        and no prefix cache registers the blocks they fill; else None (step it)."""
        self._take_offer_remaining()
        running = self.running
        if (not running or self.swapped or len(running) > self.max_num_batched_tokens
                or self.bm.enable_prefix_caching):
            return None
        # the members whose next token opens a block (nothing preempts when all are there)
        batch = self._batch
        if (self._loose and not self._join_loose()) or batch.counts[-batch.clock % self.block_size] > self.bm.pool.num_free:
            return None
        unknown = list(self._batch.unknown)
        plan = DecodeStepPlan(unknown, None if unknown else [])
        self._decode_offer = plan
        return plan

    def apply_decode_step(self, plan: DecodeStepPlan, now: float,
                          execute: Callable[[StepPlan, StepComposition], StepResult]) -> DecodeStepResult:
        """Apply the start of the offered iteration as schedule() and the executor would: the
        batch's tokens first (its blocks), then the waiting queue by `_schedule_waiting`. Only the
        sequences that finish and the admitted ones get a ScheduledSeq, each with its Sequence as
        schedule()'s have (in plan order: `execute(plan, composition)` prices the whole iteration
        and returns their outcomes, reading no more than the plan); the others move on by the
        batch's clock, at the iteration's end (`complete_decode_step`). Until then the scheduler is
        as stepping leaves it while the iteration runs: the admitted groups run, every finishing
        group is still running, the policy has not been told the service, and the members read
        their counts before the iteration (the clock has not moved), as stepping's sequences do."""
        offer, self._decode_offer = self._decode_offer, None
        if plan is not offer or plan.remaining is None or len(plan.remaining) != len(plan.seqs):
            raise AssertionError("apply_decode_step needs the scheduler's current DecodeStepPlan with its remaining counts")
        batch, bm = self._batch, self.bm
        if plan.seqs:
            batch.set_finishes(plan.seqs, plan.remaining)
        batch_groups = list(self.running) if self._tells_served else None
        num_batch = batch.size
        demand = batch.demand
        finishing = self._in_batch_order(batch.finishing(ahead=1))  # their last token is this step's
        for s in finishing:  # leave the batch, settled before this step
            batch.leave(s)
        # the blocks this step opens, then the finishing sequences' own token (a new block or
        # their own partly filled one)
        bm.open_blocks(batch.opening_tables())
        bm.add_token_states(batch.size)
        step = StepPlan(block_size=self.block_size)
        for s in finishing:
            sid = s.seq_id
            if bm.append_slots(s, 1) != []:  # plan_decode_step counted its block
                raise AssertionError(f"sequence {sid}: no free block, or a shared one copied, in a decode step")
            step.seqs.append(ScheduledSeq(sid, s.group.group_id, s.num_computed, 1, table_of(s), True, s))
        num_continuing = batch.size
        context = batch.context() + num_continuing  # of the continuing sequences, with the new token
        self._schedule_waiting(step, [self.max_num_batched_tokens - num_batch], now, demand)
        comp = step.composition(num_continuing, context)
        res = DecodeStepResult(comp, execute(step, comp), step, batch_groups, len(finishing))
        self._decode_begun = res
        return res

    def complete_decode_step(self, res: DecodeStepResult, end: float) -> list[SequenceGroup]:
        """Apply the end of the decode step `apply_decode_step` began, at `end`, as on_step_done
        would: the policy told the service (the batch, then the admitted, in plan order; before the
        clock moves, so members read as stepping's do when told), the batch's clock moved, the
        sampled outcomes applied (finishes: blocks freed, groups done, the policy told)."""
        if res is not self._decode_begun:
            raise AssertionError("complete_decode_step needs the decode step this scheduler began")
        self._decode_begun = None
        if res.batch_groups is not None:
            self.policy.on_decoded(res.batch_groups, 1)
            self._account_service(res.step.seqs[res.num_finishing:])
        self._batch.clock += 1
        res.finished = self._apply_outcomes(res.step, res.result, end)
        return res.finished

    def _in_batch_order(self, seqs: list[Sequence]) -> list[Sequence]:
        if len(seqs) > 1:
            index = self.running.index
            seqs.sort(key=lambda s: index(s.group))
        return seqs

    def apply_repeat(self, plan: RepeatPlan, end: float,
                     price: Callable[[StepComposition], float]) -> RepeatResult:
        """Apply the offered plan as the replica step narrowed it (see Scheduler.apply_repeat):
        plan.steps plain decodes, blocks taken in the order stepping takes them, then with
        plan.exhausts the preempting iteration. The running sequences' own counters and their
        blocks' fill levels are owed (the running batch's clock) until something reads them."""
        offer, self._offer = self._offer, None
        k = plan.steps
        if (offer is None or plan is not offer[0] or not 0 <= k <= offer[1] or plan.remaining is None
                or (plan.exhausts and not (offer[2] and k == offer[1])) or not (k or plan.exhausts)):
            raise AssertionError("apply_repeat needs the scheduler's current RepeatPlan, narrowed, not widened")
        if plan.seqs:
            self._batch.set_finishes(plan.seqs, plan.remaining)
        if k:
            result = self._repeat(plan, end)
        else:
            result = RepeatResult([], 0, 0, 0, 0, 0, self.block_size)  # no rows: only the preempting iteration
        if plan.exhausts:
            comp, preempted = self._exhaustion_step()
            if comp.num_decode_seqs:  # else the batch was preempted whole: no iteration, no time
                duration = price(comp)
                self._finish_plain(end + duration)
                result.exhaustion, result.exhaustion_duration, result.num_preempted = comp, duration, preempted
        return result

    def _repeat(self, plan: RepeatPlan, now: float) -> RepeatResult:
        """The plan's k plain decodes (as k calls of schedule() and on_step_done() without sampled
        tokens); the groups whose last token comes in the k-th finish, at `now`."""
        bm = self.bm
        bs = self.block_size
        batch = self._batch
        k = plan.steps
        b = batch.size
        # the members opening a block in decode step j + 1 from the clock: bucket -(clock + j) % bs
        counts, clock = batch.counts, batch.clock
        pool = bm.pool
        states0 = pool.used_filled
        used0 = bm.num_gpu_blocks - pool.num_free
        free0 = pool.num_free * bs
        # blocks taken in iteration order (any order within one: which block a sequence gets is
        # not observable, only how many are taken and when)
        batch.open_within(k)
        bm.add_token_states(k * b)
        if self._tells_served:  # before the clock moves: a group reads as stepping's first call
            self.policy.on_decoded(self.running, k)
        batch.clock += k
        # the log's record of the window: blocks opened by each step
        result = RepeatResult([counts[-(clock + j) % bs] for j in range(k)], b, plan.context_tokens,
                                    states0, used0 * bs, free0, bs)
        self._finish_plain(now)
        # the last step's memory after its finishes (bm.memory(), from the pool); without any,
        # what the opened blocks give
        states_k = pool.used_filled
        result.last_states = states_k
        result.last_internal = (bm.num_gpu_blocks - pool.num_free) * bs - states_k
        result.last_free = pool.num_free * bs
        result.last_running = len(self.running)
        return result

    def _finish_plain(self, now: float) -> bool:
        """Finish the members whose last token was the one computed at the batch's clock, as
        on_step_done does: in batch order, freeing the blocks. Returns whether any finished."""
        done = self._batch.finishing()
        if not done:
            return False
        batch = self._batch
        for s in self._in_batch_order(done):
            batch.leave(s)
            g = s.group
            self._finish_seq(s, keep_record=True)
            self._finish_group(g, now)
        return True

    def _exhaustion_step(self) -> tuple[StepComposition, int]:
        """The plain-decode iteration after the plan's steps, in which free blocks run out, as
        schedule() and on_step_done() would apply it: running groups (single sequences, one token
        each) take their tokens in batch order; the first that finds no free block preempts the
        most recently arrived groups until one frees up (or it is itself preempted). Nothing is
        admitted. Only the groups opening a block can preempt: their bucket, put in batch order.
        Returns the iteration's composition and how many groups were preempted; the
        caller finishes the groups whose last token this was."""
        bm = self.bm
        bs = self.block_size
        batch = self._batch
        preempt_plan = StepPlan(block_size=bs)
        running = self.running  # _preempt removes from its tail
        openers = batch.opening_in_order(running, self._running_by_arrival)  # in batch order
        opening: list[list[int]] = []  # openers' tables whose blocks are not taken yet: taken before any preemption
        for s in openers:  # in batch order
            g = s.group
            if g.status != SeqStatus.RUNNING:
                break  # preempted as the tail: everything after it is preempted too
            if bm.pool.num_free <= len(opening):  # this one finds no free block: preempt first
                bm.open_blocks(opening)
                opening = []
                while not bm.pool.num_free and g.status == SeqStatus.RUNNING:
                    tail = running[-1]
                    batch.leave(tail.seqs[0])
                    self._preempt(tail, preempt_plan)
                if g.status != SeqStatus.RUNNING:
                    break  # it was the tail: everything after it is preempted too
            opening.append(table_of(s))
        if opening:
            bm.open_blocks(opening)
        survivors = batch.size
        bm.add_token_states(survivors)
        if self._tells_served:
            self.policy.on_decoded(running, 1)
        batch.clock += 1
        comp = StepComposition(num_decode_seqs=survivors, decode_context_tokens=batch.context(),
                               swap_out_blocks=len(preempt_plan.swap_out), block_size=bs)
        return comp, len(preempt_plan.preempted)


def _block_horizon(counts: list[int], q: int, num_seqs: int, free: int) -> int:
    """How many decode steps can take their new blocks from `free` blocks, when the running batch's
    residue buckets hold counts[.] sequences and bucket q opens a block next: bucket (q - r) mod bs
    opens at steps r + 1, r + 1 + bs, ... (RunningBatch.counts, read in place);
    every bs steps each of the `num_seqs` sequences opens exactly one, so whole periods are counted
    at once."""
    bs = len(counts)
    periods, left = free // num_seqs, free % num_seqs  # not divmod: a generic call compiled
    h = periods * bs
    for _r in range(bs):  # sum(counts) == num_seqs > left, so this stops within the period
        left -= counts[q]
        if left < 0:
            break
        h += 1
        q = q - 1 if q else bs - 1
    return h
