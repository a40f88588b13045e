"""The SimPy model: an arrival process feeding replicas whose engine processes each run the serving
loop of docs/design.md with a scheduler from policies/ and a simulated executor.

    arrivals ──> router ──> replica r: scheduler.waiting ──> engine: plan -> execute (cost model) -> on_step_done

With one replica there is no router: every request goes to it.

When nothing can change for the next k iterations (pure decodes, no arrival that could be admitted,
no finish, no memory pressure), the engine skips ahead k iterations at once, and through the
iteration after them too when that one runs out of blocks (it preempts, so it admits nothing); the
result is the same, bit for bit, as stepping them one by one (tests/test_sim.py checks this).
The window is the replica step's (policies/step.py `ReplicaStep.begin_window`: the scheduler's
RepeatPlan, priced by the executor in one call, cut at the first stop condition, applied by the
scheduler at once and logged); this module only moves the SimPy clock over its end times, landing
exactly where stepping's additions would (`_delays`). With several replicas the router reads every
replica at each arrival and must find it as stepping would have left it: a window ends before the
next arrival anywhere, unless the router reads only outstanding counts (round-robin, random,
least-loaded, prefix-affinity: it is handed policies.router.ReplicaCounts views), which a window
changes only at its last end.

An arrival is processed before anything else due at the same instant (`ArrivalTimeout`): a
request arriving exactly when an iteration ends is routed before that iteration's finishes are
counted, and waits in the queue the next iteration is scheduled from. In a cluster whose only
processes are the engines and the arrivals, arrivals are delivered lazily (`Dispatch`): each
engine event first delivers the arrivals due by its instant, and an arrival is an event of its own
only while a replica is idle (only it can wake one), with the same tables.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from heapq import heappop, heappush
from itertools import accumulate
from typing import Any, Protocol

import numpy as np
import simpy
from simpy.events import NORMAL, PENDING, URGENT

from policies.least_loaded import LeastLoaded
from policies.request import Request
from policies.request_rows import RequestRows
from policies.router import SCHEDULER, LeastLoadedRouter, ReplicaViews, Router, replica_views
from policies.scheduler import Scheduler
from policies.step import ReplicaStep


class ArrivalFeed:
    """The requests of a trace in arrival order, delivered by `arrival_process` (or Dispatch).
    A delivered request is let go (`pop_next`), to be freed with its group once that finishes:
    invariant, requests[i] is None exactly for i < next_index."""

    def __init__(self, requests: list[Request]) -> None:
        self.requests: list[Request | None] = list(requests)
        self.next_index = 0
        # plain floats, searched with bisect: windows ask about a few times at once, where numpy's
        # per-call cost dominates (bisect_right is searchsorted's side="right")
        self.arrivals = [r.arrival for r in requests]
        self._queued: list[int] | None = None

    def pop_next(self) -> Request:
        """The next request, handed over (the feed holds it no more)."""
        i = self.next_index
        request = self.requests[i]
        assert request is not None  # not delivered yet
        self.requests[i] = None
        self.next_index = i + 1
        return request

    def arrived_by(self, times: Sequence[float]) -> list[int]:
        """How many requests have arrived at each time (an arrival at exactly t counts)."""
        arrivals = self.arrivals
        return [bisect_right(arrivals, t) for t in times]

    def queued_by(self, times: Sequence[float], scheduler: Scheduler) -> list[int]:
        """How many of the requests not yet delivered arrive by each time and join `scheduler`'s
        waiting queue (those it refuses on arrival never wait). For a single replica's feed."""
        queued = self._queued
        if queued is None:  # cumulative count of requests that would queue, first i requests (the
            # delivered ones count 0: only differences from next_index on are read)
            refuse = scheduler.refusal_on_arrival
            queued = self._queued = list(accumulate((r is not None and refuse(r) is None for r in self.requests),
                                                    initial=0))
        base, arrivals = queued[self.next_index], self.arrivals
        return [queued[bisect_right(arrivals, t)] - base for t in times]

    def next_arrival(self) -> float:
        return self.arrivals[self.next_index] if self.next_index < len(self.arrivals) else math.inf

    @property
    def exhausted(self) -> bool:
        return self.next_index >= len(self.requests)


class Arrivals(Protocol):
    """What a replica's engine process asks of its arrivals: an ArrivalFeed, or anything shaped like
    it (sim.disagg's decode replicas, whose arrivals are not known in advance). A protocol, not the
    class: the compiled engine (build_compiled.py) checks argument types at run time."""

    @property
    def exhausted(self) -> bool: ...

    def next_arrival(self) -> float: ...

    def queued_by(self, times: Sequence[float], scheduler: Scheduler) -> list[int]: ...


class ArrivalTimeout(simpy.Timeout):
    """A timeout processed before every other event due at the same instant (SimPy orders events
    of one instant by priority, then by creation: arrivals get the urgent priority so that ties
    with iteration ends never depend on which event happened to be created first)."""

    def __init__(self, env: simpy.Environment, delay: float) -> None:
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        # Timeout's own initialization (SimPy inlines it the same way), at the urgent priority
        self.env = env
        self.callbacks = []
        self._value = None
        self._delay = delay
        self._ok = True
        env.schedule(self, simpy.events.URGENT, delay)


class Wait:
    """The event an Alarm puts in SimPy's queue: shaped as a SimPy event where `Environment.step`
    and `Process._resume` read one (`callbacks`, `_ok`, `_value`: a pending event that succeeds
    with None), a native object so that Alarm, `Driven` and `run_to_end` set and read it without
    generic attribute calls (~500 instructions a wait). Nothing but its process waits on it."""

    def __init__(self) -> None:
        self.callbacks: list[Any] | None = None
        self._ok = True
        self._value: Any = None


class Alarm:
    """One process's timeouts as one event (a Wait), re-armed for each wait: a new simpy.Timeout per
    wait costs a bound-class call and an interpreted `__init__` (~4k instructions), re-arming a
    fresh callback list and the queue entry a Timeout makes, at the normal priority. The entry is
    pushed here as SimPy 4's `Environment.schedule` writes it (its interpreted call, and the
    generic reads of the queue and the id counter, cost ~2k instructions a wait): SimPy is pinned
    < 5 (pyproject.toml), and tests/test_simpy_internals.py fails if its queue changes. Invariant:
    armed at most once at a time (the process yields it, and re-arms it only once it has been
    processed and resumed the process)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.event = Wait()
        # the environment's event queue and event ids (each made once, in Environment.__init__);
        # Any: the entries are pushed as they are, not unboxed and boxed again by compiled code;
        # the counter's own __next__ (compiled, next(counter) looks the builtin up at every call)
        self.queue: list[Any] = env._queue
        self.next_eid: Callable[[], Any] = env._eid.__next__
        self.priority: Any = NORMAL

    def after(self, delay: float) -> Wait:
        """The event, due `delay` from now."""
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        event = self.event
        event.callbacks = []  # processed (or never armed): SimPy set them to None
        # env.schedule(event, NORMAL, delay)
        heappush(self.queue, (self.env._now + delay, self.priority, self.next_eid(), event))
        return event


class Driven:
    """A process (a generator of SimPy events, as `env.process` takes) resumed by `run_to_end` with
    a native call instead of SimPy's interpreted `Process._resume` (~2.5k instructions an event).
    Started as `Process` starts one (an urgent event at the current instant, from the same id
    counter), resumed with each event it yields, in the same order. Not an event itself: nothing
    can wait for it to end, and an exception it raises leaves `run_to_end` as it is (SimPy would
    raise a copy of it). Invariant: the generator yields only pending events that succeed, and
    ignores what they carry (the engine process waits on its alarm and its wakeup events)."""

    def __init__(self, env: simpy.Environment, process: Iterator[Any]) -> None:
        self.process = process
        self.next_event: Callable[[], Any] = process.__next__  # (next() is a builtin looked up, compiled)
        start = simpy.Event(env)  # Process's Initialize event
        start._ok, start._value, start.callbacks = True, None, [self]
        env.schedule(start, URGENT)

    def __call__(self, event: Any) -> None:  # any other caller of the event's callbacks
        self.resume()

    def resume(self) -> None:
        try:
            event = self.next_event()
        except StopIteration:
            return
        if isinstance(event, Wait):  # its own alarm: a native store
            assert event.callbacks is not None  # pending (Alarm.after)
            event.callbacks.append(self)
        else:
            callbacks: list[Any] = event.callbacks
            callbacks.append(self)


def run_to_end(env: simpy.Environment) -> None:
    """`env.run()`: every event in order, each event's callbacks called as `Environment.step` calls
    them, a failed event not defused raised as it raises it, and `Driven` processes resumed by a
    native call (with the interpreted `step`, ~5k instructions an event to ~1.5k compiled). Nothing
    here stops a run early (`StopSimulation` needs `until`, which this does not take)."""
    queue: list[Any] = env._queue  # Environment.step's pop, as tests/test_simpy_internals.py pins
    while queue:
        # (time, priority, id, event), as Environment.schedule pushes it: typed, its items read
        # natively (a generic index each otherwise)
        entry: tuple[Any, Any, Any, Any] = heappop(queue)
        env._now = entry[0]
        event = entry[3]
        if isinstance(event, Wait):  # an alarm (native reads; it never fails)
            callbacks = event.callbacks
            event.callbacks = None
            assert callbacks is not None  # armed once per push (Alarm's invariant)
            _call_back(callbacks, event)
            continue
        callbacks = event.callbacks
        event.callbacks = None
        _call_back(callbacks, event)
        if not event._ok and not hasattr(event, "_defused"):
            exc = type(event._value)(*event._value.args)
            exc.__cause__ = event._value
            raise exc


def _call_back(callbacks: list[Any], event: Any) -> None:
    """An event's callbacks called in order, a Driven process's natively."""
    for callback in callbacks:
        if isinstance(callback, Driven):
            callback.resume()
        else:
            callback(event)


class Replica:
    """One model replica in the SimPy model: a replica step (policies.replica_config.build_replica:
    its scheduler, a simulated executor and the iteration log) and the hooks of its engine process."""

    def __init__(self, env: simpy.Environment, step: ReplicaStep, fast_forward: bool = True, debug: bool = False,
                 on_progress: Callable[[float, int], None] | None = None,
                 observer: Callable[[float, float, Scheduler], None] | None = None,
                 index: int = 0, on_finish: Callable[[list], None] | None = None,
                 rows: RequestRows | None = None) -> None:
        self.env = env
        self.on_finish = on_finish  # sees the groups each iteration or window finishes, at its end
        self.index = index
        # the loop's one iteration (and its windows), clock-agnostic; behind a router, other
        # replicas' arrivals read this one's state, so windows stop before them (or, when the
        # router reads only counts, run across them: the step's `routed`, `counts_only`)
        self.step = step
        self.scheduler = step.scheduler
        self.executor = step.executor
        self.log = step.log
        # an observer sees every iteration (start, duration, scheduler after it), so nothing is skipped
        self.observer = observer
        self.fast_forward = fast_forward and observer is None
        self.debug = debug
        # arrival times of requests routed here and queued while a window passes (its log rows count them)
        self.joined: list[float] | None = None
        self.wakeup = env.event()
        self.on_progress = on_progress
        # where the engine process hands the scheduler's finished groups over as the run goes (their
        # objects let go); None: they stay in scheduler.done
        self.rows = rows

    def hand_over(self) -> None:
        """Move the scheduler's finished groups into `rows` (which lets them go) once a chunk of them
        has gathered; called by the engine process between its steps, when nothing holds an index
        into `done` (policies.step slices it within one call)."""
        rows, sched = self.rows, self.scheduler
        if rows is not None and len(sched.done) >= rows.chunk:
            rows.take(sched.release_done())

    # iterations scheduled one at a time; skip-ahead windows, the iterations they covered, and
    # the preempting iterations among those
    @property
    def stepped(self) -> int:
        return self.step.stepped

    @property
    def windows(self) -> int:
        return self.step.windows

    @property
    def skipped(self) -> int:
        return self.step.skipped

    @property
    def exhaustions(self) -> int:
        return self.step.exhaustions

    def deliver(self, request: Request) -> None:
        group = self.scheduler.add_request(request)
        if self.joined is not None and group.rejected is None:
            self.joined.append(request.arrival)
        wakeup = self.wakeup
        if wakeup._value is PENDING:  # not triggered (`triggered` is an interpreted property)
            wakeup.succeed()


class Dispatch:
    """Routes the feed's arrivals to the replicas, each as the one-event-per-arrival model does it
    at its own instant: `due` is the clock at which the next arrival is handled there (the
    arrival time, reached by SimPy's sum of the previous one's clock and the delay between them).

    Invariant (lazy delivery, `run_replicas`): an arrival due by the time of an engine event is
    delivered before that event does anything (`deliver_due` at every resume). Between two
    engine events nothing but arrivals changes a replica, so the router reads at delivery what it
    would have read at the arrival's own instant. Only a delivery wakes an idle replica, at the
    arrival's instant: while one is idle (`idle` > 0), `lazy_arrival_process` lands on every
    arrival's `due`; while none is, it waits (`parked`), and arrivals cost no event of their own."""

    def __init__(self, env: simpy.Environment, feed: ArrivalFeed, replicas: list[Replica],
                 router: Router | None = None) -> None:
        self.env = env
        self.feed = feed
        self.replicas = replicas
        self.router = router
        # the view of each replica the router declares it reads (policies.router.replica_views)
        self.views = replica_views(router, [r.scheduler for r in replicas]) if router is not None else []
        # a router handed the schedulers themselves may read any sequence's own fields: made exact
        # here, the one place (replicas are between iterations at such an arrival: windows end before
        # it, and the iteration after a window settles the batch today; this keeps it so if that changes)
        self.whole = [r.scheduler for r in replicas] if router is not None and router.reads == SCHEDULER else []
        # a user's router may answer anything: its answer is an object here (the compiled engine would
        # otherwise check it is the int Router.route declares, before _replica_index could name it)
        self.route: Callable[[Request, list], object] | None = router.route if router is not None else None
        # a least-loaded router's own `route` (a subclass's override is called as any router's):
        # its picker asked here with the kept loads list, as LeastLoadedRouter.route asks it,
        # without an interpreted call at every arrival
        self.picker: LeastLoaded | None = None
        self.loads: list[int] | None = None
        views = self.views
        if (isinstance(router, LeastLoadedRouter) and type(router).route is LeastLoadedRouter.route
                and isinstance(views, ReplicaViews)):
            self.picker, self.loads = router.picker, views.loads
        self.idle = 0  # replicas waiting for an arrival (engine_process)
        self.parked: simpy.Event | None = None  # lazy_arrival_process waiting while none is idle
        self.due = math.inf
        self._clock = env.now
        self._next_due()

    def _next_due(self) -> None:
        """`due` of the next arrival: its time as the clock of the arrival process that yields one
        ArrivalTimeout per arrival reaches it (`clock + (arrival - clock)`, or the same instant)."""
        feed = self.feed
        if feed.next_index >= len(feed.requests):
            self.due = math.inf
            return
        arrival, clock = feed.arrivals[feed.next_index], self._clock
        self.due = clock + (arrival - clock) if arrival > clock else clock

    def deliver_due(self, now: float) -> None:
        """Route and deliver every arrival due by `now`, in order."""
        while self.due <= now:
            self._clock = self.due
            self.deliver_next()
            self._next_due()

    def deliver_next(self) -> None:
        """Route the feed's next request and hand it to the replica picked."""
        replicas, route = self.replicas, self.route
        request = self.feed.pop_next()
        for sched in self.whole:
            sched.materialise()
        picker, loads = self.picker, self.loads
        if picker is not None and loads is not None:  # LeastLoadedRouter.route
            i = picker.pick(loads)
        else:
            answer = route(request, self.views) if route is not None else 0
            i = answer if type(answer) is int else _replica_index(answer, self.router, request, len(replicas))
        if not 0 <= i < len(replicas):
            name = self.router.name if self.router is not None else "-"
            raise RuntimeError(f"router {name} picked replica {i} of {len(replicas)} "
                               f"(indices 0-{len(replicas) - 1}) for request {request.request_id}")
        replicas[i].deliver(request)

    def going_idle(self) -> None:
        """A replica waits for an arrival: from now on arrivals land at their own instants."""
        self.idle += 1
        parked = self.parked
        if parked is not None:
            self.parked = None
            parked.succeed()


def arrival_process(env: simpy.Environment, feed: ArrivalFeed, replicas: list[Replica],
                    router: Router | None = None):
    """Each request enters a replica's waiting queue at its arrival time: the router's pick, or the
    only replica. One event per arrival (sim.dp's lockstep group, sim.disagg's pools)."""
    dispatch = Dispatch(env, feed, replicas, router)
    while not feed.exhausted:
        arrival = feed.next_arrival()
        if arrival > env.now:
            yield ArrivalTimeout(env, arrival - env.now)
        dispatch.deliver_next()


def lazy_arrival_process(env: simpy.Environment, dispatch: Dispatch):
    """The arrivals of `dispatch` that must be events of their own: while a replica is idle, each
    at its instant (it may wake that replica); while none is, engines deliver them as they resume
    (Dispatch.deliver_due) and this process waits until one goes idle."""
    while dispatch.due != math.inf:
        if dispatch.idle == 0:
            parked = dispatch.parked = env.event()
            yield parked
            continue
        if dispatch.due > env.now:
            yield from _land(env, dispatch.due)
        dispatch.deliver_due(env.now)


def _land(env: simpy.Environment, at: float):
    """Urgent timeouts reaching exactly `at` (> now). One usually does; when `at` is more than twice
    the clock, now + (at - now) may round elsewhere: land on at / 2**k (in [now, 2 now], an exact
    difference) and double from there (each double an exact sum)."""
    now = env.now
    if now + (at - now) == at or now <= 0:
        yield ArrivalTimeout(env, at - now)
        return
    hops = [at]
    while hops[-1] > 2 * now:
        hops.append(hops[-1] / 2)
    for hop in reversed(hops):
        yield ArrivalTimeout(env, hop - env.now)


def _replica_index(i: object, router: Router | None, request: Request, n: int) -> int:
    """A router's answer as an index: an integer of any kind (numpy's too), not a bool or float."""
    if isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)):
        return int(i)
    raise RuntimeError(f"router {router.name if router else '-'} answered {i!r} ({type(i).__name__}) for request "
                       f"{request.request_id}: route() must return a replica index, an int in 0-{n - 1}")


def engine_process(env: simpy.Environment, replica: Replica, feed: Arrivals, dispatch: Dispatch | None = None):
    """The serving loop: schedule, execute, apply; idle until an arrival when there is nothing to do.
    With `dispatch` (lazy delivery), the arrivals due by each resume are delivered first. The
    clock is read once per resume (`now`): nothing moves it in between (read as `env._now`, as
    Alarm reads it: `env.now` is an interpreted property, ~600 instructions a read)."""
    sched = replica.scheduler
    step = replica.step

    def queued_by(times: Sequence[float]) -> list[int]:
        return feed.queued_by(times, sched)

    # behind a router, arrivals' replicas are known only once routed: the replica records them
    queued = None if step.routed else queued_by

    next_arrival = feed.next_arrival
    alarm = Alarm(env)  # the process's waits
    now = env._now
    if dispatch is not None:
        dispatch.deliver_due(now)
    while True:
        # let every arrival due at this instant land first: arrivals are urgent (ArrivalTimeout),
        # so only at the start can this process run before one; with none due the yield is spared
        arrival = next_arrival()
        if arrival <= now:
            yield alarm.after(0)
            if dispatch is not None:
                dispatch.deliver_due(now)
            arrival = next_arrival()
        if not sched.has_unfinished():
            if feed.exhausted:
                return
            yield from _idle(env, replica, dispatch)
            now = env._now
            continue
        if replica.fast_forward:
            window = step.begin_window(now, arrival, queued)
            if window is not None:
                if step.routed:
                    replica.joined = []
                for delay in _delays(window.start, window.ends, window.durations):
                    yield alarm.after(delay)
                now = env._now
                if dispatch is not None:
                    dispatch.deliver_due(now)
                finished = step.complete_window(window, replica.joined or ())
                replica.joined = None
                if finished and replica.on_finish is not None:
                    replica.on_finish(finished)
                replica.hand_over()
                if replica.debug:  # checks the running batch's kept figures (and from now on its members' reads)
                    _check(sched)
                if replica.on_progress is not None:
                    replica.on_progress(now, sched.num_done)
                continue
        it = step.begin(now)
        if it.idle:
            if it.plan.rejected or it.plan.preempted:  # the queues changed: look again
                continue
            if feed.exhausted and not sched.running:
                _fail_stuck(sched)
            yield from _idle(env, replica, dispatch)
            now = env._now
            continue
        result = it.result
        assert result is not None  # not idle
        yield alarm.after(result.duration)  # simulated time passes: the cost model's duration
        now = env._now
        if dispatch is not None:
            dispatch.deliver_due(now)
        finished = step.complete(it, now)  # arrivals due by now have landed (ArrivalTimeout)
        if finished and replica.on_finish is not None:
            replica.on_finish(finished)
        replica.hand_over()
        if replica.observer is not None:
            replica.observer(it.start, result.duration, sched)
        if replica.debug:
            _check(sched)
        if replica.on_progress is not None:
            replica.on_progress(now, sched.num_done)


def _idle(env: simpy.Environment, replica: Replica, dispatch: Dispatch | None):
    """Wait until an arrival wakes the replica (Replica.deliver)."""
    replica.wakeup = env.event()
    if dispatch is None:
        yield replica.wakeup
        return
    dispatch.going_idle()
    yield replica.wakeup
    dispatch.idle -= 1
    dispatch.deliver_due(env.now)


def _delays(start: float, end_times: list[float], step_times: list[float]) -> list[float]:
    """The timeouts that move the clock from `start` over the skipped iterations to exactly the
    time stepping would reach: end_times[i] = end_times[i - 1] + step_times[i] (from `start`). One
    timeout usually lands there; when float rounding makes that sum unreachable from `start` in
    one addition, land on an earlier iteration's end and step the last ones."""
    last = len(end_times) - 1
    for j in range(last, max(len(end_times) - 9, -1), -1):
        target = end_times[j]
        delay = target - start
        while start + delay < target:
            delay = math.nextafter(delay, math.inf)
        while start + delay > target:
            delay = math.nextafter(delay, -math.inf)
        if start + delay == target:
            # most often one timeout lands on the last end (the starred form is a generic extend compiled)
            return [delay] if j == last else [delay, *step_times[j + 1:]]
    return list(step_times)


def _check(sched: Scheduler) -> None:
    sched.check_invariants()


def _fail_stuck(sched: Scheduler) -> None:
    head = sched.waiting[0] if sched.waiting else None
    raise RuntimeError(f"scheduler {sched.name} made no progress with nothing running; waiting head: {head}")
