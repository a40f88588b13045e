"""The simulated cluster both kinds of run are built from: replicas (a ReplicaConfig's scheduler
stepped with a simulated executor), their SimPy processes, and the checks at the end of every run.

`run_simulation` (sim/run.py) builds one pool of replicas behind a router; `run_disaggregated`
(sim/disagg.py) a prefill pool behind a router and a decode pool fed by KV transfers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
from collections.abc import Callable, Iterable

import numpy as np
import simpy

from policies.replica_config import ReplicaConfig, build_replica
from policies.router import Router
from policies.scheduler import Scheduler
from sim.cost_model import CostModel
from sim.engine import (
    ArrivalFeed,
    Dispatch,
    Driven,
    Replica,
    arrival_process,
    engine_process,
    lazy_arrival_process,
    run_to_end,
)
from sim.executor import BeamPicks, SimulatedExecutor


def sim_replica(env: simpy.Environment, config: ReplicaConfig, cost: CostModel, seed: int | np.random.SeedSequence,
                beam_rank_decay: float = 0.5, beam_picks: dict[int, BeamPicks] | None = None,
                routed: bool = False, counts_only: bool = False, **engine: object) -> Replica:
    """One simulated replica: `config`'s scheduler stepped with a simulated executor that prices
    iterations with `cost` and draws outcomes seeded with `seed`. `routed`, `counts_only`: see
    policies.step.ReplicaStep; `engine`: the sim.engine.Replica's own options (fast_forward,
    debug, hooks, index)."""
    executor = SimulatedExecutor(cost, seed=seed, beam_rank_decay=beam_rank_decay, beam_picks=beam_picks)
    return Replica(env, build_replica(config, executor, routed=routed, counts_only=counts_only), **engine)


def run_replicas(env: simpy.Environment, feed: ArrivalFeed, front: list[Replica], router: Router | None,
                 fed: Iterable[tuple[Replica, ArrivalFeed]] = ()) -> None:
    """Run the cluster to the end: the feed's arrivals spread over the `front` replicas by the
    router (none: one replica), each replica in `fed` taking its arrivals from its own feed; then
    every replica's end-of-run checks. Without `fed` replicas, the engines are the only processes
    besides the arrivals, and arrivals are delivered lazily (sim.engine.Dispatch)."""
    fed = list(fed)
    if fed:  # other processes (sim.disagg's transfers) change replicas between engine events
        env.process(arrival_process(env, feed, front, router))
        for replica in front:
            Driven(env, engine_process(env, replica, feed))
    else:
        dispatch = Dispatch(env, feed, front, router)
        env.process(lazy_arrival_process(env, dispatch))
        for replica in front:
            Driven(env, engine_process(env, replica, feed, dispatch))
    for replica, own in fed:
        Driven(env, engine_process(env, replica, own))
    run_to_end(env)  # env.run(), the engines resumed natively
    for replica in front + [r for r, _ in fed]:
        final_checks(replica.scheduler, replica.scheduler.num_added)


@contextlib.contextmanager
def gc_paused():
    """Requests live for the whole run; the cyclic collector would rescan all of them again and
    again (superlinear in the number of requests). Per-iteration objects are acyclic and freed
    by reference counting, so collection is paused for the run and its tables."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).
    Numpy arrays below the mmap threshold live on that heap; freeing many of them leaves holes
    that glibc keeps mapped, so a large run's peak memory would count them beside the arrays built
    after. Cheap: one pass over the heap's free lists."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def final_checks(sched: Scheduler, num_requests: int) -> None:
    """Conservation at the end of every run: all requests accounted for (those still in `done` and
    those handed over to a replica's rows: `released`), no block leaked."""
    sched.check_conservation()
    out = sched.num_done
    if sched.has_unfinished() or out != num_requests:
        raise AssertionError(f"{num_requests} requests in, {out} out")
    sched.assert_drained()
    sched.check_invariants()
