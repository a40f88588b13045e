"""Scheduling policies compared (`pagesim policies`): one workload served under each policy at each
request rate, over several seeds -> throughput-latency, SLO attainment and fairness against rate,
with confidence intervals across seeds.

A seed re-draws a synthetic workload (lengths, clients, arrivals); for a trace file it takes the
next window of `num_requests` consecutive requests, so the seeds see different slices of the real
trace. Every policy sees the same requests at the same times for a given (rate, seed).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from analysis.cli_args import study_title
from analysis.parallel import add_executor_args, executor_options, run_tasks
from policies.metrics import headline_latency, headline_mean_normalized_latency, per_client
from policies.registry import parse_policy_args, resolve_policy
from sim.run import SimConfig, run_simulation
from traces import apply_arrivals, load_trace
from traces.synthetic import SYNTHETIC, make_synthetic
from traces.trace import Trace

METRICS = {  # column -> axis label, for the figure
    "throughput": "finished requests/s",
    "mean_normalized_latency": "normalized latency (s/token)",
    "ttft_p90": "TTFT p90 (s)",
    "slo_attainment": "SLO attainment",
    "min_client_attainment": "worst client's SLO attainment",
    "max_service_gap": "max service gap between active clients (tokens)",
}


def workload(spec: str, num_requests: int, seed: int, rate: float) -> Trace:
    """The requests seed `seed` serves at `rate` (see the module docstring)."""
    if spec in SYNTHETIC:
        return apply_arrivals(make_synthetic(spec, num_requests, seed=seed), rate=rate, seed=seed)
    trace = load_trace(spec)
    start = seed * num_requests
    if start + num_requests > len(trace):
        raise ValueError(f"{spec}: seed {seed} needs requests {start}..{start + num_requests - 1}, but the trace "
                         f"holds {len(trace)}; use fewer --seeds or a smaller --num-requests")
    part = _window(trace, start, num_requests)
    return apply_arrivals(part, rate=rate, seed=seed)


def _window(trace: Trace, start: int, n: int) -> Trace:
    """Requests [start, start + n), their arrivals shifted to begin at 0."""
    rest = trace.head(start + n)
    cut = slice(start, start + n)
    fields = {f.name: getattr(rest, f.name) for f in dataclasses.fields(rest)}
    for name, value in fields.items():
        if isinstance(value, (np.ndarray, list)) and len(value) == len(rest):
            fields[name] = value[cut]
    if rest.has_timestamps and n:
        fields["arrival"] = fields["arrival"] - fields["arrival"][0]
    return Trace(**fields)


def policy_study(spec: str, base: SimConfig, policies: Sequence[str], rates: Sequence[float], seeds: int,
                 num_requests: int, options: dict[str, dict[str, Any]] | None = None, jobs: int = 1,
                 on_result: Callable[[dict], None] | None = None, executor: str = "process",
                 address: str | None = None) -> pd.DataFrame:
    """One row per (policy, rate, seed); `options[policy]` are that policy's keyword options.
    `jobs` worker processes, or `executor` "ray" at `address`, run the simulations (same table)."""
    for p in policies:
        resolve_policy(p)  # a bad name fails before any simulation
    tasks = []
    for rate in rates:
        for seed in range(seeds):
            trace = workload(spec, num_requests, seed, rate)
            for p in policies:
                cfg = dataclasses.replace(base, policy=p, policy_options=(options or {}).get(p, {}), seed=seed)
                tasks.append((cfg, trace, rate))
    return pd.DataFrame(run_tasks(_one_run, tasks, jobs, None if on_result is None else (lambda i, r: on_result(r)),
                                  executor, address))


def _one_run(cfg: SimConfig, trace: Trace, rate: float) -> dict:
    t0 = time.perf_counter()
    res = run_simulation(cfg, trace)
    s = res.summary
    clients, fairness = per_client(res.requests, cfg.slo_ttft, cfg.slo_tpot)
    return {"policy": cfg.policy, "rate": rate, "seed": cfg.seed, "requests": s["num_requests"],
            "rejected": s["num_rejected"], "throughput": s["request_throughput"],
            "mean_normalized_latency": headline_mean_normalized_latency(s),
            "ttft_mean": headline_latency(s, "ttft")["mean"], "ttft_p90": headline_latency(s, "ttft")["p90"],
            "e2e_mean": headline_latency(s, "e2e_latency")["mean"], "goodput": s["goodput"],
            "slo_attainment": s["slo_attainment"],
            "min_client_attainment": float(clients.slo_attainment.min()) if len(clients) else float("nan"),
            "jain_service": fairness["jain_service"], "max_service_gap": fairness["max_service_gap"],
            "preemptions": s["num_preemptions"], "wall_s": time.perf_counter() - t0}


def summary_table(table: pd.DataFrame) -> pd.DataFrame:
    """Mean and 95% confidence half-width (t distribution over seeds) per (policy, rate)."""
    from scipy import stats

    rows = []
    for (policy, rate), g in table.groupby(["policy", "rate"], sort=False):
        row: dict[str, Any] = {"policy": policy, "rate": rate, "seeds": len(g)}
        for m in METRICS:
            x = g[m].dropna().to_numpy(float)
            row[m] = float(x.mean()) if len(x) else float("nan")
            half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)) if len(x) > 1 else float("nan")
            row[f"{m}_ci95"] = float(half)
        rows.append(row)
    return pd.DataFrame(rows)


def policy_plot(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """One panel per metric against rate, a line per policy, 95% CI bands across seeds."""
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (metric, label) in zip(axes.flat, METRICS.items()):
        sns.lineplot(data=table, x="rate", y=metric, hue="policy", marker="o", errorbar=("ci", 95), ax=ax,
                     legend=ax is axes.flat[0])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        if metric == "mean_normalized_latency":
            ax.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`pagesim policies`, with its own arguments."""
    from pagesim.argtypes import out_dir, positive_float, positive_int, rate
    p = sub.add_parser("policies", help="compare scheduling policies over rates and seeds: latency, SLOs, fairness",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="multi-client",
                   help=f"a trace file, or a synthetic workload: {', '.join(SYNTHETIC)} (default multi-client)")
    p.add_argument("--num-requests", type=positive_int, default=1000, help="requests per run (default 1000)")
    p.add_argument("--policies", nargs="+", default=["vllm", "priority", "sjf", "vtc", "edf"],
                   help="registry names or package.module:Class (default: vllm priority sjf vtc edf)")
    p.add_argument("--policy-arg", action="append", metavar="POLICY.KEY=VALUE", dest="policy_args",
                   help="an option of one policy, e.g. sjf.aging=2 or edf.slo_ttft=1 (repeatable)")
    p.add_argument("--rates", type=rate, nargs="+", required=True, help="request rates, req/s")
    p.add_argument("--seeds", type=positive_int, default=3, help="seeds per (policy, rate) (default 3)")
    p.add_argument("--jobs", type=positive_int, default=1, help="worker processes (default 1)")
    add_executor_args(p)
    p.add_argument("--model", default="opt-13b", help="catalogue name, config.json or HF id (default opt-13b)")
    p.add_argument("--hardware", default="a100-40gb", help="name or hardware JSON file (default a100-40gb)")
    p.add_argument("--calibration", help="price iterations with a calibration (file or shipped name)")
    p.add_argument("--num-gpu-blocks", type=positive_int, help="override the derived KV capacity (blocks)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=4096)
    p.add_argument("--chunked-prefill", action="store_true")
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--slo-ttft", type=positive_float, help="TTFT SLO (s) for requests without their own SLO class")
    p.add_argument("--slo-tpot", type=positive_float, help="TPOT SLO (s) for requests without their own SLO class")
    p.add_argument("--out", type=out_dir, required=True, help="output folder")
    p.set_defaults(func=run)


def split_policy_args(items: list[str] | None, policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`policy.key=value` items grouped by policy (the policy must be one of those compared)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        name, dot, rest = item.partition(".")
        if not dot or name not in policies:
            raise ValueError(f"--policy-arg {item!r}: expected POLICY.KEY=VALUE with POLICY one of "
                             f"{', '.join(policies)}")
        out.setdefault(name, {}).update(parse_policy_args([rest]))
    return out


def run(args: argparse.Namespace) -> int:
    if args.seeds < 1 or args.num_requests < 1 or args.jobs < 1 or min(args.rates) <= 0:
        raise ValueError("--seeds, --num-requests and --jobs must be >= 1 and every rate > 0")
    options = split_policy_args(args.policy_args, args.policies)
    base = SimConfig(model=args.model, hardware=args.hardware, num_gpu_blocks=args.num_gpu_blocks,
                     chunked_prefill=args.chunked_prefill, prefix_caching=args.prefix_caching,
                     max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot, calibration=args.calibration)
    out = Path(args.out)
    print(f"policies: {args.num_requests} requests of {args.trace} x {len(args.rates)} rates x {args.seeds} seeds, "
          f"{', '.join(args.policies)}, {study_title(args)}")
    print(f"{'policy':<12} {'rate':>6} {'seed':>4} {'req/s':>7} {'norm lat':>9} {'TTFT p90':>9} {'SLO ok':>7} "
          f"{'Jain':>6} {'wall s':>7}")

    def show(r: dict) -> None:
        print(f"{r['policy'][:12]:<12} {r['rate']:>6.2f} {r['seed']:>4} {r['throughput']:>7.3f} "
              f"{r['mean_normalized_latency']:>9.4f} {r['ttft_p90']:>9.3f} {r['slo_attainment']:>7.1%} "
              f"{r['jain_service']:>6.3f} {r['wall_s']:>7.2f}", flush=True)

    table = policy_study(args.trace, base, args.policies, args.rates, args.seeds, args.num_requests, options,
                         args.jobs, on_result=show, **executor_options(args))
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "policies.csv", index=False)
    summary_table(table).to_csv(out / "policies_summary.csv", index=False)
    policy_plot(table, out / "policies.png", f"{args.trace}, {args.num_requests} requests, {study_title(args)}; "
                f"95% CI over {args.seeds} seeds")
    print(f"wrote {out}/policies.csv, policies_summary.csv, policies.png")
    return 0
