"""Lazy arrival delivery (sim.engine.Dispatch): arrivals are delivered by the engines as they
resume, and are events of their own only while a replica is idle; the tables are those of one
event per arrival (sim.engine.arrival_process), bit for bit, behind every kind of router view."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pandas as pd
import pytest
import simpy

import sim.run
from policies.request import Request
from policies.router import ROUTERS, LeastLoadedRouter, Router
from policies.scheduler import Scheduler
from sim.cluster import final_checks
from sim.engine import _land, arrival_process, engine_process
from sim.run import SimConfig, run_simulation
from traces import resolve_trace


def _eager_run_replicas(env, feed, front, router, fed=()):
    """run_replicas as it was: one event per arrival."""
    env.process(arrival_process(env, feed, front, router))
    for replica in front:
        env.process(engine_process(env, replica, feed))
    env.run()
    for replica in front:
        final_checks(replica.scheduler, replica.scheduler.num_added)


class QueueReadingRouter(Router):
    """Reads the schedulers themselves (the shortest waiting queue, then the fewest running)."""

    name = "queue-reading"
    reads = "scheduler"

    def route(self, request: Request, replicas: Sequence[Scheduler]) -> int:
        return min(range(len(replicas)), key=lambda i: (len(replicas[i].waiting), len(replicas[i].running), i))


@pytest.mark.parametrize("router,replicas,rate,options", [
    ("least-loaded", 4, 400.0, {}),    # saturated: no replica idles, arrivals cost no event
    ("least-loaded", 4, 3.0, {}),      # light: replicas idle, arrivals land at their own instants
    ("least-loaded", 3, 30.0, {"policy": "sjf", "chunked_prefill": True}),
    ("round-robin", 3, 30.0, {"policy": "vtc", "preemption": "swap", "num_gpu_blocks": 400}),
    ("cache-aware", 3, 60.0, {"prefix_caching": True}),
    ("queue-reading", 3, 40.0, {}),    # windows end before every arrival
    (None, 1, 20.0, {}),               # one replica, no router
])
def test_lazy_delivery_gives_the_tables_of_one_event_per_arrival(monkeypatch, router, replicas, rate, options):
    monkeypatch.setitem(ROUTERS, QueueReadingRouter.name, QueueReadingRouter)
    trace = resolve_trace("sharegpt-like", num_requests=300, rate=rate, seed=4)
    cfg = SimConfig(replicas=replicas, **({"router": router} if router else {}), **options)
    lazy = run_simulation(cfg, trace)
    monkeypatch.setattr(sim.run, "run_replicas", _eager_run_replicas)
    eager = run_simulation(cfg, trace)
    pd.testing.assert_frame_equal(lazy.requests, eager.requests, check_exact=True)
    pd.testing.assert_frame_equal(lazy.iterations, eager.iterations, check_exact=True)
    assert lazy.summary["engine"] == eager.summary["engine"]


def test_land_reaches_a_time_one_addition_cannot():
    rng = random.Random(0)
    for _ in range(100_000):  # a clock and a time more than twice it that now + (at - now) misses
        now, at = rng.uniform(1e-3, 1.0), rng.uniform(3.0, 1e4)
        if now + (at - now) != at:
            break
    else:
        pytest.skip("no such pair drawn")
    env = simpy.Environment(initial_time=now)
    env.process(_land(env, at))
    env.run()
    assert env.now == at


class CountingLeastLoaded(LeastLoadedRouter):
    """Least-loaded through its own `route` (an override): Dispatch calls it as any router's."""

    name = "counting-least-loaded"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def route(self, request: Request, replicas: Sequence[int]) -> int:
        self.calls += 1
        return super().route(request, replicas)


@pytest.mark.parametrize("rate", [400.0, 3.0])
def test_least_loaded_picked_in_dispatch_is_its_route(monkeypatch, rate):
    """Dispatch picks for LeastLoadedRouter itself (its kept loads, the router's own picker),
    and calls an override's route: both give the same tables."""
    monkeypatch.setitem(ROUTERS, CountingLeastLoaded.name, CountingLeastLoaded)
    made = []
    monkeypatch.setattr(sim.run, "make_router", lambda name, **kw: made.append(ROUTERS[name]()) or made[-1])
    trace = resolve_trace("sharegpt-like", num_requests=300, rate=rate, seed=5)
    plain = run_simulation(SimConfig(replicas=4, router="least-loaded"), trace)
    least = made[-1]
    counted = run_simulation(SimConfig(replicas=4, router=CountingLeastLoaded.name), trace)
    pd.testing.assert_frame_equal(plain.requests, counted.requests, check_exact=True)
    assert made[-1].calls == 300 and least.picker.last == made[-1].picker.last
