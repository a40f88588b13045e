"""Simulator speed: sharegpt-like requests at saturation, OPT-13B on one A100-40GB, as ratios of
this interpreter's speed.

Wall times on the same VM kind have varied 3-4x from day to day (and by 2x within an hour on a
shared machine), so every case states its wall time beside `python_reference_s`, a fixed
pure-Python workload shaped like the simulator's hot loops, timed in the case's own process just
before and just after the run; a case whose two references differ by more than 20% is rerun (up to
twice). Each case runs in its own process so that its peak memory (max RSS) is its own, on the
kernel this process would run (the compiled build when `make compiled` built a fresh one, the
sources under PAGESIM_COMPILED=0): the first line of the targets says which.

The targets (issue 23), printed by default:
- 10,000 requests on one replica (vllm): wall <= 8 x python_reference_s;
- `sjf` and `vtc` on the same run: wall <= 1.3 x vllm's (the three alternated three times in one
  process, the fastest of each compared, as timeit compares: a separate process per policy let the
  load of the moment and each process's one-time costs into a 0.2 s run);
- 20,000 requests over 16 least-loaded replicas (16 x the rate): wall <= 10 x python_reference_s;
- `--million`: 1,000,000 requests over 16 least-loaded replicas: wall <= 500 x python_reference_s and
  peak RSS <= 4 GiB. The wall is `run_simulation`'s: the request table, the summary and the iteration
  columns it reads; the rest of the iteration table is built when first read (sim.iteration_table),
  and the time and peak memory of reading it after the run are printed beside.

Other runs: `--sizes 10000 100000` times those sizes on one replica (growth; with a stepped
baseline at 10,000 unless `--no-step-baseline`); `--routed-sizes 20000 100000 --replicas 16` times
sizes over R least-loaded replicas, with each run's CPU per request and how that grows from the first
size to the last (the figure to read for growth on a shared machine, where wall / CPU moves with the
load); `--compiled [--rounds 2]` times the 20,000 / 16 run interpreted and on the compiled build
(`make compiled`), alternated, target >= 2.5x.

    python -m benchmarks.bench_sim [--million] [--rate 100] [--policies sjf vtc]
        [--sizes 10000 100000] [--routed-sizes 20000 100000 --replicas 16] [--compiled [--rounds 2]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASE = """
import json, resource, time
from benchmarks.bench_sim import python_reference_s
from traces import resolve_trace
from sim.run import SimConfig, run_simulation
import policies.step
from policies._compiled import running_compiled
trace = resolve_trace("sharegpt-like", num_requests={n}, rate={rate}, seed=0)
ref_before = python_reference_s()
t0, c0 = time.perf_counter(), time.process_time()
res = run_simulation(SimConfig(policy="{policy}", model="opt-13b", hardware="a100-40gb", fast_forward={ff},
                              replicas={replicas}, router="least-loaded"), trace)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
ref_after = python_reference_s()
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
t1 = time.perf_counter()
len(res.iterations)  # the rest of the iteration table, built when first read (sim.iteration_table)
table_s = time.perf_counter() - t1
s = res.summary
print(json.dumps({{"wall": wall, "cpu": cpu, "table_s": table_s,
                   "table_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "sim": s["duration_s"], "iters": s["num_iterations"],
                   "rss_mb": rss_mb,
                   "finished": s["num_finished"], "preemptions": s["num_preemptions"],
                   "stepped": s["engine"]["stepped_iterations"], "ref_before": ref_before,
                   "ref_after": ref_after, "kernel": "compiled" if running_compiled(policies.step) else "interpreted"}}))
"""

# the policies' walls side by side: one process runs each in turn, `rounds` times (the first run of a
# process pays its one-time costs; load on a shared machine shifts between separate processes)
POLICY_CASE = """
import json, time
from traces import resolve_trace
from sim.run import SimConfig, run_simulation
trace = resolve_trace("sharegpt-like", num_requests={n}, rate={rate}, seed=0)
walls = {{p: [] for p in {policies!r}}}
for _ in range({rounds}):
    for p in walls:
        t0 = time.perf_counter()
        run_simulation(SimConfig(policy=p, model="opt-13b", hardware="a100-40gb", replicas=1), trace)
        walls[p].append(time.perf_counter() - t0)
print(json.dumps(walls))
"""


def policy_walls(n: int, rate: float, policies: list[str], rounds: int = 3) -> dict[str, list[float]]:
    """Each policy's wall times on the n-request run, alternated `rounds` times in one process."""
    code = POLICY_CASE.format(n=n, rate=rate, policies=policies, rounds=rounds)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def run_case(n: int, rate: float, ff: bool = True, replicas: int = 1, policy: str = "vllm",
             reruns: int = 2, compiled: str | None = None) -> dict:
    """One run in its own process: its figures, `ref` (the mean of the references timed before and
    after it) and `ratio` (wall / ref). Rerun while the two references differ by more than 20%.
    `compiled`: PAGESIM_COMPILED for that process ('0' interpreted, '1' the compiled build, which
    must be fresh; None: as this process was told, else whatever policies/_compiled.py finds).
    `kernel` in the figures says which ran."""
    code = CASE.format(n=n, rate=rate, ff=ff, replicas=replicas, policy=policy)
    env = dict(os.environ)
    if compiled is not None:
        env["PAGESIM_COMPILED"] = compiled
    for _ in range(reruns + 1):
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        lo, hi = sorted((r["ref_before"], r["ref_after"]))
        if hi <= 1.2 * lo:
            break
    r["ref"] = (r["ref_before"] + r["ref_after"]) / 2
    r["ratio"] = r["wall"] / r["ref"]
    return r


def _refs(r: dict) -> str:
    return f"python_reference_s {r['ref_before']:.3f} / {r['ref_after']:.3f}, cpu {r['cpu']:.2f} s"


def _per_request(r: dict, n: int) -> str:
    """CPU per request and the CPU time over the reference beside the wall ratio: on a shared
    machine a long run waits for the CPU more than its short references do (wall / CPU above 1),
    so a wall ratio that grows with the run's length while these stay put is load, not cost."""
    return (f"CPU {r['cpu'] / n * 1e6:.0f} us per request, {r['cpu'] / r['ref']:.0f}x python_reference_s; "
            f"wall / CPU {r['wall'] / r['cpu']:.2f}")


def targets(rate: float, policies: list[str], million: bool) -> None:
    """The issue-23 targets as ratios (see the module docstring)."""
    print(f"{'case':<34} {'wall s':>8} {'ratio':>7} {'target':>7} {'peak MiB':>8}  reference before / after")
    one = run_case(10_000, rate)
    print(f"kernel: {one['kernel']} (`make compiled` builds the compiled one, PAGESIM_COMPILED=0 forces the sources)")
    print(f"{'10,000 requests, 1 replica, vllm':<34} {one['wall']:>8.2f} {one['ratio']:>6.1f}x {'<= 8x':>7} "
          f"{one['rss_mb']:>8.0f}  {_refs(one)}")
    walls = policy_walls(10_000, rate, ["vllm", *policies]) if policies else {}
    for policy in policies:
        fastest, vllm = min(walls[policy]), min(walls["vllm"])
        middle = statistics.median(walls[policy]) / statistics.median(walls["vllm"])
        print(f"{f'10,000 requests, 1 replica, {policy}':<34} {fastest:>8.2f}  {fastest / vllm:.2f}x vllm's wall "
              f"(target <= 1.3x): the fastest of {len(walls[policy])} runs each, alternated in one process "
              f"(vllm {vllm:.2f} s; medians {middle:.2f}x)")
    r = run_case(20_000, rate * 16, replicas=16)
    print(f"{'20,000 requests, 16 least-loaded':<34} {r['wall']:>8.2f} {r['ratio']:>6.1f}x {'<= 10x':>7} "
          f"{r['rss_mb']:>8.0f}  {_refs(r)}; {r['stepped']:,} of {r['iters']:,} iterations stepped")
    if million:
        r = run_case(1_000_000, rate * 16, replicas=16, reruns=0)
        print(f"{'1,000,000 requests, 16 least-loaded':<34} {r['wall']:>8.1f} {r['ratio']:>6.0f}x {'<= 500x':>7} "
              f"{r['rss_mb']:>8.0f}  {_refs(r)}; {r['finished']:,} finished; {_per_request(r, 1_000_000)}")
        print(f"1,000,000 requests: {_peak_vs_target(r['rss_mb'])}; wall {r['ratio']:.0f}x python_reference_s "
              f"({'met' if r['ratio'] <= 500 else 'NOT met'}: target <= 500x)")
        print(f"  then the whole iteration table read (built when first read): {r['table_s']:.1f} s more "
              f"({r['table_s'] / r['ref']:.0f}x python_reference_s), peak RSS {r['table_rss_mb']:,.0f} MiB")


PEAK_TARGET_MB = 4096  # issue 23: the million-request run's peak RSS, MiB (4 GiB)


def _peak_vs_target(rss_mb: float) -> str:
    """The peak RSS (MiB, as `ru_maxrss` / 1024) against the 4 GiB target, said plainly."""
    verdict = "met" if rss_mb <= PEAK_TARGET_MB else "NOT met"
    return (f"peak RSS {rss_mb:,.0f} MiB ({rss_mb / 1024:.2f} GiB) against the target <= {PEAK_TARGET_MB:,} MiB "
            f"(4 GiB): {verdict}, {abs(PEAK_TARGET_MB - rss_mb):,.0f} MiB {'under' if rss_mb <= PEAK_TARGET_MB else 'over'}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=100.0, help="arrival rate per replica, far above capacity")
    ap.add_argument("--policies", nargs="*", default=["sjf", "vtc"],
                    help="policies timed against vllm on the 10,000-request run (default sjf vtc)")
    ap.add_argument("--million", action="store_true", help="also 1,000,000 requests over 16 replicas")
    ap.add_argument("--sizes", type=int, nargs="+", default=[],
                    help="instead: these sizes on one replica (growth), with a stepped baseline at <= 10,000")
    ap.add_argument("--no-step-baseline", action="store_true", help="--sizes: skip the stepped run")
    ap.add_argument("--routed-sizes", type=int, nargs="+", default=[],
                    help="instead: these sizes over --replicas replicas (least-loaded) at --rate x replicas")
    ap.add_argument("--replicas", type=int, default=16, help="replicas for --routed-sizes")
    ap.add_argument("--compiled", action="store_true",
                    help="instead: the 20,000 / 16 run interpreted vs the compiled build (`make compiled` first)")
    ap.add_argument("--rounds", type=int, default=2, help="--compiled: alternations of the two (default 2)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    print_machine()
    if args.compiled:
        compiled_vs_interpreted(args.rate, args.rounds)
    elif args.routed_sizes:
        routed(args.routed_sizes, args.rate, args.replicas)
    elif args.sizes:
        growth(args.sizes, args.rate, args.no_step_baseline)
    else:
        targets(args.rate, args.policies, args.million)


def compiled_vs_interpreted(rate: float, rounds: int) -> None:
    """The 20,000-request, 16-replica run interpreted (PAGESIM_COMPILED=0) and on the compiled build
    (PAGESIM_COMPILED=1: `make compiled` first), alternated `rounds` times in this sitting, each
    beside its own python_reference_s; the speed-up is the ratio of the medians of wall / reference.
    The two must give the same simulation (iterations, finishes and preemptions)."""
    print(f"{'20,000 requests, 16 least-loaded':<34} {'wall s':>8} {'ratio':>7}  reference before / after")
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    for _ in range(rounds):
        for mode, label in (("0", "interpreted"), ("1", "compiled")):
            r = run_case(20_000, rate * 16, replicas=16, compiled=mode)
            runs[mode].append(r)
            print(f"{label:<34} {r['wall']:>8.2f} {r['ratio']:>6.1f}x  {_refs(r)}")
    same = {(r["iters"], r["finished"], r["preemptions"], r["sim"]) for rs in runs.values() for r in rs}
    if len(same) != 1:
        raise SystemExit(f"compiled and interpreted runs differ: {sorted(same)}")
    interp, comp = (statistics.median(r["ratio"] for r in runs[m]) for m in ("0", "1"))
    cpu_interp, cpu_comp = (statistics.median(r["cpu"] for r in runs[m]) for m in ("0", "1"))
    wall_interp, wall_comp = (statistics.median(r["wall"] for r in runs[m]) for m in ("0", "1"))
    print(f"compiled build: {interp / comp:.2f}x the interpreted one (median wall / reference "
          f"{interp:.1f}x -> {comp:.1f}x over {rounds} rounds; target >= 2.5x); wall {wall_interp:.2f} -> "
          f"{wall_comp:.2f} s ({wall_interp / wall_comp:.2f}x), CPU {cpu_interp:.2f} -> {cpu_comp:.2f} s "
          f"({cpu_interp / cpu_comp:.2f}x); same simulation")


def growth(sizes: list[int], rate: float, no_step_baseline: bool) -> None:
    """Each size on one replica (vllm), skip-ahead, and stepped too at 10,000 or fewer."""
    print(f"{'requests':>9} {'mode':>10} {'wall s':>8} {'ratio':>7} {'peak MiB':>8} {'iterations':>10} {'sim s':>8}")
    skipped = []  # the skip-ahead runs, by size
    for n in sizes:
        for ff in [True] if no_step_baseline or n > 10_000 else [True, False]:
            r = run_case(n, rate, ff)
            if ff:
                skipped.append(r)
            print(f"{n:>9,} {'skip-ahead' if ff else 'step':>10} {r['wall']:>8.2f} {r['ratio']:>6.1f}x "
                  f"{r['rss_mb']:>8.0f} {r['iters']:>10,} {r['sim']:>8.0f}  {_refs(r)}")
    if len(sizes) >= 2:
        print(f"growth: {sizes[-1] / sizes[0]:.0f}x requests -> {skipped[-1]['ratio'] / skipped[0]['ratio']:.1f}x wall time "
              "(as ratios to the reference)")


def routed(sizes: list[int], rate: float, replicas: int) -> None:
    """Each size over `replicas` replicas behind least-loaded routing, each replica at `rate`."""
    if replicas < 2:
        raise SystemExit(f"--routed-sizes: --replicas must be >= 2, got {replicas}")
    cpu_per_request = []
    for n in sizes:
        r = run_case(n, rate * replicas, True, replicas, reruns=0)
        cpu_per_request.append(r["cpu"] / n)
        print(f"{n:,} requests on {replicas} replicas (least-loaded) at {rate * replicas:g} req/s: {r['wall']:.1f} s "
              f"wall ({r['ratio']:.0f}x; {_refs(r)}), {r['iters']:,} iterations ({r['stepped']:,} stepped), "
              f"peak RSS {r['rss_mb']:,.0f} MiB, {r['finished']:,} finished; {_per_request(r, n)}")
        if n >= 1_000_000:
            print(f"{n:,} requests: {_peak_vs_target(r['rss_mb'])}")
    if len(sizes) >= 2:
        print(f"growth: {sizes[-1] / sizes[0]:.0f}x requests -> CPU per request x{cpu_per_request[-1] / cpu_per_request[0]:.2f}")


if __name__ == "__main__":
    main()
