"""The independent simulations of a study, run in worker processes.

A study (sweep, routing, capacity, block size) is a list of runs that share nothing: each is seeded
by its own configuration. Running them in parallel changes only the wall time; the table is the
same, row for row, as a serial run's (tests/test_analysis.py checks this).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any


def run_tasks(fn: Callable[..., Any], tasks: Sequence[tuple], jobs: int = 1,
              on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
    """`fn(*task)` for every task, results in task order. `fn` must be a module-level function
    (it is pickled to the workers). `on_done(i, result)` is called in this process as each task
    finishes: in task order when jobs == 1, in completion order otherwise."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    results: list[Any] = [None] * len(tasks)
    if jobs == 1 or len(tasks) < 2:
        for i, task in enumerate(tasks):
            results[i] = fn(*task)
            if on_done is not None:
                on_done(i, results[i])
        return results
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)  # fork: workers start at once
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx) as pool:
        futures = {pool.submit(fn, *task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            i = futures[future]
            results[i] = future.result()
            if on_done is not None:
                on_done(i, results[i])
    return results
