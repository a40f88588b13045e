"""Simulator speed: sharegpt-like requests at saturation, vllm policy, OPT-13B on one A100-40GB.

Each case runs in its own process so that its peak memory (max RSS) is its own. Targets on a
2-core machine: 10,000 requests in <= 3 s wall and <= 1 GB peak; 100,000 in <= 30 s (linear).
Replicas: the smallest size again over R replicas at R times the rate (each replica as loaded as
the one), least-loaded routing; target: at most 2x the one replica's wall time.
Policies (issue 12): the smallest size under each policy written only against the public policy API
(`--policies sjf vtc ...`), target: within 1.5x of vllm's wall time in the same run. Scale-out:
`--million` simulates 1,000,000 requests over 16 replicas behind least-loaded routing (target
<= 120 s on a 2-core machine); `--routed-sizes` times other sizes over `--replicas` replicas the same
way, without the single-replica runs (e.g. `--routed-sizes 100000 --replicas 16`).

    python -m benchmarks.bench_sim [--sizes 10000 100000] [--rate 100] [--replicas 4] [--policies sjf]
        [--million] [--routed-sizes 100000]

The first line printed is this interpreter's speed on a fixed pure-Python workload (`python_reference_s`):
the same VM kind has run it 3-4x apart on different days, so wall times from different days compare
only beside it. It is printed, never used to scale a figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CASE = """
import json, resource, time
from traces import resolve_trace
from sim.run import SimConfig, run_simulation
trace = resolve_trace("sharegpt-like", num_requests={n}, rate={rate}, seed=0)
t0 = time.perf_counter()
res = run_simulation(SimConfig(policy="{policy}", model="opt-13b", hardware="a100-40gb", fast_forward={ff},
                              replicas={replicas}, router="least-loaded"), trace)
wall = time.perf_counter() - t0
s = res.summary
print(json.dumps({{"wall": wall, "sim": s["duration_s"], "iters": s["num_iterations"],
                   "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "finished": s["num_finished"], "preemptions": s["num_preemptions"],
                   "stepped": s["engine"]["stepped_iterations"]}}))
"""

TARGET_WALL = {10_000: 3.0, 100_000: 30.0}


def python_reference_s(repeats: int = 3) -> float:
    """Best-of-`repeats` seconds for a fixed pure-Python workload shaped like the simulator's hot
    loops (attribute updates over a small batch of objects, list appends, dict lookups)."""

    class Seq:
        __slots__ = ("computed", "output")

        def __init__(self) -> None:
            self.computed = self.output = 0

    batch = [Seq() for _ in range(28)]
    tables: dict[int, list[int]] = {i: [] for i in range(28)}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for step in range(40_000):
            for i, s in enumerate(batch):
                s.computed += 1
                s.output = s.computed + step
                if s.computed % 16 == 0:
                    tables[i].append(step)
        best = min(best, time.perf_counter() - t0)
        for t in tables.values():
            t.clear()
    return best


def print_machine() -> None:
    print(f"machine: pure-Python reference {python_reference_s():.3f} s (compare wall times across days beside it)")


def run_case(n: int, rate: float, ff: bool = True, replicas: int = 1, policy: str = "vllm") -> dict:
    code = CASE.format(n=n, rate=rate, ff=ff, replicas=replicas, policy=policy)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--rate", type=float, default=100.0, help="arrival rate, far above capacity (saturation)")
    ap.add_argument("--no-step-baseline", action="store_true", help="skip the one-iteration-at-a-time run")
    ap.add_argument("--replicas", type=int, default=4, help="replicas for the multi-replica case (0: skip it)")
    ap.add_argument("--policies", nargs="*", default=["sjf", "vtc"],
                    help="policies timed against vllm at the smallest size (default sjf vtc)")
    ap.add_argument("--million", action="store_true", help="also 1,000,000 requests over 16 replicas")
    ap.add_argument("--routed-sizes", type=int, nargs="+", default=[],
                    help="only these sizes over --replicas replicas (least-loaded) at --rate x replicas")
    args = ap.parse_args(argv)
    print_machine()
    if args.routed_sizes:
        routed(args.routed_sizes, args.rate, args.replicas)
        return
    print("Simulator speed (vllm, OPT-13B / A100-40GB, sharegpt-like at saturation)")
    print(f"{'requests':>9} {'mode':>10} {'wall s':>8} {'target s':>8} {'ratio':>6} {'peak MB':>8} "
          f"{'iterations':>10} {'sim s':>8} {'sim/wall':>9}")
    rows = []
    for n in args.sizes:
        modes = [True] if args.no_step_baseline or n > 10_000 else [True, False]
        for ff in modes:
            r = run_case(n, args.rate, ff)
            target = TARGET_WALL.get(n, 3.0 * n / 10_000)
            rows.append((n, ff, r))
            print(f"{n:>9,} {'skip-ahead' if ff else 'step':>10} {r['wall']:>8.2f} {target:>8.1f} "
                  f"{r['wall'] / target:>6.2f} {r['rss_mb']:>8.0f} {r['iters']:>10,} {r['sim']:>8.0f} "
                  f"{r['sim'] / r['wall']:>9.0f}")
    ff_rows = [(n, r) for n, ff, r in rows if ff]
    if len(ff_rows) >= 2:
        (n0, r0), (n1, r1) = ff_rows[0], ff_rows[-1]
        print(f"growth: {n1 / n0:.0f}x requests -> {r1['wall'] / r0['wall']:.1f}x wall time")
    if args.replicas > 1 and ff_rows:
        n0, r0 = ff_rows[0]
        r = run_case(n0, args.rate * args.replicas, True, args.replicas)
        print(f"{n0:,} requests on {args.replicas} replicas (least-loaded) at {args.rate * args.replicas:g} req/s: "
              f"{r['wall']:.2f} s wall, {r['wall'] / r0['wall']:.2f}x one replica (target <= 2x), "
              f"{r['iters']:,} iterations, peak {r['rss_mb']:.0f} MB, {r['finished']:,} finished")
    if args.policies and ff_rows:
        n0, r0 = ff_rows[0]
        print(f"policies on the public API, {n0:,} requests (target <= 1.5x vllm):")
        for policy in args.policies:
            r = run_case(n0, args.rate, True, 1, policy)
            print(f"  {policy:<8} {r['wall']:>6.2f} s wall vs vllm {r0['wall']:.2f} s: {r['wall'] / r0['wall']:.2f}x, "
                  f"{r['iters']:,} iterations, {r['finished']:,} finished")
    if args.million:
        r = run_case(1_000_000, args.rate * 16, True, 16)
        print(f"1,000,000 requests on 16 replicas (least-loaded) at {args.rate * 16:g} req/s: {r['wall']:.1f} s wall "
              f"(target <= 120 s), {r['iters']:,} iterations, peak {r['rss_mb']:.0f} MB, {r['finished']:,} finished")


def routed(sizes: list[int], rate: float, replicas: int) -> None:
    """Each size over `replicas` replicas behind least-loaded routing, each replica at `rate`."""
    if replicas < 2:
        raise SystemExit(f"--routed-sizes: --replicas must be >= 2, got {replicas}")
    for n in sizes:
        r = run_case(n, rate * replicas, True, replicas)
        print(f"{n:,} requests on {replicas} replicas (least-loaded) at {rate * replicas:g} req/s: {r['wall']:.1f} s "
              f"wall, {r['iters']:,} iterations ({r['stepped']:,} stepped), peak {r['rss_mb']:.0f} MB, "
              f"{r['finished']:,} finished")


if __name__ == "__main__":
    main()
