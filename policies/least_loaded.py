"""The least-loaded pick over a list of outstanding counts, in one small function so that the
compiled kernel (build_compiled.py) runs it as a C loop: the simulator asks it at every arrival
behind a least-loaded router (policies.router.LeastLoadedRouter and sim.engine.Dispatch)."""

from __future__ import annotations


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
