"""The SimPy model: an arrival process feeding replicas whose engine processes each run the serving
loop of DESIGN.md with a scheduler from policies/ and a simulated executor.

    arrivals ──> router ──> replica r: scheduler.waiting ──> engine: plan -> execute (cost model) -> on_step_done

With one replica there is no router: every request goes to it.

When nothing can change for the next k iterations (pure decodes, no arrival that could be admitted,
no finish, no memory pressure), the engine skips ahead k iterations at once, and through the
iteration after them too when that one runs out of blocks (it preempts, so it admits nothing); the
result is the same, bit for bit, as stepping them one by one (tests/test_sim.py checks this).
With several replicas a window also ends before the next arrival anywhere: the router reads every
replica's state at each arrival, and must find it where stepping would have left it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import simpy

from policies.metrics import IterationLog
from policies.request import Request
from policies.router import Router
from policies.scheduler import Scheduler
from policies.step import ReplicaStep
from policies.vllm_scheduler import VllmScheduler  # the skip-ahead protocol's type
from sim.executor import SimulatedExecutor


@dataclass
class ArrivalFeed:
    """The requests of a trace in arrival order, delivered by `arrival_process`."""

    requests: list[Request]
    next_index: int = 0

    def __post_init__(self) -> None:
        self.arrivals = np.array([r.arrival for r in self.requests], dtype=float)
        self._queued: np.ndarray | None = None

    def arrived_by(self, times: np.ndarray) -> np.ndarray:
        """How many requests have arrived at each time (an arrival at exactly t counts)."""
        return np.searchsorted(self.arrivals, times, side="right")

    def queued_by(self, times: np.ndarray, scheduler: Scheduler) -> np.ndarray:
        """How many of the requests not yet delivered arrive by each time and join `scheduler`'s
        waiting queue (those it refuses on arrival never wait). For a single replica's feed."""
        if self._queued is None:  # cumulative count of requests that would queue, first i requests
            refuse = scheduler.refusal_on_arrival
            self._queued = np.concatenate(([0], np.cumsum([refuse(r) is None for r in self.requests])))
        return self._queued[self.arrived_by(times)] - self._queued[self.next_index]

    def next_arrival(self) -> float:
        return self.requests[self.next_index].arrival if self.next_index < len(self.requests) else math.inf

    @property
    def exhausted(self) -> bool:
        return self.next_index >= len(self.requests)


class Replica:
    """One model replica: a scheduler, a simulated executor and the iteration log."""

    def __init__(self, env: simpy.Environment, scheduler: Scheduler, executor: SimulatedExecutor,
                 fast_forward: bool = True, debug: bool = False,
                 on_progress: Callable[[float, int], None] | None = None,
                 observer: Callable[[float, float, Scheduler], None] | None = None,
                 index: int = 0, routed: bool = False,
                 on_finish: Callable[[list], None] | None = None) -> None:
        self.env = env
        self.on_finish = on_finish  # sees the groups each stepped iteration finishes
        self.index = index
        # behind a router, other replicas' arrivals read this one's state: windows stop before them
        self.routed = routed
        self.scheduler = scheduler
        self.executor = executor
        # an observer sees every iteration (start, duration, scheduler after it), so nothing is skipped
        self.observer = observer
        self.fast_forward = fast_forward and scheduler.supports_skip_ahead and observer is None
        self.debug = debug
        self.log = IterationLog()
        self.step = ReplicaStep(scheduler, executor, self.log)  # the loop's one iteration, clock-agnostic
        self.wakeup = env.event()
        self.on_progress = on_progress
        self.stepped = 0          # iterations scheduled one at a time
        self.windows = 0          # skip-ahead windows, and the iterations they covered
        self.skipped = 0
        self.exhaustions = 0      # preempting iterations applied inside windows

    def deliver(self, request: Request) -> None:
        self.scheduler.add_request(request)
        if not self.wakeup.triggered:
            self.wakeup.succeed()


def arrival_process(env: simpy.Environment, feed: ArrivalFeed, replicas: list[Replica],
                    router: Router | None = None):
    """Each request enters a replica's waiting queue at its arrival time: the router's pick, or the
    only replica."""
    schedulers = [r.scheduler for r in replicas]
    while not feed.exhausted:
        request = feed.requests[feed.next_index]
        if request.arrival > env.now:
            yield env.timeout(request.arrival - env.now)
        feed.next_index += 1
        i = router.route(request, schedulers) if router is not None else 0
        if not 0 <= i < len(replicas):
            raise RuntimeError(f"router {router.name if router else '-'} picked replica {i} of {len(replicas)}")
        replicas[i].deliver(request)


def engine_process(env: simpy.Environment, replica: Replica, feed: ArrivalFeed):
    """The serving loop: schedule, execute, apply; idle until an arrival when there is nothing to do."""
    sched = replica.scheduler
    while True:
        # let every arrival due at this instant land first (they were scheduled before us); the
        # arrival process is the only other actor, so with none due the yield can be spared
        if feed.next_arrival() <= env.now:
            yield env.timeout(0)
        if not sched.has_unfinished():
            if feed.exhausted:
                return
            replica.wakeup = env.event()
            yield replica.wakeup
            continue
        if replica.fast_forward and (yield from _skip_ahead(env, replica, feed)):
            continue
        step = replica.step.begin(env.now)
        if step.idle:
            if step.plan.rejected or step.plan.preempted:  # the queues changed: look again
                continue
            if feed.exhausted and not sched.running:
                _fail_stuck(sched)
            replica.wakeup = env.event()
            yield replica.wakeup
            continue
        yield env.timeout(step.result.duration)  # simulated time passes: the cost model's duration
        finished = replica.step.complete(step, env.now)
        if finished and replica.on_finish is not None:
            replica.on_finish(finished)
        replica.stepped += 1
        if replica.observer is not None:
            replica.observer(step.start, step.result.duration, sched)
        if replica.debug:
            _check(sched)
        if replica.on_progress is not None:
            replica.on_progress(env.now, len(sched.done))


def _skip_ahead(env: simpy.Environment, replica: Replica, feed: ArrivalFeed):
    """Apply the coming iterations that are certain (see VllmScheduler.decode_horizon) at once:
    k plain decodes, then, if blocks run out in the next, that preempting decode too."""
    sched: VllmScheduler = replica.scheduler  # type: ignore[assignment]
    ex = replica.executor
    if not sched.running:
        return False
    horizon = sched.decode_horizon(lambda: ex.remaining(sched.running), env.now)
    if horizon is None:
        return False
    k, exhausts = horizon.steps, horizon.exhausts
    start = env.now
    b = len(sched.running)
    durations = ex.decode_step_times(b, horizon.context_tokens, k)
    ends = np.cumsum(np.concatenate(([start], durations)))[1:]
    if replica.routed or sched.queues_by_state:
        # every arrival reads this replica's (or its policy's) state: finish the window before it
        safe = int(np.searchsorted(ends, feed.next_arrival(), side="left"))
        # and the first iteration starting at or after the policy's wake time (see below)
        safe = min(safe, int(np.searchsorted(ends[:-1], sched.wake_time(start), side="left")) + 1)
        exhausts = False  # stepped instead: its end may pass an arrival
        if safe < k:
            k, ends, durations = safe, ends[:safe], durations[:safe]
        if k < 2:
            return False
    elif k:
        # the first iteration starting at or after `limit` could admit (or reject) something: an
        # arrival, when nothing waits or an arrival may jump the queue; the policy's wake time
        limit = sched.wake_time(start)
        if not sched.waiting or not sched.policy.arrival_order:
            limit = min(limit, feed.next_arrival())
        safe = int(np.searchsorted(ends[:-1], limit, side="left")) + 1
        if safe < k:
            k, exhausts = safe, False
            if k < 2:
                return False
            ends, durations = ends[:k], durations[:k]
    if k:
        waiting = len(sched.waiting) + feed.queued_by(ends, sched)
        cols = sched.fast_forward(horizon, k, float(ends[-1]))
        replica.log.add_many({
            "start": np.concatenate(([start], ends[:-1])), "duration": durations,
            "num_seqs": cols["num_seqs"], "decode_tokens": cols["num_seqs"],
            "context_tokens": cols["context_tokens"], "waiting": waiting,
            "running": cols["running"], "kv_token_states": cols["kv_token_states"],
            "kv_internal_frag": cols["kv_internal_frag"], "kv_free": cols["kv_free"],
            "prefix_hits": np.full(k, sched.prefix_hits),
        })
    end_times, step_times = ends.tolist(), durations.tolist()
    if exhausts:  # stepping would schedule this one: it preempts, so nothing else can happen in it
        comp, preempted = sched.exhaustion_step()
        duration = ex.price(comp)
        if comp.num_decode_seqs:  # else the plan was empty: no iteration, no time (as engine_process)
            step_start = end_times[-1] if k else start
            end = step_start + duration
            sched.finish_plain(horizon.remaining, k + 1, end)
            waiting = len(sched.waiting) + int(feed.queued_by(np.array([end]), sched)[0])
            replica.log.add(step_start, duration, comp, preempted, waiting, len(sched.running), sched.memory(),
                            sched.prefix_hits)
            end_times.append(end)
            step_times.append(duration)
            k += 1
            replica.exhaustions += 1
    yield from _advance(env, start, end_times, step_times)
    if replica.debug:
        sched.settle()  # the sequences' own counters are owed until read (see fast_forward)
        _check(sched)
    replica.windows += 1
    replica.skipped += k
    if replica.on_progress is not None:
        replica.on_progress(env.now, len(sched.done))
    return True


def _advance(env: simpy.Environment, start: float, end_times: list[float], step_times: list[float]):
    """Move the clock from `start` over the skipped iterations to exactly the time stepping would
    reach: end_times[i] = end_times[i - 1] + step_times[i] (from `start`). One timeout usually
    lands there; when float rounding makes that sum unreachable from `start` in one addition, land
    on an earlier iteration's end and step the last ones."""
    for j in range(len(end_times) - 1, max(len(end_times) - 9, -1), -1):
        target = end_times[j]
        delay = target - start
        while start + delay < target:
            delay = math.nextafter(delay, math.inf)
        while start + delay > target:
            delay = math.nextafter(delay, -math.inf)
        if start + delay == target:
            yield env.timeout(delay)
            for d in step_times[j + 1:]:
                yield env.timeout(d)
            return
    for d in step_times:
        yield env.timeout(d)


def _check(sched: Scheduler) -> None:
    sched.check_invariants()


def _fail_stuck(sched: Scheduler) -> None:
    head = sched.waiting[0] if sched.waiting else None
    raise RuntimeError(f"scheduler {sched.name} made no progress with nothing running; waiting head: {head}")
