"""Where a simulated run's time goes, phase by phase: wall, user and system CPU, and page faults of
each step of `run_simulation` (the trace's requests built, the replicas run, the request table, the
iteration table's pieces taken, the summary), then the rest of the iteration table read after the
run (it is built when read), on the sharegpt-like trace over least-loaded replicas, as the
million-request benchmark runs it. System time is the cost of pages the process touches first: on a
virtual machine it can be most of the tables' time (docs/RESULTS.md, 2026-12-04 session 20).

    python -m benchmarks.profile_sim_phases [--requests 200000] [--replicas 16] [--policy vllm]
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import time
from collections.abc import Iterator

# sim.run's steps of one run, in order (module attributes: each is wrapped while the run lasts)
PHASES = ("requests_from_trace", "run_replicas", "_request_table", "_iteration_table", "with_client_latencies",
          "summarize", "_columns", "_router_summary")


def _usage() -> tuple[float, float, float, int]:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), u.ru_utime, u.ru_stime, u.ru_minflt


@contextlib.contextmanager
def timed_phases(module: object, names: tuple[str, ...]) -> Iterator[list[tuple]]:
    """Within the block, each of `module`'s functions `names` appends (name, wall, user, sys, faults)
    per call to the list yielded; the functions are restored after."""
    rows: list[tuple] = []
    originals = {name: getattr(module, name) for name in names}

    def wrapped(name: str, f):
        def call(*args, **kwargs):
            start = _usage()
            out = f(*args, **kwargs)
            end = _usage()
            rows.append((name, *(e - s for e, s in zip(end, start))))
            return out
        return call

    for name, f in originals.items():
        setattr(module, name, wrapped(name, f))
    try:
        yield rows
    finally:
        for name, f in originals.items():
            setattr(module, name, f)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second per replica (default 100)")
    ap.add_argument("--policy", default="vllm")
    args = ap.parse_args(argv)
    import sim.run
    from traces import resolve_trace

    trace = resolve_trace("sharegpt-like", num_requests=args.requests, rate=args.rate * args.replicas, seed=0)
    cfg = sim.run.SimConfig(policy=args.policy, model="opt-13b", hardware="a100-40gb", replicas=args.replicas,
                            router="least-loaded")
    start = _usage()
    with timed_phases(sim.run, PHASES) as rows:
        res = sim.run.run_simulation(cfg, trace)
    total = ("total", *(e - s for e, s in zip(_usage(), start)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    before = _usage()
    len(res.iterations)  # the rest of the iteration table, built when read (sim.iteration_table)
    table = ("after: the whole iteration table read", *(e - s for e, s in zip(_usage(), before)))
    n = args.requests
    print(f"{n:,} requests over {args.replicas} replicas, {args.policy}: {res.summary['num_iterations']:,} "
          f"iterations, peak RSS {peak:,.0f} MiB in the run "
          f"({resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB with the whole table read)")
    print(f"{'phase':<38}{'wall s':>8}{'user s':>8}{'sys s':>8}{'faults':>10}  {'CPU us a request':>16}")
    for name, wall, user, system, faults in [*rows, total, table]:
        print(f"{name:<38}{wall:8.2f}{user:8.2f}{system:8.2f}{faults:10d}  {(user + system) / n * 1e6:16.1f}")


if __name__ == "__main__":
    main()
