"""Memory saved by block sharing (the vLLM paper's Figure 15 measure): with parallel sampling or
beam search, the sequences of a request share their prompt blocks (and beams share prefixes of
their outputs) instead of each holding a copy.

    saving = (blocks the running sequences would hold without sharing - blocks they hold)
             / blocks they would hold without sharing

integrated over time (each iteration weighted by its duration). Blocks "without sharing" are the
entries of every block table (each sequence's own copy); blocks held are the physical blocks in use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd

from analysis.parallel import run_tasks
from analysis.rate_study import RateStudy
from analysis.report import Report
from policies.metrics import headline_mean_normalized_latency
from policies.scheduler import Scheduler
from sim.run import SimConfig, run_simulation
from traces import apply_arrivals
from traces.trace import Trace


@dataclass
class SharingMeter:
    """An observer for run_simulation: accumulates logical (per-sequence) and physical block-seconds."""

    logical: float = 0.0
    physical: float = 0.0

    def __call__(self, start: float, duration: float, sched: Scheduler) -> None:
        if not hasattr(sched, "block_usage"):
            raise TypeError("sharing is measured on the paged block manager (policy 'vllm')")
        logical, physical = sched.block_usage()
        self.logical += duration * logical
        self.physical += duration * physical

    @property
    def saving(self) -> float:
        return 1.0 - self.physical / self.logical if self.logical else 0.0


def sharing_saving(trace: Trace, cfg: SimConfig, beam_picks: dict | None = None) -> tuple[float, dict]:
    """(memory saving by sharing, the run's summary) for one configuration (policy vllm, no prefix
    caching: only sharing within a request is counted). `beam_picks`: pick tables by width
    (sim.executor.BeamPicks) to use instead of cfg.beam_picks."""
    if cfg.policy != "vllm" or cfg.prefix_caching:
        raise ValueError("sharing saving is measured for policy 'vllm' without prefix caching")
    meter = SharingMeter()
    res = run_simulation(cfg, trace, observer=meter, beam_picks=beam_picks)
    return meter.saving, res.summary


def sharing_table(trace: Trace, base: SimConfig, rates: Sequence[float], widths: Sequence[tuple[str, int]],
                  on_row=None, beam_decay: dict[int, float] | None = None, jobs: int = 1,
                  executor: str = "process", address: str | None = None) -> pd.DataFrame:
    """One row per (decoding, width, rate): the saving and the run's headline numbers. `widths` are
    ("n", k) for parallel sampling or ("beam", k) for beam search; `beam_decay` gives the beam
    rule's q per beam width (else base.beam_rank_decay). `jobs` worker processes run the
    simulations, or `executor` "ray" on the Ray cluster at `address` (the same table either way)."""
    tasks = []
    for rate in rates:
        timed = apply_arrivals(trace, rate=rate, seed=base.seed)
        for kind, k in widths:
            q = (beam_decay or {}).get(k, base.beam_rank_decay) if kind == "beam" else base.beam_rank_decay
            cfg = dataclasses.replace(base, policy="vllm", n=k if kind == "n" else 1,
                                      beam_width=k if kind == "beam" else 1, beam_rank_decay=q)
            tasks.append((timed, cfg, "parallel sampling" if kind == "n" else "beam search", k, rate))
    rows = run_tasks(_sharing_run, tasks, jobs, None if on_row is None else (lambda i, r: on_row(r)), executor, address)
    return pd.DataFrame(rows)


def _sharing_run(timed: Trace, cfg: SimConfig, decoding: str, width: int, rate: float) -> dict:
    saving, s = sharing_saving(timed, cfg)
    return {"decoding": decoding, "width": width, "rate": rate, "saving": saving,
            "throughput": s["request_throughput"], "mean_normalized_latency": headline_mean_normalized_latency(s),
            "preemptions": s["num_preemptions"], "mean_batched_seqs": s["mean_batched_seqs"]}


# ---- the study `pagesim sharing` runs ----

@dataclass(kw_only=True)
class SharingStudy(RateStudy):
    """A sharing study's configuration: the widths ("n" or "beam", k) and the beam rule's q per
    beam width."""

    widths: list[tuple[str, int]]
    decay: dict[int, float]


@dataclass
class SharingTables:
    study: SharingStudy
    table: pd.DataFrame  # one row per (decoding, width, rate)


def run_sharing(study: SharingStudy, on_row: Callable[[dict], None] | None = None) -> SharingTables:
    """The sharing table; `on_row(row)` as each run finishes."""
    table = sharing_table(study.trace, study.base, study.rates, study.widths, on_row=on_row, beam_decay=study.decay,
                          **study.workers.options())
    return SharingTables(study, table)


def sharing_report(result: SharingTables) -> Report:
    """sharing.csv."""
    report = Report()
    report.table("sharing.csv", result.table)
    report.wrote("sharing.csv")
    return report
