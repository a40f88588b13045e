"""What sim.engine relies on of SimPy beyond its public API, pinned (pyproject.toml: simpy < 5):
Alarm.after writes the queue entry `Environment.schedule` writes, in place of calling it, and
run_to_end processes the queue as `Environment.step` does (Driven processes started as `Process`
starts one). A SimPy whose queue changes fails here, not as a silently different run."""

from __future__ import annotations

import inspect

import pytest
import simpy
from simpy.events import NORMAL, URGENT

from sim.engine import Alarm, ArrivalTimeout, Driven, run_to_end


def test_environment_schedule_is_the_queue_entry_alarm_writes():
    body = inspect.getsource(simpy.Environment.schedule)
    assert "heappush(self._queue, (self._now + delay, priority, next(self._eid), event))" in body


class ScheduledAlarm:
    """Alarm as SimPy's public API writes it: env.schedule called (not a subclass: Alarm may be
    compiled)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.event: simpy.Timeout | None = None

    def after(self, delay: float) -> simpy.Timeout:
        if self.event is None:
            self.event = simpy.Timeout(self.env, delay)
            return self.event
        self.event.callbacks = []
        self.env.schedule(self.event, NORMAL, delay)
        return self.event


def _story(alarm_class: type[Alarm] | type[ScheduledAlarm]) -> list[tuple[str, float]]:
    """An alarm and timeouts of the same instants, interleaved: who resumes when."""
    env = simpy.Environment()
    alarm, seen = alarm_class(env), []

    def waits():
        for delay in (1.0, 0.5, 0.0, 2.0, 0.0):
            yield alarm.after(delay)
            seen.append(("alarm", env.now))

    def other(name, ats):
        for at in ats:
            yield env.timeout(at - env.now)
            seen.append((name, env.now))

    env.process(other("a", (1.0, 1.5, 1.5, 3.5)))
    env.process(waits())
    env.process(other("b", (0.0, 1.5, 3.5, 3.5)))
    env.run()
    return seen


def test_a_rearmed_alarm_is_ordered_as_a_scheduled_event():
    story = _story(Alarm)
    assert story == _story(ScheduledAlarm)
    assert [t for _, t in story] == sorted(t for _, t in story) and len(story) == 13
    env = simpy.Environment()
    alarm = Alarm(env)
    alarm.after(0.5)
    env.run()
    event = alarm.after(1.0)
    assert env._queue == [(1.5, NORMAL, env._queue[0][2], event)]
    urgent = ArrivalTimeout(env, 1.0)  # an arrival at the same instant goes first
    assert env._queue[0][1:] == (URGENT, env._queue[0][2], urgent)


def test_environment_step_is_what_run_to_end_does():
    step = inspect.getsource(simpy.Environment.step)
    for line in ("self._now, _, _, event = heappop(self._queue)",
                 "callbacks, event.callbacks = event.callbacks, None",
                 "for callback in callbacks:", "callback(event)",
                 "if not event._ok and not hasattr(event, '_defused'):"):
        assert line in step
    assert "return self._value is not PENDING" in inspect.getsource(simpy.Event.triggered.fget)  # Replica.deliver
    init = inspect.getsource(simpy.events.Initialize.__init__)
    assert "env.schedule(self, URGENT)" in init and "self._ok = True" in init


def _driven_story(drive: bool) -> list[tuple[str, float]]:
    """Processes waiting on alarms, timeouts and events another one triggers, of the same
    instants: SimPy's processes and env.run, or the alarms' processes Driven and run_to_end."""
    env = simpy.Environment()
    seen: list[tuple[str, float]] = []
    wake = [env.event()]

    def alarms(name, delays):
        alarm = Alarm(env)
        for delay in delays:
            yield alarm.after(delay)
            seen.append((name, env.now))
        yield wake[0]
        seen.append((name + " woken", env.now))

    def other(name, ats):
        for at in ats:
            yield env.timeout(at - env.now)
            seen.append((name, env.now))
        wake[0].succeed()

    def start(process) -> None:
        if drive:
            Driven(env, process)
        else:
            env.process(process)

    start(alarms("x", (1.0, 0.5, 0.0, 2.0)))
    env.process(other("a", (1.0, 1.5, 1.5, 3.5)))
    start(alarms("y", (0.0, 1.5, 2.0, 0.0)))
    if drive:
        run_to_end(env)
    else:
        env.run()
    return seen


def test_driven_processes_resume_as_simpy_processes():
    story = _driven_story(True)
    assert story == _driven_story(False)
    assert len(story) == 14 and story[-2:] == [("x woken", 3.5), ("y woken", 3.5)]


def test_run_to_end_raises_what_a_process_raises():
    env = simpy.Environment()

    def fails():
        yield Alarm(env).after(1.0)
        raise RuntimeError("engine failed")

    Driven(env, fails())
    with pytest.raises(RuntimeError, match="engine failed"):
        run_to_end(env)

    env = simpy.Environment()  # a SimPy process's failure, not defused: raised as Environment.step does
    env.process(fails())
    with pytest.raises(RuntimeError, match="engine failed") as info:
        run_to_end(env)
    assert isinstance(info.value.__cause__, RuntimeError)
