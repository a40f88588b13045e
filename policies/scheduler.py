"""The scheduler base: queues, the step contract, and what happens when a step is done.

Every policy follows one loop (see docs/design.md):

    plan = scheduler.schedule(now)          # StepPlan: who runs, how many tokens each, preemptions
    result = executor.execute(plan)         # StepResult: duration and sampled outcomes
    scheduler.on_step_done(plan, result, now + result.duration)

Subclasses decide admission, memory and preemption; this base owns the request life cycle
(arrival, tokens appended, forks, finish, rejection) so that all policies account for requests the
same way.
"""

from __future__ import annotations

import bisect
import itertools
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from mypy_extensions import mypyc_attr

from policies.memory import MemoryBreakdown
from policies.plan import (
    DecodeStepPlan,
    DecodeStepResult,
    RepeatPlan,
    RepeatResult,
    ScheduledSeq,
    SeqOutcome,
    StepComposition,
    StepPlan,
    StepResult,
)
from policies.queue_policy import REQUEST, STATE, QueuePolicy, check_reads
from policies.request import Request, SeqStatus, Sequence, SequenceGroup


def _insort_by_arrival(running: list[SequenceGroup], group: SequenceGroup) -> None:
    """Insert `group` after every running group whose (request arrival, group id) is <= its: what
    `bisect.insort` with that tuple as key does, without a key call and a tuple per probe (the
    comparisons stay native when compiled)."""
    arrival, gid = group.request.arrival, group.group_id
    lo, hi = 0, len(running)
    while lo < hi:
        mid = (lo + hi) // 2
        other = running[mid]
        a = other.request.arrival
        if arrival < a or (arrival == a and gid < other.group_id):  # (arrival, gid) < other's key
            hi = mid
        else:
            lo = mid + 1
    running.insert(lo, group)


def _base_hook(policy: QueuePolicy, name: str) -> bool:
    """Whether the policy's hook `name` is QueuePolicy's own no-op (not overridden by its class
    nor set on the instance): calling it would change nothing."""
    return getattr(getattr(policy, name), "__func__", None) is getattr(QueuePolicy, name)


def remove_group(groups: list[SequenceGroup], group: SequenceGroup) -> None:
    """`groups.remove(group)` (a group equals only itself), the tail tried first (a preemption's
    victim): compiled, a pointer comparison per element instead of a rich comparison."""
    n = len(groups)
    if n and groups[n - 1] is group:
        del groups[n - 1]
        return
    for i in range(n):
        if groups[i] is group:
            del groups[i]
            return
    raise ValueError(f"group {group.group_id} is not in the list")


@mypyc_attr(allow_interpreted_subclasses=True)  # a plug-in base, when compiled (build_compiled.py)
class Scheduler(ABC):
    """Base class. Invariants: a group is in exactly one of waiting / running / swapped / done;
    `waiting` and `running` are sorted by the queue policy's keys (FCFS: arrival, then id), so the
    running tail is the first preemption victim."""

    name = "base"

    def __init__(self, max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 block_size: int = 16, max_model_len: int | None = None,
                 policy: QueuePolicy | None = None) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_num_batched_tokens < block_size:
            raise ValueError(f"max_num_batched_tokens must be >= block_size ({block_size}), "
                             f"got {max_num_batched_tokens}")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.done: list[SequenceGroup] = []
        self.seqs: dict[int, Sequence] = {}
        # the next sequence id (a counter's own __next__: compiled, next() looks the builtin up each call)
        self._next_seq_id: Callable[[], int] = itertools.count().__next__
        self.num_added = 0
        self.released = 0  # groups handed out of `done` (release_done): accounted for, no longer held
        self.num_preemptions = 0
        # groups a skip-ahead window has already finished whose last iteration the simulated
        # clock has not reached (written by the replica step that owns this scheduler): still
        # outstanding to a router reading meanwhile; routers read it only inside `outstanding`
        self._departing = 0
        # `outstanding`, kept as groups arrive, end and depart: loads[load_slot] (its own list,
        # unless a router's views share one list among replicas: share_load). Invariant (checked
        # by check_invariants): loads[load_slot] == waiting + running + swapped + departing
        self.loads: list[int] = [0]
        self.load_slot = 0
        self.policy = policy if policy is not None else QueuePolicy()
        p = type(self.policy)
        check_reads(p.__name__, self.policy.reads)  # an instance may set its own
        # what the hot paths may skip: the base rules (FCFS order, admit everything, no wake time)
        self._fcfs_order = p.key is QueuePolicy.key and p.running_key is QueuePolicy.running_key
        # the running batch in arrival order: FCFS, or the base running_key of a policy whose keys
        # change while groups wait (reads "state")
        self._running_by_arrival = p.running_key is QueuePolicy.running_key and (
            p.key is QueuePolicy.key or self.policy.reads == STATE)
        # otherwise the running batch's key: the base running_key is the policy's key then, so that is
        # what insertion calls (one call a probe, not two); a policy's own running_key as it is
        self._running_key = self.policy.key if p.running_key is QueuePolicy.running_key else self.policy.running_key
        self._admits_all = p.admit is QueuePolicy.admit
        self._wakes = p.wake_time is not QueuePolicy.wake_time
        # the hooks to call: not the base no-ops (a generic call each, several per request)
        self._tells_queued = not _base_hook(self.policy, "on_queued")
        self._tells_admitted = not _base_hook(self.policy, "on_admitted")
        self._tells_finished = not _base_hook(self.policy, "on_finished")
        self._tells_served = bool(self.policy.tracks_service)  # read per window: kept
        # arrivals must see the policy's state as stepping leaves it (its declared `reads`)
        self.queues_by_state = self.policy.reads != REQUEST
        # a deque, or a queue ordered by the key (Any: compiled code checks declared types)
        self.waiting: Any = self.policy.new_queue()
        # a FIFO: an arrival queues behind every waiting group, and the head stays the head
        self.fifo_queue = type(self.waiting) is deque

    @property
    def outstanding(self) -> int:
        """Requests sent here and not yet completed at the caller's clock: waiting, running,
        swapped, and those a skip-ahead window finished ahead of the clock (`departing`)."""
        return len(self.waiting) + len(self.running) + len(self.swapped) + self._departing

    @property
    def departing(self) -> int:
        return self._departing

    @departing.setter
    def departing(self, n: int) -> None:
        if n != self._departing:  # most windows finish nothing: no write to the shared loads
            self.loads[self.load_slot] += n - self._departing
            self._departing = n

    def share_load(self, loads: list[int], slot: int) -> None:
        """Keep this replica's outstanding count in `loads[slot]` from now on (a router reads all
        replicas' counts from one list at every arrival instead of asking each replica)."""
        loads[slot] = self.outstanding
        self.loads, self.load_slot = loads, slot

    def head_candidates(self) -> list[SequenceGroup]:
        """The waiting groups that could be considered first while the running batch only decodes
        and nothing arrives: the FIFO's head, else what the queue says (`candidates()`), else all."""
        waiting = self.waiting
        if self.fifo_queue:
            return [waiting[0]]
        candidates = getattr(waiting, "candidates", None)
        return candidates() if candidates is not None else list(waiting)

    # ---------------------------------------------------------------- life cycle
    def add_request(self, request: Request) -> SequenceGroup:
        group = SequenceGroup(request, self._next_seq_id())
        for s in group.seqs:
            self.seqs[s.seq_id] = s
        self.num_added += 1
        self.loads[self.load_slot] += 1  # and less one if rejected now (_reject)
        reason = self.refusal_on_arrival(request)
        if reason is not None:
            self._reject(group, reason, None, request.arrival)
            return group
        self._enqueue(group)
        return group

    def _enqueue(self, group: SequenceGroup, front: bool = False) -> None:
        """Queue a group to wait: in the policy's key order, or with FCFS-like policies at the back
        (an arrival) or the front (`front`: a preempted group, as vLLM requeues it)."""
        if self._tells_queued:
            self.policy.on_queued(group)
        if not self.fifo_queue:  # a queue that orders itself (see QueuePolicy.new_queue)
            self.waiting.push(group, front)
        elif front:
            self.waiting.appendleft(group)
        else:
            self.waiting.append(group)

    def wake_time(self, now: float) -> float:
        """When the policy's admission answers may change by themselves (see QueuePolicy.wake_time)."""
        return self.policy.wake_time(self.waiting, now) if self._wakes and self.waiting else math.inf

    def refusal_on_arrival(self, request: Request) -> str | None:
        """Why `add_request` would reject the request at once (it never waits), or None. Pure."""
        if request.reject_reason is not None:  # known unservable (e.g. a failed request in the trace)
            return request.reject_reason
        total = request.prompt_len + request.max_output
        if self.max_model_len is not None and total > self.max_model_len:
            return (f"prompt {request.prompt_len} + output {request.max_output} tokens exceeds "
                    f"the model's context of {self.max_model_len}")
        return None

    # ---------------------------------------------------------------- what engines, routers, studies ask
    @property
    def prefix_hits(self) -> int:
        """Prompt blocks found in the prefix cache so far (0 without a prefix cache)."""
        return 0

    def kv_usage(self) -> float:
        """The share of the KV cache allocated now (any category but free)."""
        m = self.memory()
        return 1.0 - m.free / m.total if m.total else 0.0

    def refusal(self, request: Request) -> str | None:
        """Why this scheduler could never serve the request (as it is configured: context, cache
        size, budgets), or None; a front end can refuse it before queueing. Pure."""
        return self.refusal_on_arrival(request)

    @property
    def capacity_tokens(self) -> int | None:
        """Token slots one request may hold at most (None: no fixed bound known here)."""
        return None

    def check_invariants(self) -> None:
        """Request conservation, and the memory manager's own invariants (debug mode)."""
        self.check_conservation()

    def assert_drained(self) -> None:
        """After a run: every request accounted for, and no memory held (none leaked)."""
        self.check_conservation()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_done(self) -> int:
        """Requests ended (finished, rejected or aborted): those in `done` and those handed out of it."""
        return len(self.done) + self.released

    def release_done(self) -> list[SequenceGroup]:
        """Hand the groups in `done` out (a simulator keeps their rows instead: sim.engine
        Replica.hand_over), counted in `released`; `done` is emptied in place."""
        groups = self.done[:]
        self.done.clear()
        self.released += len(groups)
        return groups

    def cached_prefix_tokens(self, request: Request) -> int:
        """Prompt tokens of `request` this replica's prefix cache could serve now (what a cache-aware
        router asks; policies without a prefix cache hold none)."""
        return 0

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.seqs) for g in self.running)

    @staticmethod
    def seq_demand(group: SequenceGroup) -> int:
        """Sequences the group runs at once from now on, at most: its width (n or beam width) until it
        has forked, then its live sequences. Admission must count this, not len(group.seqs), or
        forks push a batch past max_num_seqs."""
        live = len(group.seqs)
        if live > 1:  # forked already
            return live
        sp = group.request.sampling
        if sp.n == 1 and sp.beam_width == 1:  # the common case, without the width property
            return live
        width = sp.width
        if width > 1 and live + len(group.finished_seqs) <= 1:
            return width
        return live

    def _insert_running(self, group: SequenceGroup) -> None:
        group.status = SeqStatus.RUNNING
        for s in group.seqs:
            s.status = SeqStatus.RUNNING
        if self._running_by_arrival:
            _insort_by_arrival(self.running, group)
        else:
            bisect.insort(self.running, group, key=self._running_key)

    def _reject(self, group: SequenceGroup, reason: str, plan: StepPlan | None, now: float) -> None:
        """End a group that will never run (recorded in the plan, if it was being scheduled)."""
        group.rejected = reason
        group.status = SeqStatus.FINISHED
        group.finish_time = now
        for s in group.seqs:
            s.status = SeqStatus.FINISHED
            self.seqs.pop(s.seq_id, None)
        self.done.append(group)
        self.loads[self.load_slot] -= 1
        if plan is not None:  # it was queued (not refused on arrival): the policy saw it arrive
            plan.rejected.append((group.group_id, reason))
            if self._tells_finished:
                self.policy.on_finished(group)

    def _finish_group(self, group: SequenceGroup, now: float) -> None:
        """A running group whose last sequence finished leaves the batch."""
        group.status = SeqStatus.FINISHED
        group.finish_time = now
        remove_group(self.running, group)
        self.done.append(group)
        self.loads[self.load_slot] -= 1
        if self._tells_finished:
            self.policy.on_finished(group)

    def abort(self, group_id: int, now: float, reason: str = "aborted") -> SequenceGroup | None:
        """End an unfinished request from outside (its client went away, the server shuts down).
        It leaves waiting / running / swapped; a running or swapped group's sequences are
        finished through `_free_seq` (only the block pool changes counts) and keep their outputs
        as finished sequences; it is recorded as done and aborted (`aborted`, `rejected` = `reason`;
        its first token time and outputs kept). Returns the group, or None when no unfinished group
        has that id. Call between steps, never while a plan is being executed."""
        self.settle()
        for queue in (self.waiting, self.running, self.swapped):
            group = next((g for g in queue if g.group_id == group_id), None)
            if group is not None:
                break
        else:
            return None
        queue.remove(group)
        if queue is self.waiting:  # a waiting group holds no memory (never admitted, or freed when preempted)
            for s in group.seqs:
                s.status = SeqStatus.FINISHED
                self.seqs.pop(s.seq_id, None)
        else:
            for s in list(group.seqs):
                self._finish_seq(s, keep_record=True)
        group.rejected, group.aborted = reason, True
        group.status = SeqStatus.FINISHED
        group.finish_time = now
        self.done.append(group)
        self.loads[self.load_slot] -= 1
        self.policy.on_finished(group)
        return group

    def settle(self) -> None:
        """Apply bookkeeping a scheduler deferred (skipped-ahead decode steps); the base defers none."""
        return

    def materialise(self) -> None:
        """Make every sequence's own fields exact (what a reader outside the scheduler is handed),
        keeping whatever skip-ahead keeps; only between iterations. The base defers nothing."""
        return

    # ---------------------------------------------------------------- skipping ahead
    def plan_repeat(self, now: float) -> RepeatPlan | None:
        """Offer the coming iterations that repeat the running batch (see RepeatPlan), or None when
        the next one must be scheduled normally. The base offers none, so any scheduler runs; the
        paged scheduler offers them for every QueuePolicy."""
        return None

    def apply_repeat(self, plan: RepeatPlan, end: float,
                     price: Callable[[StepComposition], float]) -> RepeatResult:
        """Apply the offered plan, as narrowed by the replica step, at once: exactly what
        plan.steps calls of schedule() and on_step_done() would do, the last ending at `end`
        (sequences finishing there finish then), and, with plan.exhausts, the preempting
        iteration after them, whose duration `price` gives once its preemptions are known."""
        raise AssertionError(f"scheduler {self.name} offered no RepeatPlan to apply")

    def plan_decode_step(self) -> DecodeStepPlan | None:
        """Offer the next iteration to be applied at once (see DecodeStepPlan), or None when it
        must be scheduled normally. The base offers none."""
        return None

    def apply_decode_step(self, plan: DecodeStepPlan, now: float,
                          execute: Callable[[StepPlan, StepComposition], StepResult]) -> DecodeStepResult:
        """Apply the start of the offered iteration, begun at `now`, at once: what schedule() and
        `execute` would do. Until `complete_decode_step` the scheduler is as stepping leaves it
        while that iteration runs."""
        raise AssertionError(f"scheduler {self.name} offered no DecodeStepPlan to apply")

    def complete_decode_step(self, res: DecodeStepResult, end: float) -> list[SequenceGroup]:
        """Apply the end of the iteration `apply_decode_step` began, at `end`: what on_step_done()
        would do. Returns the groups that finished."""
        raise AssertionError(f"scheduler {self.name} began no decode step to complete")

    @abstractmethod
    def schedule(self, now: float) -> StepPlan:
        """Decide the next iteration."""

    @abstractmethod
    def _free_seq(self, seq: Sequence) -> None:
        """Release a sequence's memory."""

    @abstractmethod
    def _fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Give a new child sequence its parent's memory (shared or copied)."""

    @abstractmethod
    def memory(self) -> MemoryBreakdown:
        """KV memory by category right now."""

    def on_step_done(self, plan: StepPlan, result: StepResult, now: float) -> list[SequenceGroup]:
        """Apply an executed plan: advance computed counts, append sampled tokens, fork and drop
        sequences, finish groups. Returns the groups that finished in this step.

        Pruned sequences (keep=False, no children) are dropped before any fork, so that their
        memory serves this step's forks (the contiguous baselines' spare chunks); a dropped parent
        with children continues as its first child (no copy)."""
        if self._tells_served:
            self._account_service(plan.seqs)
        return self._apply_outcomes(plan, result, now)

    def _apply_outcomes(self, plan: StepPlan, result: StepResult, now: float) -> list[SequenceGroup]:
        """`on_step_done` after the policy was told what each group was served."""
        seqs = self.seqs
        outcomes = result.outcomes
        others_continue = result.others_continue
        sampled: list[Sequence] = []       # parallel lists, not tuples: fewer objects for the GC
        sampled_outs: list[SeqOutcome] = []
        pruned = False
        for ss in plan.seqs:
            seq = seqs[ss.seq_id]
            seq.num_computed += ss.num_new_tokens
            if not ss.samples:
                continue
            group = seq.group
            if group.first_token_time is None:
                group.first_token_time = now
            out = outcomes.get(ss.seq_id)
            if out is None:
                if not others_continue:
                    raise ValueError(f"executor returned no outcome for sampling sequence {ss.seq_id}")
                # a plain continuation (SeqOutcome(seq_id)) touches only this sequence, so it is
                # applied here rather than after the drops and forks below
                seq.output_len += 1
                if seq.token_ids is not None:
                    seq.token_ids.append(-1)
                seq.cum_logprob = 0.0
                continue
            sampled.append(seq)
            sampled_outs.append(out)
            if not out.keep and not out.children:
                pruned = True
        ended: dict[int, SequenceGroup] = {}   # groups that lost a sequence in this step
        if pruned:
            for seq, out in zip(sampled, sampled_outs):
                if not out.keep and not out.children:
                    ended[seq.group.group_id] = seq.group
                    self._finish_seq(seq, keep_record=False)
        for seq, out in zip(sampled, sampled_outs):
            token, children, finished, born_done = out.token, out.children, out.finished, out.children_finished
            if not out.keep:
                if not children:
                    continue
                token, children = children[0], children[1:]
                if born_done:
                    finished, born_done = born_done[0], born_done[1:]
            if children:
                group = seq.group
                for j, tok in enumerate(children):
                    child = Sequence(self._next_seq_id(), group, seq.prompt_len, seq.target_len,
                                     None if seq.token_ids is None else list(seq.token_ids), seq.output_len)
                    child.num_computed = seq.num_computed
                    child.status = SeqStatus.RUNNING
                    child.cum_logprob = seq.cum_logprob
                    self._fork_seq(seq, child)
                    child.append(tok)
                    group.seqs.append(child)
                    seqs[child.seq_id] = child
                    if j < len(born_done) and born_done[j]:  # its first token was its last
                        ended[group.group_id] = group
                        self._finish_seq(child, keep_record=True)
            seq.output_len += 1  # Sequence.append, inlined on the hot path
            if seq.token_ids is not None:
                seq.token_ids.append(-1 if token is None else token)
            seq.cum_logprob = out.logprob
            if finished:
                ended[seq.group.group_id] = seq.group
                self._finish_seq(seq, keep_record=True)
        finished_groups = []  # not `finished`, a bool above: compiled code keeps one type per name
        for group in ended.values():
            if not group.seqs:
                self._finish_group(group, now)
                finished_groups.append(group)
        return finished_groups

    def _account_service(self, scheduled: Iterable[ScheduledSeq]) -> None:
        """Tell the policy what each group was served in this step: prompt tokens, then the rest."""
        seqs, served = self.seqs, self.policy.on_served
        for ss in scheduled:
            seq = seqs[ss.seq_id]
            prefill = max(0, min(ss.start + ss.num_new_tokens, seq.prompt_len) - ss.start)
            served(seq.group, prefill, ss.num_new_tokens - prefill)

    def _finish_seq(self, seq: Sequence, keep_record: bool) -> None:
        seq.status = SeqStatus.FINISHED
        self._free_seq(seq)
        seq.group.seqs.remove(seq)
        if keep_record:
            seq.group.finished_seqs.append(seq)
        self.seqs.pop(seq.seq_id, None)

    # ---------------------------------------------------------------- checks
    def check_conservation(self) -> None:
        """Every added request is waiting, running, swapped, finished or rejected, exactly once (the
        finished ones handed out of `done` counted by `released`)."""
        ids = [g.group_id for q in (self.waiting, self.running, self.swapped, self.done) for g in q]
        assert len(ids) == len(set(ids)) and len(ids) + self.released == self.num_added, \
            f"{self.num_added} requests added but {len(set(ids))} accounted for ({len(ids)} entries, {self.released} released)"
        assert self.loads[self.load_slot] == self.outstanding, \
            f"kept outstanding count {self.loads[self.load_slot]} != {self.outstanding} (waiting + running + swapped + departing)"
        for g in self.done:
            assert g.status == SeqStatus.FINISHED, f"group {g.group_id} done but not finished"
            if g.rejected is None:
                assert not g.seqs, f"group {g.group_id} done with live sequences {g.seqs}"
                assert g.finished_seqs, f"group {g.group_id}: finished with no output"
            else:  # a rejected group keeps its (never run) sequences, all finished and forgotten
                assert all(s.status == SeqStatus.FINISHED and s.seq_id not in self.seqs for s in g.seqs), \
                    f"rejected group {g.group_id} has live sequences"
