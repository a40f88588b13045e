"""Routers: which replica a new request goes to, when several serve one stream of requests.

A router sees the request and a view of each replica at the request's arrival, and answers an
index. It reads only what a real front end could know: each replica's outstanding requests (sent
minus completed), what the router itself sent where, and (cache-aware) what each replica's prefix
cache holds, which vLLM publishes as KV-cache events. Each router class declares the view it reads
(`Router.reads`: counts, cache, or the scheduler itself), and is handed only that. Routers are policies like the
schedulers: plain classes with constructor parameters and a registry name (`make_router`).

    round-robin      replica i, i+1, ... in turn
    random           uniformly at random (seeded)
    least-loaded     fewest outstanding requests (Vidur's "least outstanding requests")
    prefix-affinity  the replica already sent the longest run of this prompt's leading blocks,
                     unless that one is more than `max_imbalance` requests busier than the least
                     loaded (the router's own record stands in for the caches)
    cache-aware      the replica whose prefix cache holds most of the prompt now, with the same
                     cap (a router fed by the replicas' KV-cache events)

A router of one's own is a Router subclass named by import path (`package.module:Class`) or by a
`pagesim.routers` entry point, its keyword options passed through (`--router-arg key=value`).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from policies.least_loaded import LeastLoaded
from policies.plugins import check_option_types, load_plugin
from policies.request import Request
from policies.scheduler import Scheduler

# the views of a replica a router may declare that it reads (Router.reads)
COUNTS = "counts"
CACHE = "cache"
SCHEDULER = "scheduler"
VIEWS = (COUNTS, CACHE, SCHEDULER)


def outstanding(replica: ReplicaCounts | Scheduler) -> int:
    """Requests sent to a replica and not yet completed, exact at the caller's clock."""
    return replica.outstanding


class ReplicaCounts:
    """What a counts-only router sees of a replica: its outstanding count (`outstanding`: sent
    minus completed, exact at the arrival's time, even while skip-ahead has applied a window
    ahead of the clock). Reading anything else is an AttributeError naming the router."""

    __slots__ = ("_router", "_scheduler")

    def __init__(self, scheduler: Scheduler, router: str = "the router") -> None:
        self._scheduler = scheduler
        self._router = router

    @property
    def outstanding(self) -> int:
        s = self._scheduler  # the scheduler's kept count (Scheduler.loads): read at every arrival
        return s.loads[s.load_slot]

    def __getattr__(self, name: str) -> Any:  # only for names the view does not have
        if name.startswith("_"):  # a slot not set yet (copying): no message that reads one
            raise AttributeError(name)
        raise AttributeError(f"{self._router} reads replica.{name}, but its view holds only what "
                             f"{type(self).__name__} offers (reads = {self._reads!r}); declare the view it "
                             f"reads: reads = {' | '.join(map(repr, VIEWS))} (see policies.router)")

    _reads = COUNTS


class ReplicaCache(ReplicaCounts):
    """A cache-aware router's view: the count, and what the replica's KV-cache events and metrics
    tell a front end: how many of a prompt's tokens its prefix cache holds, and its cache usage."""

    __slots__ = ()
    _reads = CACHE

    def cached_prefix_tokens(self, request: Request) -> int:
        return self._scheduler.cached_prefix_tokens(request)

    def kv_usage(self) -> float:
        return self._scheduler.kv_usage()


class Router(ABC):
    """Picks a replica for each arriving request. Invariant: `route` returns an index into the
    replicas it is given, and is called exactly once per request, in arrival order.

    `reads`: the view of each replica the simulator hands `route` (`replica_views`): COUNTS (a
    ReplicaCounts: the outstanding count only), CACHE (ReplicaCache) or SCHEDULER (the scheduler
    itself; the default). A count changes only when a request arrives or completes, so behind a
    counts-only router replicas skip ahead across other replicas' arrivals; behind the others
    windows end before every arrival. A subclass inherits its parent's view, safely: reading more
    than a view holds is an AttributeError, never a silently different run."""

    name = "base"
    reads = SCHEDULER

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "reads_counts_only" in cls.__dict__:
            raise TypeError(f"{cls.__name__}.reads_counts_only: no longer part of the Router contract; declare "
                            f"the view it reads instead, reads = {' | '.join(map(repr, VIEWS))} (see policies.router)")
        if cls.__dict__.get("reads", SCHEDULER) not in VIEWS:
            raise ValueError(f"{cls.__name__}.reads = {cls.__dict__['reads']!r}: must be one of "
                             f"{', '.join(map(repr, VIEWS))}")

    @abstractmethod
    def route(self, request: Request, replicas: Sequence[Any]) -> int: ...


def reads_counts(router: Router) -> bool:
    """Whether the router reads only outstanding counts (its declared view is COUNTS)."""
    return router.reads == COUNTS


class ReplicaViews(list):
    """The views a router is handed (a list of them), with `loads`: every replica's outstanding
    count in one list, kept by the schedulers (Scheduler.share_load), so that a router reading
    all the counts at every arrival reads one list. Invariant: loads[i] == self[i].outstanding."""

    __slots__ = ("loads",)

    def __init__(self, views: list[Any], loads: list[int]) -> None:
        super().__init__(views)
        self.loads = loads


def replica_views(router: Router, replicas: Sequence[Scheduler]) -> list[Any]:
    """What `router.route` is handed for these replicas: its declared view of each (a
    ReplicaViews, whose `loads` the schedulers keep from now on, unless it reads the schedulers)."""
    if router.reads == SCHEDULER:
        return list(replicas)
    view = ReplicaCounts if router.reads == COUNTS else ReplicaCache
    label = type(router).__name__
    loads = [0] * len(replicas)
    for i, r in enumerate(replicas):
        r.share_load(loads, i)
    return ReplicaViews([view(r, label) for r in replicas], loads)


def replica_loads(replicas: Sequence[Any]) -> list[int]:
    """Every replica's outstanding count, in order: the kept list when `replicas` are the views
    the simulator hands a router (ReplicaViews), else each one's `outstanding`."""
    loads = getattr(replicas, "loads", None)
    return loads if loads is not None else [outstanding(r) for r in replicas]


class RoundRobinRouter(Router):
    name = "round-robin"
    reads = COUNTS  # reads nothing of a replica

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, replicas: Sequence[Any]) -> int:
        i = self._next % len(replicas)
        self._next = i + 1
        return i


class RandomRouter(Router):
    name = "random"
    reads = COUNTS  # reads nothing of a replica

    def __init__(self, seed: int = 0) -> None:
        if seed < 0:  # numpy's own error did not say which seed
            raise ValueError(f"random router: seed must be >= 0, got {seed}")
        self._rng = np.random.default_rng(seed)

    def route(self, request: Request, replicas: Sequence[Any]) -> int:
        return int(self._rng.integers(len(replicas)))


class LeastLoadedRouter(Router):
    """Fewest outstanding requests; ties go to the first tied replica after the last one picked,
    so that an idle cluster is filled in turn rather than always from replica 0."""

    name = "least-loaded"
    reads = COUNTS

    def __init__(self) -> None:
        # the picks and the last one (compiled: sim.engine.Dispatch calls `picker.pick` itself when
        # `route` is this one, at every arrival)
        self.picker = LeastLoaded()

    def route(self, request: Request, replicas: Sequence[Any]) -> int:
        # every replica, from one list of counts (the kept list read in place)
        return self.picker.pick(replicas.loads if type(replicas) is ReplicaViews else replica_loads(replicas))

    def _pick(self, replicas: Sequence[Any], candidates: Sequence[int]) -> int:
        return self.picker.pick_among(replica_loads(replicas), candidates)


def prefix_keys(request: Request, block: int) -> tuple[int, ...]:
    """Chained keys naming the prompt's leading content, one per block: the trace's prefix hashes
    when it has them (their own block size), else hashes of the token ids in blocks of `block`
    tokens (full blocks only). Empty when the request says nothing about its content."""
    if request.prefix_hashes is not None:
        return tuple(request.prefix_hashes)
    ids = request.prompt_token_ids
    if ids is None:
        return ()
    keys, parent = [], 0
    for j in range(len(ids) // block):
        parent = hash((parent, tuple(ids[j * block:(j + 1) * block])))
        keys.append(parent)
    return tuple(keys)


class _MatchRouter(LeastLoadedRouter):
    """Send a request to the replica with the largest match (`_matches`, > 0), unless that one
    holds more than `max_imbalance` outstanding requests above the least loaded replica (affinity
    must not pile a popular prefix onto one replica); else to the least loaded."""

    def __init__(self, max_imbalance: int = 8) -> None:
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        super().__init__()
        self.max_imbalance = max_imbalance
        self.affinity_hits = 0   # requests routed by a match (the rest went to the least loaded)

    def _matches(self, request: Request, replicas: Sequence[Any]) -> list[int]:
        raise NotImplementedError

    def _routed(self, request: Request, i: int) -> None:
        """Called with the pick, after it is made."""

    def route(self, request: Request, replicas: Sequence[Any]) -> int:
        matches = self._matches(request, replicas)
        best = max(matches, default=0)
        loads = replica_loads(replicas)
        least = min(loads)
        fits = [i for i, m in enumerate(matches) if m == best and loads[i] <= least + self.max_imbalance]
        if best > 0 and fits:
            i = self.picker.pick_among(loads, fits)
            self.affinity_hits += 1
        else:
            i = self.picker.pick(loads)
        self.picker.last = i
        self._routed(request, i)
        return i


class PrefixAffinityRouter(_MatchRouter):
    """Match: how many of the prompt's leading blocks the router sent to the replica before.

    Each replica's memory is the keys the router sent it, most recent last, at most
    `memory_blocks` of them (None: unbounded). It approximates the replica's cache: it knows
    nothing of evictions, as a front end without cache events would not."""

    name = "prefix-affinity"
    reads = COUNTS  # its matches are its own record of what it sent where

    def __init__(self, max_imbalance: int = 8, memory_blocks: int | None = None, block: int = 16) -> None:
        if memory_blocks is not None and memory_blocks < 1:
            raise ValueError(f"memory_blocks must be >= 1 or None, got {memory_blocks}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        super().__init__(max_imbalance)
        self.memory_blocks = memory_blocks
        self.block = block
        self._seen: list[OrderedDict[int, None]] = []
        self._keys: tuple[int, ...] = ()

    def _matches(self, request: Request, replicas: Sequence[Any]) -> list[int]:
        while len(self._seen) < len(replicas):
            self._seen.append(OrderedDict())
        self._keys = prefix_keys(request, self.block)
        return [self._match(self._seen[i], self._keys) for i in range(len(replicas))]

    def _routed(self, request: Request, i: int) -> None:
        seen = self._seen[i]
        for k in self._keys:
            seen[k] = None
            seen.move_to_end(k)
        if self.memory_blocks is not None:
            while len(seen) > self.memory_blocks:
                seen.popitem(last=False)

    @staticmethod
    def _match(seen: OrderedDict[int, None], keys: tuple[int, ...]) -> int:
        n = 0
        for k in keys:
            if k not in seen:
                break
            n += 1
        return n


class CacheAwareRouter(_MatchRouter):
    """Match: the prompt tokens each replica's prefix cache holds now (`cached_prefix_tokens`), as
    a front end fed by the replicas' KV-cache events would know them: exact, evictions included."""

    name = "cache-aware"
    reads = CACHE

    def _matches(self, request: Request, replicas: Sequence[Any]) -> list[int]:
        return [r.cached_prefix_tokens(request) for r in replicas]


ROUTERS: dict[str, Callable[..., Router]] = {
    RoundRobinRouter.name: RoundRobinRouter,
    RandomRouter.name: RandomRouter,
    LeastLoadedRouter.name: LeastLoadedRouter,
    PrefixAffinityRouter.name: PrefixAffinityRouter,
    CacheAwareRouter.name: CacheAwareRouter,
}

# the routers that follow a prefix match (and take max_imbalance)
MATCH_ROUTERS = (PrefixAffinityRouter.name, CacheAwareRouter.name)


def resolve_router(name: str) -> Callable[..., Router]:
    """The router class for a registry name, an import path `package.module:Class`, or a
    `pagesim.routers` entry point; a ValueError naming what did not resolve, or a class that
    does not implement Router."""
    if name in ROUTERS:
        return ROUTERS[name]
    target = load_plugin(name, "pagesim.routers", "router", ROUTERS)
    if not (inspect.isclass(target) and issubclass(target, Router) and not inspect.isabstract(target)):
        raise ValueError(f"router {name!r}: {target!r} is not a concrete Router (policies.router.Router, "
                         "with route(request, replicas) -> replica index)")
    return target


def make_router(name: str, **kw: Any) -> Router:
    """Create a router by name (see resolve_router) with keyword parameters (`seed` is passed only
    to routers that take one); an unknown parameter is a ValueError naming it."""
    factory = resolve_router(name)
    params = inspect.signature(factory).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        known = set(params)
        if "seed" in kw and "seed" not in known:
            kw = {k: v for k, v in kw.items() if k != "seed"}
        for k in kw:
            if k not in known:
                raise ValueError(f"unknown parameter {k!r} for router {name!r}; "
                                 f"known: {', '.join(sorted(known)) or 'none'}")
    check_option_types(factory, kw, f"router {name!r}")
    return factory(**kw)
