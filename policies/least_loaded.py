"""The least-loaded pick over a list of outstanding counts, and the picker that keeps its state,
small enough that the compiled kernel (build_compiled.py) runs them as C loops and native calls:
the simulator asks at every arrival behind a least-loaded router (policies.router.LeastLoadedRouter
and its subclasses, and sim.engine.Dispatch, which calls the router's picker without an
interpreted frame)."""

from __future__ import annotations

from collections.abc import Iterable


class LeastLoaded:
    """A router's least-loaded picks and their one piece of state: `last`, the replica picked last
    (-1 before the first), after which ties go (the first tied replica after it, wrapping round),
    so that an idle cluster is filled in turn. Whoever picks another way sets `last` to its pick."""

    def __init__(self) -> None:
        self.last = -1

    def pick(self, loads: list[int]) -> int:
        """The least loaded of all replicas (`loads`: their outstanding counts), remembered."""
        best = self.last = least_loaded(loads, self.last)
        return best

    def pick_among(self, loads: list[int], candidates: Iterable[int]) -> int:
        """The least loaded of `candidates` (indices into `loads`, at least one), ties broken as
        `pick` breaks them; not remembered (the caller sets `last` to what it routes to)."""
        n, after = len(loads), self.last + 1
        best = best_load = best_rank = -1
        for i in candidates:
            load, rank = loads[i], (i - after) % n
            if best < 0 or load < best_load or (load == best_load and rank < best_rank):
                best, best_load, best_rank = i, load, rank
        if best < 0:
            raise ValueError("pick_among: no candidate replica")
        return best


def least_loaded(loads: list[int], last: int) -> int:
    """The index of the first smallest count in `loads`, in the order that starts just after
    `last` and wraps round (ties go to the next replica after the last one picked). `loads` is
    not empty; `last` is an index into it, or -1 before the first pick."""
    n = len(loads)
    first = (last + 1) % n
    best, least = first, loads[first]
    for i in range(first + 1, n):  # strictly smaller: the first tied one in this order stays
        if loads[i] < least:
            best, least = i, loads[i]
    for i in range(first):
        if loads[i] < least:
            best, least = i, loads[i]
    return best
