"""Colocated or disaggregated? One trace on the same number of GPUs, served colocated (every
replica prefills and decodes) and split into prefill and decode replicas (sim/disagg.py), at
several rates: TTFT, TPOT and normalized latency for each, the DistServe comparison."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.cli_args import (
    add_study_args,
    gigabytes_per_s,
    router_name,
    sim_config,
    study_title,
    study_trace,
)
from analysis.parallel import executor_options, run_tasks
from analysis.plots import rate_panels
from analysis.report import Columns
from analysis.sweep import headline
from pagesim.argtypes import out_dir, positive_float, positive_int
from policies.metrics import headline_latency
from sim.run import SimConfig, run_simulation
from traces import apply_arrivals
from traces.trace import Trace


def setups(gpus: int, splits: Sequence[tuple[int, int]] | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """("colocated", ()) and every (prefill, decode) split of `gpus` (or the given splits)."""
    if gpus < 2:
        raise ValueError(f"a disaggregation study needs at least 2 GPUs, got {gpus}")
    chosen = list(splits) if splits else [(p, gpus - p) for p in range(1, gpus)]
    for p, d in chosen:
        if p < 1 or d < 1 or p + d != gpus:
            raise ValueError(f"split {p}+{d}: needs prefill, decode >= 1 adding up to {gpus} GPUs")
    return [("colocated", ())] + [(f"{p}+{d}", (p, d)) for p, d in chosen]


def disagg_study(trace: Trace, base: SimConfig, gpus: int, rates: Sequence[float],
                 splits: Sequence[tuple[int, int]] | None = None, jobs: int = 1,
                 on_result: Callable[[dict], None] | None = None, executor: str = "process",
                 address: str | None = None) -> pd.DataFrame:
    """One row per (setup, rate). Colocated runs `gpus` replicas behind base.router; each split
    runs its prefill replicas behind base.router and its decode replicas behind least-loaded.
    `jobs` worker processes, or `executor` "ray" at `address`, run the simulations (same table)."""
    tasks = []
    for rate in rates:
        timed = apply_arrivals(trace, rate=rate, seed=base.seed)
        for name, split in setups(gpus, splits):
            cfg = dataclasses.replace(base, replicas=1 if split else gpus, disaggregate=split)
            tasks.append((cfg, timed, name, rate))
    return pd.DataFrame(run_tasks(_run, tasks, jobs, None if on_result is None else (lambda i, r: on_result(r)),
                                  executor, address))


def _run(cfg: SimConfig, timed: Trace, setup: str, rate: float) -> dict:
    s = run_simulation(cfg, timed).summary
    return {"setup": setup, "rate": rate, **headline(s), "tpot_mean": headline_latency(s, "tpot")["mean"],
            "slo_attainment": s["slo_attainment"]}


def disagg_plot(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """P90 TTFT, P90 TPOT and mean normalized latency against rate, one line per setup (log scale)."""
    return rate_panels(table, "setup", [("ttft_p90", "P90 TTFT (s)", True, None), ("tpot_p90", "P90 TPOT (s)", True, None),
                                        ("mean_normalized_latency", "mean normalized latency (s/token)", True, None)],
                       path, title, label=lambda s: s if s == "colocated" else f"{s} (prefill+decode)")


# ---- the command: `pagesim disagg` ----

def add_parser(sub: argparse._SubParsersAction) -> None:
    dg = sub.add_parser("disagg", help="colocated or disaggregated prefill/decode on the same GPUs (simulated)",
                        description="Serve one trace on --gpus GPUs colocated and split into prefill and decode "
                                    "replicas (every split, or --splits), at each rate. Writes disagg.csv and "
                                    "disagg.png (P90 TTFT, P90 TPOT, normalized latency against rate) to --out.")
    add_study_args(dg, "sharegpt-like", [4.0, 8.0, 12.0])
    dg.set_defaults(model="llama-3-8b", hardware="a100-80gb")
    dg.add_argument("--gpus", type=positive_int, default=4, help="GPUs in every setup (default 4)")
    dg.add_argument("--splits", nargs="+", metavar="P+D", help="prefill+decode splits to try (default: all)")
    dg.add_argument("--router", default="least-loaded", type=router_name, metavar="ROUTER",
                    help="router over the colocated replicas and over the prefill replicas (default least-loaded)")
    dg.add_argument("--transfer-bandwidth", type=gigabytes_per_s, metavar="GB/S", help="KV link (default: NVLink)")
    dg.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    dg.add_argument("--chunked-prefill", action="store_true", help="chunked prefill in every replica")
    dg.add_argument("--slo-ttft", type=positive_float)
    dg.add_argument("--slo-tpot", type=positive_float)
    dg.add_argument("--out", type=out_dir, required=True)
    dg.set_defaults(func=command)


@dataclass
class DisaggStudy:
    """A disaggregation study as its arguments define it: the splits (None: every split), the setups'
    names, the trace and the configuration every run starts from."""

    splits: list[tuple[int, int]] | None
    names: list[str]
    trace: Trace
    base: SimConfig


@dataclass
class DisaggTables:
    study: DisaggStudy
    table: pd.DataFrame  # one row per (setup, rate)


def parse_splits(texts: Sequence[str] | None) -> list[tuple[int, int]] | None:
    """--splits PREFILL+DECODE ... as (prefill, decode) pairs (None: not given)."""
    if not texts:
        return None
    try:
        splits = [tuple(int(x) for x in s.split("+")) for s in texts]
    except ValueError:
        raise ValueError(f"--splits: expected PREFILL+DECODE such as 2+2, got {texts}") from None
    if any(len(s) != 2 for s in splits):
        raise ValueError(f"--splits: expected PREFILL+DECODE such as 2+2, got {texts}")
    return splits


def prepare(args: argparse.Namespace) -> DisaggStudy:
    splits = parse_splits(args.splits)
    names = [n for n, _ in setups(args.gpus, splits)]  # checks the splits before any run
    trace = study_trace(args)
    return DisaggStudy(splits, names, trace, sim_config(args))


def run(args: argparse.Namespace, study: DisaggStudy | None = None,
        on_row: Callable[[dict], None] | None = None) -> DisaggTables:
    """The disaggregation table; `on_row(row)` as each run finishes."""
    study = study or prepare(args)
    table = disagg_study(study.trace, study.base, args.gpus, args.rates, study.splits, args.jobs, on_result=on_row,
                         **executor_options(args))
    return DisaggTables(study, table)


def command(args: argparse.Namespace) -> int:
    study = prepare(args)
    print_header(args, study)
    write_report(args, run(args, study, on_row=print_row))
    return 0


def print_header(args: argparse.Namespace, study: DisaggStudy) -> None:
    print(f"disagg: {len(study.trace)} requests of {study.trace.name}, {args.gpus} GPUs of {study_title(args)}: "
          f"{', '.join(study.names)}")
    print(COLUMNS.header())


COLUMNS = Columns(("setup", "setup", "<10"), ("rate", "rate", ">6g"), ("p90 TTFT", "ttft_p90", ">9.3f"),
                  ("p90 TPOT", "tpot_p90", ">9.4f"), ("norm lat", "mean_normalized_latency", ">9.4f"),
                  ("req/s", "throughput", ">7.3f"), ("wall s", "wall_s", ">7.2f"))


def print_row(r: dict) -> None:
    print(COLUMNS.row(r), flush=True)


def write_report(args: argparse.Namespace, result: DisaggTables) -> None:
    """disagg.csv, disagg.png, and the closing line."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.table.to_csv(out / "disagg.csv", index=False)
    disagg_plot(result.table, out / "disagg.png", f"{result.study.trace.name}, {args.gpus} GPUs of {study_title(args)}")
    print(f"wrote {out}/disagg.csv, disagg.png")
