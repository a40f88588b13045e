"""A tiny deterministic driver for the policies: runs a scheduler to completion with a toy executor.

Toy decoding rules (seeded by `seed`):
- a sampling sequence finishes when it reaches its `target_len` (the request's output length);
- parallel sampling (n > 1): the first token forks n - 1 children; with `vary_children` each child
  draws its own target in [its current length + 1, the parent's target] (only when the parent's
  target is >= 2, else no fork: a child could not finish without overshooting);
- beam search (beam_width k): at the first token the sequence forks k - 1 children. At every later
  step, among the m beams of a group that sampled in this step, a random non-empty subset survives
  and the m - s freed places go as extra children to random survivors, so the group keeps k beams
  while forks, prunes and copy-on-write happen. Beams that reach the target all finish.
Token ids are drawn from a small vocabulary so that sequences (and prefix-cache blocks) collide.

`run_to_completion` adds requests at their arrival time (the clock advances `dt` per iteration, and
jumps to the next arrival when the scheduler is idle), runs schedule -> execute -> on_step_done, and
fails with a clear message if the scheduler stalls or exceeds `max_steps`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from policies.plan import SeqOutcome, StepPlan, StepResult
from policies.request import Request, SamplingParams
from policies.scheduler import Scheduler

VOCAB = 4


class ToyExecutor:
    """Decides token outcomes for a plan; see the module docstring for the rules."""

    def __init__(self, scheduler: Scheduler, seed: int = 0, vary_children: bool = False,
                 vocab: int = VOCAB) -> None:
        self.sched = scheduler
        self.rng = random.Random(seed)
        self.vary_children = vary_children
        self.vocab = vocab

    def _tok(self) -> int:
        return self.rng.randrange(self.vocab)

    def execute(self, plan: StepPlan, duration: float = 1.0) -> StepResult:
        result = StepResult(duration=duration)
        beams: dict[int, list[int]] = {}
        seqs = self.sched.seqs
        for ss in plan.seqs:
            if not ss.samples:
                continue
            seq = seqs[ss.seq_id]
            group = seq.group
            sp = group.request.sampling
            if sp.beam_width > 1:
                beams.setdefault(group.group_id, []).append(ss.seq_id)
                continue
            done = seq.output_len + 1 >= seq.target_len
            out = SeqOutcome(ss.seq_id, self._tok(), finished=done)
            if sp.n > 1 and seq.output_len == 0 and len(group.seqs) == 1 and not group.finished_seqs:
                out.children = [self._tok() for _ in range(sp.n - 1)]
                if done:  # a one-token output: the samples are born finished
                    out.children_finished = [True] * (sp.n - 1)
            result.outcomes[ss.seq_id] = out
        for ids in beams.values():
            self._beam_step(ids, result)
        return result

    def _beam_step(self, ids: list[int], result: StepResult) -> None:
        seqs = [self.sched.seqs[i] for i in ids]
        group = seqs[0].group
        k = group.request.sampling.beam_width
        first = len(group.seqs) == 1 and seqs[0].output_len == 0
        extra: dict[int, int] = dict.fromkeys(ids, 0)
        keep = set(ids)
        growing = [s.seq_id for s in seqs if s.output_len + 1 < s.target_len]
        if first and growing:
            extra[ids[0]] = k - 1
        elif len(growing) == len(ids) and ids:
            survivors = self.rng.sample(ids, self.rng.randint(1, len(ids)))
            keep = set(survivors)
            for _ in range(len(ids) - len(survivors)):
                extra[self.rng.choice(survivors)] += 1
        for s in seqs:
            done = s.output_len + 1 >= s.target_len
            kept = s.seq_id in keep
            result.outcomes[s.seq_id] = SeqOutcome(
                s.seq_id, self._tok() if kept else None, keep=kept,
                children=[self._tok() for _ in range(extra[s.seq_id])], finished=done and kept)

    def after_step(self, before: set[int]) -> None:
        """Give new children their own target lengths (parallel sampling with vary_children)."""
        if not self.vary_children:
            return
        for sid, seq in self.sched.seqs.items():
            if sid in before or seq.group.request.sampling.n == 1:
                continue
            if seq.output_len < seq.target_len:
                seq.target_len = self.rng.randint(seq.output_len + 1, seq.target_len)


@dataclass
class Run:
    scheduler: Scheduler
    plans: list[StepPlan] = field(default_factory=list)     # block tables copied at step time
    results: list[StepResult] = field(default_factory=list)
    times: list[float] = field(default_factory=list)        # the `now` of each schedule() call
    admission_order: list[int] = field(default_factory=list)  # group ids, first time each ran
    finish_order: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.plans)

    def first_step_of(self, group_id: int) -> int:
        """The first step in which the group ran (needs keep_plans=True)."""
        for i, p in enumerate(self.plans):
            if any(s.group_id == group_id for s in p.seqs):
                return i
        raise ValueError(f"group {group_id} never ran")

    def preemptions(self) -> list[tuple[int, int, str]]:
        """(step, group id, mode) for every preemption."""
        return [(i, g, m) for i, p in enumerate(self.plans) for g, m in p.preempted]

    def rejections(self) -> dict[int, str]:
        return {g: r for p in self.plans for g, r in p.rejected}


def _snapshot(plan: StepPlan) -> StepPlan:
    seqs = [dataclasses.replace(s, block_table=list(s.block_table)) for s in plan.seqs]
    return dataclasses.replace(plan, seqs=seqs, copies=list(plan.copies), swap_out=list(plan.swap_out),
                               swap_in=list(plan.swap_in), preempted=list(plan.preempted),
                               rejected=list(plan.rejected))


def run_to_completion(sched: Scheduler, requests: Iterable[Request], *, seed: int = 0,
                      max_steps: int = 20_000, dt: float = 1.0, vary_children: bool = False,
                      check: Callable[[Scheduler, StepPlan], None] | None = None,
                      after: Callable[[Scheduler, StepPlan, StepResult], None] | None = None,
                      keep_plans: bool = True, stall_limit: int = 5) -> Run:
    """Drive `sched` until every request is finished or rejected.

    `check(sched, plan)` runs right after each schedule() (before the executor); `after(sched, plan,
    result)` after each on_step_done(). Raises AssertionError on a stall (`stall_limit` empty plans in
    a row with nothing arriving) or after `max_steps` iterations. Plans are recorded with their block
    tables copied at step time; with `keep_plans=False` only their preemptions and rejections are
    kept (cheaper for property tests).
    """
    pending = sorted(requests, key=lambda r: (r.arrival, r.request_id))
    ex = ToyExecutor(sched, seed, vary_children)
    run = Run(sched)
    seen: set[int] = set()
    now = 0.0
    nxt = 0
    stalled = 0
    while nxt < len(pending) or sched.has_unfinished():
        while nxt < len(pending) and pending[nxt].arrival <= now:
            sched.add_request(pending[nxt])
            nxt += 1
        if not sched.has_unfinished():
            now = pending[nxt].arrival
            continue
        if run.steps >= max_steps:
            raise AssertionError(
                f"{sched.name}: not done after {max_steps} steps (waiting={len(sched.waiting)}, "
                f"running={len(sched.running)}, swapped={len(sched.swapped)}, done={len(sched.done)})")
        plan = sched.schedule(now)
        if check is not None:
            check(sched, plan)
        for ss in plan.seqs:
            if ss.group_id not in seen:
                seen.add(ss.group_id)
                run.admission_order.append(ss.group_id)
        result = ex.execute(plan, dt)
        before = set(sched.seqs)
        finished = sched.on_step_done(plan, result, now + dt)
        ex.after_step(before)
        run.finish_order.extend(g.group_id for g in finished)
        if after is not None:
            after(sched, plan, result)
        if keep_plans:
            run.plans.append(_snapshot(plan))
            run.results.append(result)
        else:
            run.plans.append(StepPlan(preempted=list(plan.preempted), rejected=list(plan.rejected)))
        run.times.append(now)
        progress = not plan.is_empty or plan.rejected or plan.preempted
        arriving = nxt < len(pending)
        stalled = 0 if progress or arriving else stalled + 1
        if stalled >= stall_limit:
            raise AssertionError(
                f"{sched.name}: stalled at t={now} with {stalled} empty plans in a row "
                f"(waiting={[g.group_id for g in sched.waiting][:8]}, running={[g.group_id for g in sched.running][:8]}, "
                f"swapped={[g.group_id for g in sched.swapped][:8]})")
        now += dt
    return run


def req(rid: int, prompt: int, out: int, arrival: float = 0.0, *, n: int = 1, beam: int = 1,
        max_tokens: int | None = None, ids: list[int] | None = None, **kw) -> Request:
    """A request with a known output length (max_tokens defaults to it)."""
    sp = SamplingParams(max_tokens=max_tokens or out, n=n, beam_width=beam)
    return Request(rid, arrival, prompt, sp, output_len=out, prompt_token_ids=ids, **kw)
