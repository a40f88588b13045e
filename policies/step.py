"""One iteration of the serving loop of DESIGN.md, with no clock of its own:

    step = replica.begin(now)        # plan = scheduler.schedule(now); result = executor.execute(plan)
    ...time passes: simulated (the result's duration) or measured (the wall clock)...
    replica.complete(step, end)      # scheduler.on_step_done(plan, result, end); one iteration row

The SimPy engine (sim/engine.py) and the live engines (backend/live.py, backend/server.py) wrap
this same object; only how time passes differs. The executor is anything with
`execute(plan, composition) -> StepResult`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from policies.metrics import IterationLog
from policies.plan import StepComposition, StepPlan, StepResult
from policies.request import SequenceGroup
from policies.scheduler import Scheduler


class Executor(Protocol):
    def execute(self, plan: StepPlan, comp: StepComposition) -> StepResult: ...


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


class ReplicaStep:
    """A replica's scheduler and executor stepped one iteration at a time, each recorded in `log`."""

    def __init__(self, scheduler: Scheduler, executor: Executor, log: IterationLog | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.log = log if log is not None else IterationLog()

    def begin(self, now: float) -> Step:
        plan = self.scheduler.schedule(now)
        if plan.is_empty:
            return Step(now, plan)
        comp = plan.composition()
        return Step(now, plan, comp, self.executor.execute(plan, comp))

    def complete(self, step: Step, end: float) -> list[SequenceGroup]:
        """Apply the executed step at time `end` (its result's duration is what the log records:
        the cost model's, or the measured wall time the caller set). Returns the finished groups."""
        sched, result = self.scheduler, step.result
        finished = sched.on_step_done(step.plan, result, end)
        self.log.add(step.start, result.duration, step.comp, len(step.plan.preempted), len(sched.waiting),
                     len(sched.running), sched.memory(), sched.prefix_hits)
        return finished
