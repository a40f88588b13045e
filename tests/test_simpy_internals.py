"""What sim.engine relies on of SimPy beyond its public API, pinned (pyproject.toml: simpy < 5):
Alarm.after writes the queue entry `Environment.schedule` writes, in place of calling it. A SimPy
whose queue changes fails here, not as a silently different run."""

from __future__ import annotations

import inspect

import simpy
from simpy.events import NORMAL, URGENT

from sim.engine import Alarm, ArrivalTimeout


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
