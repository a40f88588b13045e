"""A study on Ray against worker processes: a 64-configuration sweep (4 policies x 16 rates, small
sharegpt-like workloads) run with `--jobs 2` and with `--executor ray` (a local Ray on this
machine's CPUs), measured side by side in one run.

On one machine Ray can only match the process pool (the same CPUs); the point is that the same
command scales out to a cluster with `--ray-address HEAD:6379` and no other change. Ray's start-up
(ray.init and its first workers) is timed apart from the sweep on a warm Ray. The tables are
checked equal (wall time aside).

    python -m benchmarks.bench_ray [--num-requests 150] [--jobs 2] [--repeat 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

POLICIES = ("vllm", "orca-oracle", "orca-pow2", "orca-max")
RATES = tuple(0.5 * k for k in range(1, 17))  # 0.5 .. 8 req/s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=150, help="requests per simulation (default 150)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes of the process executor (default 2)")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs of each executor; the median is shown")
    args = ap.parse_args(argv)
    try:
        import ray
    except ImportError:
        print("skipped: ray is not installed (pip install 'pagesim[cluster]')")
        return 0
    import pandas as pd

    from analysis.sweep import sweep
    from sim.run import SimConfig
    from traces import resolve_trace

    trace = resolve_trace("sharegpt-like", num_requests=args.num_requests, rate=RATES[0], seed=0)
    base = SimConfig()
    n = len(POLICIES) * len(RATES)

    def timed(**kw) -> tuple[float, pd.DataFrame]:
        t0 = time.perf_counter()
        table, _ = sweep(trace, base, POLICIES, RATES, **kw)
        return time.perf_counter() - t0, table.drop(columns="wall_s")

    t0 = time.perf_counter()
    ray.init(log_to_driver=False, include_dashboard=False)
    ray_init = time.perf_counter() - t0
    cpus = int(ray.cluster_resources().get("CPU", 0))
    first, _ = timed(executor="ray")  # the first Ray sweep also starts Ray's worker processes
    proc, ray_warm = [], []
    for _ in range(args.repeat):  # alternate, so drift on a shared machine hits both alike
        wall, proc_table = timed(jobs=args.jobs)
        proc.append(wall)
        wall, ray_table = timed(executor="ray")
        ray_warm.append(wall)
    ray.shutdown()
    pd.testing.assert_frame_equal(proc_table, ray_table, check_exact=True)

    p, r = statistics.median(proc), statistics.median(ray_warm)
    print(f"sweep of {n} configurations ({len(POLICIES)} policies x {len(RATES)} rates), {args.num_requests} "
          f"sharegpt-like requests each, OPT-13B on A100-40GB (roofline); median of {args.repeat}")
    print(f"{'executor':<28} {'wall s':>8} {'range s':>13} {'ms per sim':>11} {'vs processes':>13}")
    print(f"{f'process, --jobs {args.jobs}':<28} {p:>8.2f} {_range(proc):>13} {1e3 * p / n:>11.1f} {1.0:>12.2f}x")
    print(f"{f'ray, local, {cpus} CPUs (warm)':<28} {r:>8.2f} {_range(ray_warm):>13} {1e3 * r / n:>11.1f} "
          f"{r / p:>12.2f}x")
    print(f"{'ray, first sweep':<28} {first:>8.2f} {'':>13} {1e3 * first / n:>11.1f} {first / p:>12.2f}x")
    print(f"ray.init: {ray_init:.2f} s; tables identical: yes")
    return 0


def _range(walls: list[float]) -> str:
    return f"{min(walls):.1f}-{max(walls):.1f}" if len(walls) > 1 else ""


if __name__ == "__main__":
    sys.exit(main())
