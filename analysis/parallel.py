"""The independent simulations of a study, run in worker processes or as tasks on a Ray cluster.

A study (sweep, routing, capacity, block size, ...) is a list of runs that share nothing: each is
seeded by its own configuration. Running them in parallel, here or on a cluster, changes only the
wall time; the table is the same, row for row, as a serial run's (tests/test_analysis.py and
tests/test_ray_studies.py check this).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

EXECUTORS = ("process", "ray")
RAY_MISSING = "--executor ray needs Ray: pip install 'pagesim[cluster]'"


@dataclass(frozen=True)
class Workers:
    """Where a study's simulations run: `jobs` worker processes, or Ray tasks on the cluster at
    `address` (run_tasks says how each is used)."""

    jobs: int = 1
    executor: str = "process"
    address: str | None = None

    def options(self) -> dict[str, Any]:
        """The keyword arguments a study function passes on to run_tasks."""
        return {"jobs": self.jobs, "executor": self.executor, "address": self.address}


def run_tasks(fn: Callable[..., Any], tasks: Sequence[tuple], jobs: int = 1,
              on_done: Callable[[int, Any], None] | None = None, executor: str = "process",
              address: str | None = None, progress: bool | None = None) -> list[Any]:
    """`fn(*task)` for every task, results in task order. `fn` must be a module-level function
    (it is pickled to the workers). `on_done(i, result)` is called in this process in task order,
    for each task as soon as it and every task before it have finished (so that rows printed as a
    study runs come in the same order however many workers run it).

    executor "process": `jobs` worker processes on this machine, at most one per CPU (1: in this
    process). executor "ray": each task a Ray task on the cluster at `address` (None: a local Ray, started here if none
    is running); Ray places the tasks on the cluster's CPUs, so `jobs` does not apply. `progress`:
    a progress bar on stderr (None: when stderr is a terminal)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if address and executor != "ray":
        raise ValueError("a Ray address applies to --executor ray only")
    results: list[Any] = [None] * len(tasks)
    done = [False] * len(tasks)
    reported = 0  # tasks before this one have been given to on_done
    bar = _progress_bar(len(tasks), progress)

    def finish(i: int, result: Any) -> None:
        nonlocal reported
        results[i], done[i] = result, True
        while on_done is not None and reported < len(tasks) and done[reported]:
            with bar.external_write_mode() if bar is not None else nullcontext():
                on_done(reported, results[reported])  # the rows a caller prints go above the bar, not through it
            reported += 1
        if bar is not None:
            bar.update()

    try:
        if executor == "ray":
            _run_ray(fn, tasks, address, finish)
        elif jobs == 1 or len(tasks) < 2:
            for i, task in enumerate(tasks):
                finish(i, fn(*task))
        else:
            _run_processes(fn, tasks, jobs, finish)
    finally:
        if bar is not None:
            bar.close()
    return results


def _run_processes(fn: Callable[..., Any], tasks: Sequence[tuple], jobs: int,
                   finish: Callable[[int, Any], None]) -> None:
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)  # fork: workers start at once
    cpus = os.cpu_count() or 1
    if jobs > cpus and len(tasks) > cpus:  # more workers than CPUs only add memory (each holds a simulation)
        print(f"note: --jobs {jobs} on {cpus} CPUs: {cpus} worker processes", file=sys.stderr)
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks), cpus), mp_context=ctx) as pool:
        futures = {pool.submit(fn, *task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            finish(futures[future], future.result())


def _run_ray(fn: Callable[..., Any], tasks: Sequence[tuple], address: str | None,
             finish: Callable[[int, Any], None]) -> None:
    ray = import_ray()
    if not ray.is_initialized():  # a Ray started by the caller (or a test) is used as it is
        ray.init(address=address or None, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    remote = ray.remote(_apply)  # not ray.remote(fn): any picklable callable, builtins too
    # an argument object shared by several tasks (a study's trace at one rate) goes to the object
    # store once, not once per task; plain numbers and strings travel inline
    stored: dict[int, Any] = {}

    def ref(arg: Any) -> Any:
        if arg is None or isinstance(arg, (bool, int, float, str)):
            return arg
        if id(arg) not in stored:
            stored[id(arg)] = ray.put(arg)
        return stored[id(arg)]

    fn_ref = ray.put(fn)
    pending = {remote.remote(fn_ref, *(ref(a) for a in task)): i for i, task in enumerate(tasks)}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for r in done:
            i = pending.pop(r)
            try:
                result = ray.get(r)
            except ray.exceptions.RayTaskError as e:  # the task's own error, as a serial run raises it
                for rest in pending:
                    ray.cancel(rest)
                raise (e.cause if isinstance(e.cause, BaseException) else e) from None
            finish(i, result)


def _apply(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def import_ray():
    """The ray module, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise SystemExit(RAY_MISSING) from None
    return ray


def _progress_bar(total: int, progress: bool | None):
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress or total < 2:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="run", desc="simulations", file=sys.stderr, leave=False)
