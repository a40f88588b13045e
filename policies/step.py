"""One iteration of the serving loop of docs/design.md, and windows of them, with no clock of its own:

    step = replica.begin(now)        # plan = scheduler.schedule(now); result = executor.execute(plan)
    ...time passes: simulated (the result's duration) or measured (the wall clock)...
    replica.complete(step, end)      # scheduler.on_step_done(plan, result, end); one iteration row

    window = replica.begin_window(now, next_arrival)   # k iterations that are certain, applied at once
    ...time passes over window.ends...
    replica.complete_window(window)

The SimPy engine (sim/engine.py) and the live engines (backend/replay.py, backend/async_engine.py) wrap
this same object; only how time passes differs. The executor is anything with
`execute(plan, composition) -> StepResult`; windows also need `remaining`, `price_repeat` and
`price` (see RepeatExecutor), which the simulated executor has.

Skip-ahead is decided here and nowhere else. The scheduler offers a RepeatPlan (its batch repeats
k times unless something changes; the base Scheduler offers none, so any scheduler runs, and the
paged scheduler offers one under every QueuePolicy). This object ends the window at the first of:
a finish (the finishing iteration included), blocks running out (that preempting iteration
included when the scheduler can apply it), an arrival that could be admitted (any arrival when
nothing waits or arrivals may jump the queue), the policy's wake time, and, when arrivals read
this replica's state (`routed`: a router picks a replica by more than its outstanding count; or
the policy queues by state), any arrival. A router that reads only counts (`counts_only`) sees
the count the replica had at the arrival's time: it changes in a window only at its last end,
where its finishes are, and `Scheduler.departing` holds them until the caller's clock gets there.
When no such window is certain, the next iteration itself may be applied at once as a
one-iteration window (the scheduler's DecodeStepPlan: a batch of plain decodes with the blocks it
opens, so nothing is preempted, while the scheduler's own admission rule admits and rejects from
the queue); only its finishing and admitted sequences get a plan of their own. It is applied in
stepping's two halves: its start at begin_window (schedule()'s decisions, the price), its end at
complete_window (the policy told the service, the batch's clock moved, the finishes), so between
them the replica is as stepping leaves it while that iteration runs. So arrivals may pass a
decode step when they read the policy's state or the outstanding count; only a router that reads
more of the replica keeps the decode step stepped while arrivals remain. Windows of two or more
iterations still end before every arrival that reads state.
The result is the same, bit for bit, as stepping the window's iterations one by one.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from policies.iteration_log import IterationLog
from policies.memory import MemoryBreakdown
from policies.plan import (
    DecodeStepPlan,
    DecodeStepResult,
    RepeatPlan,
    RepeatResult,
    StepComposition,
    StepPlan,
    StepResult,
)
from policies.request import Request, SequenceGroup
from policies.request import Sequence as Seq
from policies.scheduler import Scheduler


class Executor(Protocol):
    def execute(self, plan: StepPlan, comp: StepComposition) -> StepResult: ...


# stop(seq, token) -> True when `token` ends the sequence early (a served request's stop strings)
# queued(times) -> how many requests not yet delivered join the replica's waiting queue by each of
# `times` (ascending), for the log's waiting column (begin_window)
Queued = Callable[[Sequence[float]], Sequence[int]]
StopCheck = Callable[[Seq, int], bool]


class ServedExecutor(Executor, Protocol):
    """An executor behind a server (backend.async_engine: the live one, or sim.emulated's): told
    about a served request only through these two hooks, never by having its state written.
    `register` comes before the scheduler sees the request: its own sampling seed (ValueError,
    naming it, for one the executor cannot take) and stop check; `release` once it has ended
    (finished, rejected or aborted) drops what the executor kept for it."""

    def register(self, request: Request, seed: int | None = None, stop: StopCheck | None = None) -> None: ...

    def release(self, group_id: int) -> None: ...


class RepeatExecutor(Executor, Protocol):
    """An executor that can run windows: it knows how long each sequence runs and prices
    iterations without running them (the simulated executor)."""

    def remaining(self, plan: RepeatPlan | DecodeStepPlan) -> list[int]: ...

    def price_repeat(self, plan: RepeatPlan) -> np.ndarray | list[float]:
        """The plan's `steps` iterations' durations (a new list or array at each call: the window
        keeps and extends it)."""
        ...

    def price(self, comp: StepComposition) -> float: ...


@dataclass
class Step:
    """An iteration begun at `start`: its plan, composition and the executor's result (None when
    the plan was empty: nothing ran, no time passes)."""

    start: float
    plan: StepPlan
    comp: StepComposition | None = None
    result: StepResult | None = None

    @property
    def idle(self) -> bool:
        return self.result is None


@dataclass(slots=True)
class Window:
    """Iterations applied at once from `start`: ends[i] = ends[i - 1] + durations[i] (from
    `start`), the clock must land on exactly ends[-1]; the last one is the preempting iteration
    when `exhaustion`. Empty when that iteration preempted the whole batch (no time passes).
    Its log rows, written when it completes (the waiting column then counts the requests routed
    to the replica meanwhile): the first `steps` iterations are the plain decodes `repeat` says
    (with `waiting`, the queue's length or one per iteration, and `prefix_hits`), then, when
    `row_comp` is not None, one row of that composition (IterationLog.add's arguments, in fields
    `row_*`: typed numbers, not a list of Python objects). `decode`: a decode step's iteration,
    begun (ReplicaStep._decode_step) and ended by complete_window. `finished`: the groups it
    finished, all at its last end (complete_window returns them)."""

    start: float
    ends: list[float]
    durations: list[float]
    exhaustion: bool
    steps: int = 0
    repeat: RepeatResult | None = None
    waiting: int | list[int] = 0
    prefix_hits: int = 0
    row_comp: StepComposition | None = None
    row_start: float = 0.0
    row_duration: float = 0.0
    row_preempted: int = 0
    row_waiting: int = 0
    row_running: int = 0
    row_memory: MemoryBreakdown | None = None
    row_prefix_hits: int = 0
    decode: DecodeStepResult | None = None
    finished: list[SequenceGroup] = field(default_factory=list)

    def __init__(self, start: float, ends: list[float], durations: list[float], exhaustion: bool) -> None:
        # written out, not generated: one per window in the compiled kernel (see policies/plan.py)
        self.start = start
        self.ends = ends
        self.durations = durations
        self.exhaustion = exhaustion
        self.steps = 0
        self.repeat = None
        self.waiting = 0
        self.prefix_hits = 0
        self.row_comp = None
        self.row_start = self.row_duration = 0.0
        self.row_preempted = self.row_waiting = self.row_running = self.row_prefix_hits = 0
        self.row_memory = None
        self.decode = None
        self.finished = []


class ReplicaStep:
    """A replica's scheduler and executor stepped one iteration, or one window, at a time, each
    iteration recorded in `log`. `routed`: arrivals read this replica's state (a router picks by
    it), so windows end before every arrival, unless the router reads only outstanding counts
    (`counts_only`). Counts: `stepped` iterations, `windows` and the iterations they covered
    (`skipped`, of which `exhaustions` preempted)."""

    def __init__(self, scheduler: Scheduler, executor: Executor, log: IterationLog | None = None,
                 routed: bool = False, counts_only: bool = False) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.log = log if log is not None else IterationLog()
        self.routed = routed
        self.counts_only = counts_only
        self.stepped = self.windows = self.skipped = self.exhaustions = 0
        # the duration of the last iteration stepped or skipped (0: none yet); see begin_window
        self._recent_duration = 0.0

    def begin(self, now: float) -> Step:
        plan = self.scheduler.schedule(now)
        if plan.is_empty:
            return Step(now, plan)
        comp = plan.composition()
        return Step(now, plan, comp, self.executor.execute(plan, comp))

    def complete(self, step: Step, end: float) -> list[SequenceGroup]:
        """Apply the executed step at time `end` (its result's duration is what the log records:
        the cost model's, or the measured wall time the caller set). Returns the finished groups."""
        sched, result, comp = self.scheduler, step.result, step.comp
        assert result is not None and comp is not None, "complete() is for a step that ran (not idle)"
        finished = sched.on_step_done(step.plan, result, end)
        self.log.add(step.start, result.duration, comp, len(step.plan.preempted), len(sched.waiting),
                     len(sched.running), sched.memory(), sched.prefix_hits)
        self.stepped += 1
        self._recent_duration = result.duration
        return finished

    # ---------------------------------------------------------------- windows
    def begin_window(self, now: float, next_arrival: float = math.inf,
                     queued: Queued | None = None) -> Window | None:
        """Apply at once the coming iterations that are certain, or None (step the next one).

        `next_arrival`: when the next request not yet delivered arrives (anywhere, behind a
        router). `queued(times)`: how many requests not yet delivered join this replica's waiting
        queue by each time (the log's waiting column; none when omitted). The window is applied
        to the scheduler before the caller's clock passes over it: nothing reads the
        replica meanwhile but arrivals, which it ends before, which cannot be admitted in it, or
        which read only its outstanding count (`departing` keeps the window's finishes in it until
        the window ends), or, in a decode step (applied in two halves), which read the policy's
        state or the count as stepping leaves them. Its rows are logged by `complete_window`."""
        sched = self.scheduler
        if not sched.running:
            return None
        # windows end before every arrival when it reads more of this replica than its count;
        # a decode step passes arrivals unless the router reads the replica's state (its two
        # halves leave the policy and the count as stepping's iteration does while it runs)
        router_reads = self.routed and not self.counts_only
        reads_state = router_reads or sched.queues_by_state
        if reads_state and next_arrival - now < self._recent_duration:
            # such a window must end two iterations before the next arrival (_stop_at_arrivals),
            # which is nearer than one recent iteration: most likely no window, so do not ask
            # (stepping gives the same result, so a guess costs only time)
            return None if router_reads else self._decode_step(now, next_arrival, queued)
        window = self._window(now, next_arrival, queued, reads_state)
        if window is None and (not router_reads or next_arrival == math.inf):
            window = self._decode_step(now, next_arrival, queued)
        return window

    def _window(self, now: float, next_arrival: float, queued: Queued | None,
                reads_state: bool) -> Window | None:
        """begin_window's plain decodes (and the preempting iteration after them), or None."""
        sched = self.scheduler
        plan = sched.plan_repeat(now)
        if plan is None:
            return None
        executor: RepeatExecutor = self.executor  # type: ignore[assignment]
        if plan.remaining is None:  # the dearest question, asked once all else allows a window
            plan.remaining = executor.remaining(plan)
        if not _stop_at_finish(plan):
            return None
        priced = executor.price_repeat(plan)
        # plain floats: windows are mostly a few iterations, where numpy's per-call cost dominates;
        # the ends add in order, as stepping's clock does (and as numpy's cumsum did); a loop, as
        # list(accumulate(...)) is a generic iterator compiled. A list is the executor's own, new at
        # each call (RepeatExecutor): kept, not copied
        durations: list[float] = priced if isinstance(priced, list) else priced.tolist()
        ends: list[float] = []
        end = now
        for d in durations:
            end = end + d
            ends.append(end)
        k = _stop_at_arrivals(plan, ends, now, next_arrival, sched, reads_state)
        if k is None:
            return None
        if k < plan.steps:
            plan.steps, ends, durations = k, ends[:k], durations[:k]
        if k:
            # arrivals during the window join the queue behind a blocked head: count them in
            num_waiting = len(sched.waiting)
            waiting: int | list[int] = num_waiting
            if queued is not None:
                arrived = queued(ends)
                if arrived[-1]:  # counts never fall: else none arrives in the window
                    waiting = [num_waiting + a for a in arrived]
            end = ends[-1]
        else:
            end = now
        done0 = len(sched.done)
        res = sched.apply_repeat(plan, end, executor.price)
        window = Window(now, ends, durations, res.exhaustion is not None)
        if k:
            window.steps, window.repeat, window.waiting, window.prefix_hits = k, res, waiting, sched.prefix_hits
            self._recent_duration = durations[-1]
        if res.exhaustion is not None:
            duration = res.exhaustion_duration
            end_x = end + duration  # the sum the scheduler finished its groups at
            waiting_x = len(sched.waiting) + (queued((end_x,))[0] if queued is not None else 0)
            window.row_comp, window.row_start, window.row_duration = res.exhaustion, end, duration
            window.row_preempted, window.row_waiting, window.row_running = res.num_preempted, waiting_x, len(sched.running)
            window.row_memory, window.row_prefix_hits = sched.memory(), sched.prefix_hits
            ends.append(end_x)  # the log takes the plain decodes' rows from the first `steps`
            durations.append(duration)
        window.finished = sched.done[done0:]  # all at the window's last end (nothing is rejected in it)
        sched.departing = len(window.finished)
        return window

    def _decode_step(self, now: float, next_arrival: float, queued: Queued | None) -> Window | None:
        """The next iteration applied as a one-iteration window, when the scheduler offers it (a
        batch of plain decodes that preempts nothing, admitting and rejecting as stepping would),
        or None. Applied in stepping's two halves: its start here, at `now` (its decisions:
        admissions, rejections, blocks, price), its end in `complete_window` once the caller's
        clock is there (the policy told the service, finishes). In between the replica is as
        stepping leaves it while the iteration runs, so an arrival during it (or at its end, which
        lands first) reads the policy's state and the outstanding count exactly as stepping's."""
        sched = self.scheduler
        plan = sched.plan_decode_step()
        if plan is None:
            return None
        executor: RepeatExecutor = self.executor  # type: ignore[assignment]
        plan.remaining = executor.remaining(plan)
        res = sched.apply_decode_step(plan, now, executor.execute)
        duration = res.result.duration
        end = now + duration
        # the log's waiting column: the queue after the admissions, with the arrivals that join
        # it by the end (counted now: the feed moves on meanwhile)
        waiting = len(sched.waiting)
        if queued is not None and next_arrival <= end:  # else none arrives by its end
            waiting += queued((end,))[0]
        window = Window(now, [end], [duration], False)
        # running, memory and prefix hits are read after the finishes (complete_window)
        window.row_comp, window.row_start, window.row_duration, window.row_waiting = res.comp, now, duration, waiting
        window.decode = res
        self._recent_duration = duration
        return window

    def complete_window(self, window: Window, joined: Sequence[float] = ()) -> list[SequenceGroup]:
        """The window's iterations have passed (the caller's clock is at window.ends[-1], the
        arrivals due by then have landed): apply a decode step's end, and log them. `joined`: the
        arrival times, in order, of requests that joined this replica's waiting queue meanwhile
        and that the `queued` given to begin_window did not count (a routed replica's); each
        counts in the rows of iterations ending at or after it. Returns the groups the window
        finished, as `complete` returns a step's."""
        sched = self.scheduler
        sched.departing = 0
        res, decode = window.repeat, window.decode
        if decode is not None:  # the decode step's end: its finishes, then its row's columns after them
            window.finished = sched.complete_decode_step(decode, window.ends[0])
            window.row_running, window.row_memory, window.row_prefix_hits = (
                len(sched.running), sched.memory(), sched.prefix_hits)
        if res is not None:
            k, waiting = window.steps, window.waiting
            if joined:
                base = [waiting] * k if isinstance(waiting, int) else waiting
                waiting = [w + bisect_right(joined, e) for w, e in zip(base, window.ends)]
            self.log.add_window(window.start, window.ends, window.durations, k, res, waiting, window.prefix_hits)
        comp, memory = window.row_comp, window.row_memory
        if comp is not None:
            assert memory is not None
            waiting_x = window.row_waiting + (bisect_right(joined, window.ends[-1]) if joined else 0)
            self.log.add(window.row_start, window.row_duration, comp, window.row_preempted, waiting_x,
                         window.row_running, memory, window.row_prefix_hits)
        self.windows += 1
        self.skipped += len(window.ends)
        self.exhaustions += window.exhaustion
        return window.finished


def _stop_at_finish(plan: RepeatPlan) -> bool:
    """Narrow the offer to end with the first finish (that iteration included), or keep its
    block bound when blocks run out first; False when no window of 2 or more iterations (or one
    that ends in a preempting iteration the scheduler applies) remains."""
    first_finish = plan.first_finish()
    if first_finish < 1:
        return False
    if first_finish <= plan.steps:
        plan.steps, plan.exhausts = int(first_finish), False  # finite here
        return first_finish >= 2
    return plan.exhausts or plan.steps >= 2  # else the preempting iteration is stepped, after these


def _stop_at_arrivals(plan: RepeatPlan, ends: list[float], start: float, next_arrival: float,
                      sched: Scheduler, reads_state: bool) -> int | None:
    """How many of the plan's iterations (ending at `ends`) stay certain given arrivals and the
    policy's wake time: the first iteration starting at or after a time when something could be
    admitted may not be skipped; clears plan.exhausts when the window is cut or arrivals read the
    replica (the preempting iteration, priced only once applied, may pass an arrival: it ends a
    routed window only when no arrival is left). None when fewer than 2 iterations remain and no
    preempting one ends the window."""
    k = plan.steps
    if reads_state:
        # every arrival reads this replica's (or its policy's) state: finish the window before it
        safe = _bisect_left(ends, next_arrival, len(ends))
        # and the first iteration starting at or after the policy's wake time
        safe = min(safe, _bisect_left(ends, sched.wake_time(start), len(ends) - 1) + 1)
        if safe < k or next_arrival != math.inf:
            plan.exhausts = False  # stepped instead: its end may pass an arrival (priced once applied)
        k = min(k, safe)
        return k if k >= 2 or plan.exhausts else None
    if not k:  # only the preempting iteration, which admits nothing whatever arrives
        return k
    # the first iteration starting at or after `limit` could admit (or reject) something: an
    # arrival, when nothing waits or an arrival may jump the queue; the policy's wake time
    limit = sched.wake_time(start)
    if not sched.waiting or not sched.fifo_queue:
        limit = min(limit, next_arrival)
    safe = _bisect_left(ends, limit, len(ends) - 1) + 1
    if safe < k:
        plan.exhausts = False
        return safe if safe >= 2 else None
    return k


def _bisect_left(ends: list[float], x: float, hi: int) -> int:
    """bisect_left(ends, x, 0, hi) for ascending `ends`: the common answer (every end before `x`,
    as when nothing can be admitted before the window's last iteration) read from the last one,
    without the call (a generic one compiled). No ends (hi -1: bisect's own default, the whole
    empty list): 0."""
    if hi <= 0:
        return 0
    if ends[hi - 1] < x:
        return hi
    return bisect_left(ends, x, 0, hi)
