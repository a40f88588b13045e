"""Policies benchmark: scheduling plus block bookkeeping time per decode iteration.

For 32, 256 and 1,024 running sequences, paged (`vllm`) and contiguous (`orca-max`), in steady state
(every sequence decoding, outputs long enough that nothing finishes, a cache large enough that
nothing is preempted), it times one iteration of the engine loop without a model:

    plan = scheduler.schedule(now)
    result = StepResult(duration, {seq id: SeqOutcome(seq id) for each sampling sequence})
    scheduler.on_step_done(plan, result, now)

Target (issue 2): at most 2 microseconds per sequence per iteration, because this cost bounds both
simulation speed and live overhead. Run: `python -m benchmarks.bench_policies [--iters N] [--quick]`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from policies.plan import SeqOutcome, StepResult
from policies.registry import make_scheduler
from policies.request import Request, SamplingParams
from policies.scheduler import Scheduler

TARGET_US_PER_SEQ = 2.0
SIZES = (32, 256, 1024)
POLICIES = ("vllm", "orca-max")
PROMPT = 32
BLOCK = 16


def trivial_step(sched: Scheduler, now: float) -> int:
    """One engine iteration with an executor that only builds outcomes. Returns sequences run."""
    plan = sched.schedule(now)
    outcomes = {ss.seq_id: SeqOutcome(ss.seq_id) for ss in plan.seqs if ss.samples}
    sched.on_step_done(plan, StepResult(0.01, outcomes), now + 0.01)
    return len(plan.seqs)


def steady_scheduler(policy: str, num_seqs: int, iters: int) -> Scheduler:
    """A scheduler with `num_seqs` sequences admitted, prefilled and decoding, with room for
    `iters` more iterations (plus warm-up) without finishing or preempting anything."""
    max_tokens = 4 * (iters + 64)
    per_seq = -(-(PROMPT + max_tokens) // BLOCK)
    if policy.startswith("orca"):
        per_seq = 1 << (per_seq - 1).bit_length()  # the buddy allocator rounds chunks to powers of two
    sched = make_scheduler(policy, num_blocks=num_seqs * per_seq + 16, block_size=BLOCK,
                           max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, num_seqs))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):
        sched.add_request(Request(i, 0.0, PROMPT, sp, output_len=max_tokens))
    now = 0.0
    while sched.waiting or any(s.num_computed < s.prompt_len for g in sched.running for s in g.seqs):
        trivial_step(sched, now)
        now += 0.01
    for _ in range(8):  # warm-up decode iterations
        trivial_step(sched, now)
        now += 0.01
    assert sched.num_running_seqs == num_seqs and not sched.waiting, "not in steady state"
    return sched


def measure(policy: str, num_seqs: int, iters: int, repeats: int = 5) -> float:
    """Median over `repeats` runs of the mean time of one decode iteration, in seconds."""
    sched = steady_scheduler(policy, num_seqs, iters * repeats)
    now = 1000.0
    samples = []
    gc.collect()
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            n = trivial_step(sched, now)
            now += 0.01
        samples.append((time.perf_counter() - t0) / iters)
        assert n == num_seqs, f"{policy}: {n} of {num_seqs} sequences ran (not steady)"
    assert not sched.done and sched.num_preemptions == 0, f"{policy}: left steady state during measurement"
    return statistics.median(samples)


def run(sizes: tuple[int, ...] = SIZES, policies: tuple[str, ...] = POLICIES, iters: int = 80,
        repeats: int = 7) -> list[dict]:
    """`iters` iterations per timing run at 256 sequences, scaled so every size runs about as many
    sequence-iterations (garbage collection, which grows with the number of live objects, is
    amortized alike); the median of `repeats` runs is reported."""
    rows = []
    for n in sizes:
        for policy in policies:
            t = measure(policy, n, max(iters * 256 // n, 10), repeats)
            us = t * 1e6
            rows.append({"sequences": n, "policy": policy, "us_per_iter": us, "us_per_seq": us / n,
                         "target_us_per_seq": TARGET_US_PER_SEQ, "ratio": us / n / TARGET_US_PER_SEQ})
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'sequences':>9}  {'policy':<9}  {'us/iter':>9}  {'us/seq':>7}  {'target':>6}  {'ratio':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = "ok" if r["ratio"] <= 1 else "MISS"
        lines.append(f"{r['sequences']:>9}  {r['policy']:<9}  {r['us_per_iter']:>9.1f}  {r['us_per_seq']:>7.2f}  "
                     f"{r['target_us_per_seq']:>6.1f}  {r['ratio']:>5.2f} {ok}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_policies", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=80, help="iterations per timing run at 256 sequences "
                                                           "(scaled for other sizes; default 80)")
    ap.add_argument("--repeats", type=int, default=7, help="timing runs per row; the median is shown")
    ap.add_argument("--quick", action="store_true", help="32 and 256 sequences only, fewer iterations")
    args = ap.parse_args(argv)
    sizes = SIZES[:2] if args.quick else SIZES
    rows = run(sizes, POLICIES, 10 if args.quick else args.iters, 3 if args.quick else args.repeats)
    print("policies: schedule() + on_step_done() + trivial executor, per steady-state decode iteration")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
