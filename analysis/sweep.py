"""Sweeps: one trace, several policies, several request rates -> a table and throughput-latency
curves (the shape of the vLLM paper's Figure 12: mean normalized latency against request rate)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.cli_args import (
    add_replica_args,
    add_seeds_arg,
    add_study_args,
    sim_config,
    study_title,
    study_workloads,
)
from analysis.parallel import executor_options, run_tasks
from analysis.report import Columns
from analysis.seeds import seed_cell, seeded, seeds_note, write_seed_summary
from pagesim.argtypes import out_dir, positive_float, positive_int
from policies.metrics import headline_latency, headline_mean_normalized_latency
from policies.registry import PAGED_ONLY_DEFAULTS, POLICIES
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
    tasks = []
    for rate in rates:
        for seed, workload in runs:
            timed = apply_arrivals(workload, rate=rate, seed=seed)  # Poisson, or a timestamped trace rescaled
            for policy in policies:
                cfg = dataclasses.replace(base, policy=policy, seed=seed, **({} if policy == "vllm" else PAGED_ONLY))
                tasks.append((cfg, timed, rate, rate == max(rates) and seed == runs[0][0], tagged))
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
    it = res.iterations
    kv = it[["kv_token_states", "kv_reserved", "kv_internal_frag", "kv_external_frag"]]
    return row, (kv.mul(it.duration, axis=0).sum() / max(it.duration.sum(), 1e-12)).to_dict()


def headline(s: dict) -> dict:
    """The numbers a sweep row keeps from a run's summary."""
    ttft = headline_latency(s, "ttft")
    return {"throughput": s["request_throughput"], "mean_normalized_latency": headline_mean_normalized_latency(s),
            "ttft_mean": ttft["mean"], "ttft_p90": ttft["p90"], "tpot_p90": headline_latency(s, "tpot")["p90"],
            "e2e_p90": headline_latency(s, "e2e_latency")["p90"], "goodput": s["goodput"], "preemptions": s["num_preemptions"],
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


# ---- the command: `pagesim sweep` ----

def add_parser(sub: argparse._SubParsersAction) -> None:
    sw = sub.add_parser("sweep", help="simulate several policies over several request rates and plot",
                        description="Throughput-latency curves: writes sweep.csv, latency_vs_rate.png and "
                                    "memory_breakdown.png to --out.")
    add_study_args(sw, "sharegpt-like", [0.5, 1.0, 1.5, 2.0, 2.5])
    add_seeds_arg(sw)
    sw.add_argument("--policies", nargs="+", default=["vllm", "orca-oracle", "orca-pow2", "orca-max"],
                    choices=list(POLICIES))
    sw.add_argument("--tp", type=positive_int, default=1)
    sw.add_argument("--max-num-seqs", type=positive_int, default=256)
    sw.add_argument("--max-num-batched-tokens", type=positive_int, default=4096)
    sw.add_argument("--n", type=positive_int)
    sw.add_argument("--beam-width", type=positive_int)
    paged = sw.add_argument_group("vllm options (the contiguous baselines run without them)")
    paged.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    paged.add_argument("--chunked-prefill", action="store_true")
    paged.add_argument("--prefix-caching", action="store_true")
    add_replica_args(sw)
    sw.add_argument("--latency-limit", type=positive_float, default=1.0,
                    help="normalized latency (s/token) for the max-sustainable-rate line (default 1.0)")
    sw.add_argument("--out", type=out_dir, required=True)
    sw.set_defaults(func=command)


@dataclass
class SweepStudy:
    """A sweep as its arguments define it: the workload (one trace, or one per seed), its first
    trace, and the configuration every run starts from."""

    workload: Trace | list[Trace]
    trace: Trace
    base: SimConfig


@dataclass
class SweepTables:
    study: SweepStudy
    table: pd.DataFrame   # one row per (policy, rate[, seed])
    memory: dict          # per policy: the KV memory breakdown at the highest rate, first seed


def prepare(args: argparse.Namespace) -> SweepStudy:
    workload, trace = study_workloads(args)
    return SweepStudy(workload, trace, sim_config(args))


def run(args: argparse.Namespace, study: SweepStudy | None = None,
        on_row: Callable[[dict], None] | None = None) -> SweepTables:
    """The sweep's tables; `on_row(row)` as each run finishes."""
    study = study or prepare(args)
    table, memory = sweep(study.workload, study.base, args.policies, args.rates, on_result=on_row, jobs=args.jobs,
                          **executor_options(args))
    return SweepTables(study, table, memory)


def command(args: argparse.Namespace) -> int:
    study = prepare(args)
    print_header(args, study)
    write_report(args, run(args, study, on_row=print_row))
    return 0


def print_header(args: argparse.Namespace, study: SweepStudy) -> None:
    replicas = f"{study.base.replicas} replicas ({args.router}) of " if study.base.replicas > 1 else ""
    print(f"sweep: {len(study.trace)} requests of {study.trace.name}, {replicas}{study_title(args)}")
    vllm_opts = [o for o, on in (("--chunked-prefill", args.chunked_prefill), ("--prefix-caching", args.prefix_caching),
                                 (f"--preemption {args.preemption}", args.preemption != "recompute")) if on]
    if vllm_opts:
        print(f"{' '.join(vllm_opts)}: vllm runs only")
    print(COLUMNS.header() + (f" {'seed':>5}" if args.seeds > 1 else ""))


COLUMNS = Columns(("policy", "policy", "<12"), ("rate", "rate", ">6.2f"), ("req/s", "throughput", ">7.3f"),
                  ("norm lat", "mean_normalized_latency", ">9.4f"), ("p90 TTFT", "ttft_p90", ">9.2f"),
                  ("preempt", "preemptions", ">8"), ("wall s", "wall_s", ">7.2f"))


def print_row(r: dict) -> None:
    print(COLUMNS.row(r) + seed_cell(r), flush=True)


def write_report(args: argparse.Namespace, result: SweepTables) -> None:
    """sweep.csv (and sweep_summary.csv with seeds), the two figures, and the closing lines."""
    from analysis.plots import latency_vs_rate, memory_breakdown

    table, trace = result.table, result.study.trace
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "sweep.csv", index=False)
    write_seed_summary(table, ["policy", "rate"], out / "sweep_summary.csv", "mean_normalized_latency")
    latency_vs_rate(table, out / "latency_vs_rate.png", f"{trace.name}, {study_title(args)}" + seeds_note(args.seeds))
    memory_breakdown(result.memory, out / "memory_breakdown.png", f"KV memory at {max(args.rates)} req/s")
    best = max_sustainable_rate(table, args.latency_limit)
    print(f"\nhighest swept rate with mean normalized latency <= {args.latency_limit} s/token: "
          + ", ".join(f"{p} {r:g}" for p, r in best.items()))
    print(f"wrote {out}/sweep.csv, latency_vs_rate.png, memory_breakdown.png")
