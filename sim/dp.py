"""vLLM data parallelism for mixture-of-experts models: DP ranks that share a clock per iteration.

`vllm serve MOE --data-parallel-size N [--enable-expert-parallel]` runs N engine cores (ranks), each
with its own scheduler, requests and KV cache, and attention (tensor-parallel over its tp GPUs)
replicated per rank. The MoE layers are not: the experts are spread over all N x tp GPUs (whole
experts with expert parallelism, EP size = N x tp; else each expert tensor-parallel over them), and
every MoE layer gathers all ranks' tokens to the experts and scatters the outputs back (the
all-to-all: dispatch and combine). So the ranks step in lockstep: while any rank has requests in
progress, every rank runs every iteration, one with nothing scheduled a dummy batch (vLLM's DP
coordinator wakes the idle engines, `execute_dummy_batch`), and an iteration ends when the slowest
rank's does. Dense models' DP ranks are independent replicas (sim/run.py feeds them with vLLM's
balancer, policies/dp_router.py, and steps them as any replicas).

Here: a DP group is a list of replicas (sim.engine.Replica, each its own scheduler and cache) whose
one SimPy process (`dp_group_process`) begins an iteration on every rank at the same instant, prices
it as

    duration = max over ranks of (the rank's own step: overheads, attention, dense layers, all-reduces;
                                   a dummy batch's, one token, for an idle rank)
             + moe_group_time(all ranks' tokens)   (experts and all-to-all, sim/cost_model.py)

(the MoE layers interleave with the rest layer by layer, each layer waiting for the slowest rank;
with layers alike, the sum over layers of the per-layer maxima is the maximum of the sums), and
completes every busy rank's iteration at its end, the log recording that duration. Skipping ahead
(sim/engine.py windows) is off for a group: one rank's window would have to stop at every other
rank's change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd
import simpy

from policies.plan import StepComposition
from policies.router import Router
from sim.cluster import final_checks
from sim.cost_model import CostModel
from sim.engine import ArrivalFeed, Replica, arrival_process


@dataclass(frozen=True)
class Lockstep:
    """One lockstep iteration of a DP group: its duration, each rank's own part (`own[i]`, a dummy
    batch's for an idle rank), the tokens all ranks send through the MoE layers, and those layers'
    time (experts + all-to-all). Invariant: duration = max(own) + moe_s >= own[i] for every rank."""

    duration: float
    own: tuple[float, ...]
    tokens: int
    moe_s: float


def lockstep(cost: CostModel, comps: Sequence[StepComposition | None]) -> Lockstep:
    """Price one iteration of a DP group whose ranks run `comps` (None: nothing scheduled there, so
    a dummy batch of one token). `cost` must price the MoE layers by group (`moe_group_time`)."""
    own, tokens = [], 0
    for c in comps:
        if c is None:
            own.append(cost.decode_step_time(1, 1))
            tokens += 1
        else:
            own.append(cost.step_time(c))
            tokens += c.prefill_tokens + c.num_decode_seqs
    moe = cost.moe_group_time(tokens)
    if moe is None:
        raise ValueError(f"{type(cost).__name__} prices MoE layers per replica: a DP group of an MoE model needs a "
                         "cost model built with dp > 1 (the roofline or a calibration)")
    return Lockstep(max(own) + moe, tuple(own), tokens, moe)


@dataclass
class GroupLog:
    """One row per lockstep iteration and rank: when it began, how long it took, the rank's own part,
    whether the rank ran a dummy batch, the group's MoE tokens and MoE time."""

    rows: list[tuple] = field(default_factory=list)

    def add(self, index: int, start: float, step: Lockstep, dummy: Sequence[bool]) -> None:
        for rank, (own, idle) in enumerate(zip(step.own, dummy, strict=True)):
            self.rows.append((index, rank, start, step.duration, own, idle, step.tokens, step.moe_s))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=["iteration", "rank", "start", "duration", "own_s", "dummy",
                                                "moe_tokens", "moe_s"])

    def summary(self) -> dict:
        """Lockstep iterations, dummy batches run, and the share of the ranks' time spent waiting
        for the slowest rank (lockstep duration - own part - MoE time, over the durations)."""
        f = self.frame()
        if f.empty:
            return {"lockstep_iterations": 0, "dummy_batches": 0, "wait_share": 0.0, "moe_share": 0.0}
        busy = f[~f.dummy]
        total = float(busy.duration.sum())
        return {"lockstep_iterations": int(f.iteration.nunique()), "dummy_batches": int(f.dummy.sum()),
                "wait_share": float((busy.duration - busy.own_s - busy.moe_s).sum() / total) if total else 0.0,
                "moe_share": float(busy.moe_s.sum() / total) if total else 0.0}


def _wakeup(env: simpy.Environment, ranks: Sequence[Replica]) -> simpy.Event:
    """One event every rank's next arrival triggers (Replica.deliver): the group wakes on any."""
    event = env.event()
    for r in ranks:
        r.wakeup = event
    return event


def dp_group_process(env: simpy.Environment, ranks: Sequence[Replica], feed: ArrivalFeed, cost: CostModel,
                     log: GroupLog):
    """The ranks' serving loops in lockstep (module docstring): while any rank has work, every rank
    runs each iteration, which lasts as long as `lockstep` says; idle when none has."""
    index = 0
    while True:
        if feed.next_arrival() <= env.now:  # arrivals due now land first (as sim.engine.engine_process)
            yield env.timeout(0)
        if not any(r.scheduler.has_unfinished() for r in ranks):
            if feed.exhausted:
                return
            yield _wakeup(env, ranks)
            continue
        steps = [r.step.begin(env.now) for r in ranks]
        if all(s.idle for s in steps):
            if any(s.plan.rejected or s.plan.preempted for s in steps):  # the queues changed: look again
                continue
            if feed.exhausted and not any(r.scheduler.running for r in ranks):
                raise RuntimeError(f"DP group of {len(ranks)} ranks made no progress with nothing running")
            yield _wakeup(env, ranks)
            continue
        start = env.now
        step = lockstep(cost, [None if s.idle else s.comp for s in steps])
        yield env.timeout(step.duration)
        log.add(index, start, step, [s.idle for s in steps])
        index += 1
        for rank, s in zip(ranks, steps, strict=True):
            if s.idle:
                continue
            s.result.duration = step.duration  # the rank's tokens come out when the slowest rank is done
            finished = rank.step.complete(s, env.now)
            if finished and rank.on_finish is not None:
                rank.on_finish(finished)
            if rank.observer is not None:
                rank.observer(s.start, step.duration, rank.scheduler)
            if rank.on_progress is not None:
                rank.on_progress(env.now, len(rank.scheduler.done))


def run_dp_group(env: simpy.Environment, feed: ArrivalFeed, ranks: list[Replica], router: Router,
                 cost: CostModel) -> GroupLog:
    """Run a DP group to the end: the feed's arrivals spread over the ranks by `router`, the ranks
    stepped in lockstep; then every rank's end-of-run checks. Returns the group's log."""
    log = GroupLog()
    env.process(arrival_process(env, feed, ranks, router))
    env.process(dp_group_process(env, ranks, feed, cost, log))
    env.run()
    for rank in ranks:
        final_checks(rank.scheduler, rank.scheduler.num_added)
    return log
