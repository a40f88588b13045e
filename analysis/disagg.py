"""Colocated or disaggregated? One trace on the same number of GPUs, served colocated (every
replica prefills and decodes) and split into prefill and decode replicas (sim/disagg.py), at
several rates: TTFT, TPOT and normalized latency for each, the DistServe comparison."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from analysis.parallel import run_tasks
from analysis.plots import Panel, serving_figure, serving_panels
from analysis.rate_study import RateStudy
from analysis.report import Report, table_value
from analysis.sweep import headline
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
    timed = {rate: apply_arrivals(trace, rate=rate, seed=base.seed) for rate in rates}
    tasks = []  # the table's order (and the printed rows'): setup, then rate
    for name, split in setups(gpus, splits):
        cfg = dataclasses.replace(base, replicas=1 if split else gpus, disaggregate=split)
        tasks += [(cfg, timed[rate], name, rate) for rate in rates]
    return pd.DataFrame(run_tasks(_run, tasks, jobs, None if on_result is None else (lambda i, r: on_result(r)),
                                  executor, address))


def _run(cfg: SimConfig, timed: Trace, setup: str, rate: float) -> dict:
    s = run_simulation(cfg, timed).summary
    return {"setup": setup, "rate": rate, **headline(s), "tpot_mean": headline_latency(s, "tpot")["mean"],
            "slo_attainment": table_value(s["slo_attainment"])}


NORMALIZED_PANEL = Panel("mean_normalized_latency", "mean normalized latency (s/token)")


def setup_label(setup: str) -> str:
    return setup if setup == "colocated" else f"{setup} (prefill+decode)"


def disagg_figure(table: pd.DataFrame, title: str = "") -> Figure:
    """The serving panels (analysis.plots.serving_figure: throughput, TTFT and TPOT p50/p90, E2E
    p90) one line per setup, and mean normalized latency."""
    return serving_figure(table, title, by="setup", label=setup_label, extra=[NORMALIZED_PANEL])


def disagg_plot(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """`disagg_figure` written to `path`."""
    return serving_panels(table, path, title, by="setup", label=setup_label, extra=[NORMALIZED_PANEL])


# ---- the study `pagesim disagg` runs ----

@dataclass(kw_only=True)
class DisaggStudy(RateStudy):
    """A disaggregation study's configuration: the GPUs of every setup and the splits (None: every
    split). `names` are the setups' names (checking the splits)."""

    gpus: int
    splits: list[tuple[int, int]] | None

    @property
    def names(self) -> list[str]:
        return [n for n, _ in setups(self.gpus, self.splits)]


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


def run_disagg(study: DisaggStudy, on_row: Callable[[dict], None] | None = None) -> DisaggTables:
    """The disaggregation table; `on_row(row)` as each run finishes."""
    table = disagg_study(study.trace, study.base, study.gpus, study.rates, study.splits, on_result=on_row,
                         **study.workers.options())
    return DisaggTables(study, table)


def disagg_report(result: DisaggTables) -> Report:
    """disagg.csv, disagg.png, and the closing line."""
    study = result.study
    report = Report()
    report.table("disagg.csv", result.table)
    report.figure("disagg.png", lambda path: disagg_plot(
        result.table, path, f"{study.trace.name}, {study.gpus} GPUs of {study.title}"))
    report.wrote("disagg.csv", "disagg.png")
    return report
