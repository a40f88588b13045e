"""Sweeps: one trace, several policies, several request rates -> a table and throughput-latency
curves (the shape of the vLLM paper's Figure 12: mean normalized latency against request rate)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd

from analysis.parallel import run_tasks
from analysis.plots import latency_vs_rate, memory_breakdown, serving_panels
from analysis.rate_study import RateStudy
from analysis.report import Report, table_value
from analysis.seeds import seeded, seeded_report, seeds_note
from policies.metrics import headline_latency, headline_mean_normalized_latency
from policies.registry import PAGED_ONLY_DEFAULTS
from sim.run import SimConfig, run_simulation
from traces import apply_arrivals
from traces.trace import Trace

# the paged-only options a SimConfig carries, switched off for the contiguous baselines
PAGED_ONLY = {k: v for k, v in PAGED_ONLY_DEFAULTS.items() if k in SimConfig.__dataclass_fields__}


def sweep(trace: Trace | Sequence[Trace], base: SimConfig, policies: Sequence[str], rates: Sequence[float],
          on_result: Callable[[dict], None] | None = None, jobs: int = 1, executor: str = "process",
          address: str | None = None) -> tuple[pd.DataFrame, dict]:
    """Simulate every (policy, rate). The same lengths are used at every rate; arrivals are
    Poisson at the rate with the config's seed. The base config's paged-only options (preemption
    mode, chunked prefill, prefix caching) apply to the vllm runs; the contiguous baselines run
    without them. Returns (one row per run, the memory breakdown of each policy's run at the
    highest rate, first seed). `jobs` worker processes run the simulations, or `executor` "ray"
    runs them on the Ray cluster at `address` (the same table either way). A sequence of traces,
    one per seed (analysis.seeds), repeats the sweep for each and adds a `seed` column."""
    runs, tagged = seeded(trace, base.seed)
    # Poisson, or a timestamped trace rescaled; one object per (rate, seed), shared by the policies
    timed = {(rate, seed): apply_arrivals(workload, rate=rate, seed=seed) for rate in rates for seed, workload in runs}
    tasks = []  # the table's order (and the printed rows'): policy, then rate, then seed
    for policy in policies:
        for rate in rates:
            for seed, _ in runs:
                cfg = dataclasses.replace(base, policy=policy, seed=seed, **({} if policy == "vllm" else PAGED_ONLY))
                tasks.append((cfg, timed[rate, seed], rate, rate == max(rates) and seed == runs[0][0], tagged))
    done = run_tasks(_sweep_run, tasks, jobs, None if on_result is None else (lambda i, r: on_result(r[0])),
                     executor, address)
    memory = {row["policy"]: mem for row, mem in done if mem is not None}
    return pd.DataFrame([row for row, _ in done]), memory


def _sweep_run(cfg: SimConfig, timed: Trace, rate: float, with_memory: bool,
               tag_seed: bool = False) -> tuple[dict, dict | None]:
    res = run_simulation(cfg, timed)
    row = {"policy": cfg.policy, "rate": rate, **({"seed": cfg.seed} if tag_seed else {}), **headline(res.summary)}
    if not with_memory:
        return row, None
    memory = ["kv_token_states", "kv_reserved", "kv_internal_frag", "kv_external_frag"]
    it = res.iteration_columns(["duration", *memory])
    return row, (it[memory].mul(it.duration, axis=0).sum() / max(it.duration.sum(), 1e-12)).to_dict()


def headline(s: dict) -> dict:
    """The numbers a sweep row keeps from a run's summary."""
    ttft = headline_latency(s, "ttft")
    return {"throughput": s["request_throughput"], "mean_normalized_latency": headline_mean_normalized_latency(s),
            "ttft_mean": ttft["mean"], "ttft_p50": ttft["p50"], "ttft_p90": ttft["p90"],
            "tpot_p50": headline_latency(s, "tpot")["p50"], "tpot_p90": headline_latency(s, "tpot")["p90"],
            "e2e_p90": headline_latency(s, "e2e_latency")["p90"], "goodput": table_value(s["goodput"]),
            "preemptions": s["num_preemptions"],
            "rejected": s["num_rejected"], "kv_token_state_fraction": s["kv_token_state_fraction"],
            "mean_batched_seqs": s["mean_batched_seqs"], "prefix_hit_tokens": s["prefix_hit_tokens"],
            "wall_s": s["wall_time_s"]}


def max_sustainable_rate(table: pd.DataFrame, latency_limit: float) -> dict[str, float]:
    """Per policy, the highest swept rate whose mean normalized latency stays under the limit (with
    seeds: its mean over seeds)."""
    if "seed" in table:
        table = table.groupby(["policy", "rate"], sort=False, as_index=False).mean_normalized_latency.mean()
    out = {}
    for policy, g in table.groupby("policy", sort=False):
        ok = g[g.mean_normalized_latency <= latency_limit]
        out[policy] = float(ok.rate.max()) if len(ok) else float("nan")
    return out


# ---- the study `pagesim sweep` runs ----

@dataclass(kw_only=True)
class SweepStudy(RateStudy):
    """A sweep's configuration: the policies, and the latency limit of the max-sustainable-rate line."""

    policies: list[str]
    latency_limit: float = 1.0


@dataclass
class SweepTables:
    study: SweepStudy
    table: pd.DataFrame   # one row per (policy, rate[, seed])
    memory: dict          # per policy: the KV memory breakdown at the highest rate, first seed


def run_sweep(study: SweepStudy, on_row: Callable[[dict], None] | None = None) -> SweepTables:
    """The sweep's tables; `on_row(row)` as each run finishes."""
    table, memory = sweep(study.workload, study.base, study.policies, study.rates, on_result=on_row,
                          **study.workers.options())
    return SweepTables(study, table, memory)


def sweep_report(result: SweepTables) -> Report:
    """sweep.csv (and sweep_summary.csv with seeds), the two figures, and the closing lines."""
    study, table = result.study, result.table
    report = seeded_report(table, "sweep.csv", ["policy", "rate"], "mean_normalized_latency")
    report.figure("latency_vs_rate.png", lambda path: latency_vs_rate(
        table, path, f"{study.trace.name}, {study.title}" + seeds_note(study.seeds)))
    report.figure("serving.png", lambda path: serving_panels(
        table, path, f"{study.trace.name}, {study.title}" + seeds_note(study.seeds)))
    report.figure("memory_breakdown.png", lambda path: memory_breakdown(
        result.memory, path, f"KV memory at {max(study.rates)} req/s"))
    best = max_sustainable_rate(table, study.latency_limit)
    report.say(f"\nhighest swept rate with mean normalized latency <= {study.latency_limit} s/token: "
               + ", ".join(f"{p} {r:g}" for p, r in best.items()))
    report.wrote("sweep.csv", "latency_vs_rate.png", "serving.png", "memory_breakdown.png")
    return report
