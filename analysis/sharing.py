"""Memory saved by block sharing (the vLLM paper's Figure 15 measure): with parallel sampling or
beam search, the sequences of a request share their prompt blocks (and beams share prefixes of
their outputs) instead of each holding a copy.

    saving = (blocks the running sequences would hold without sharing - blocks they hold)
             / blocks they would hold without sharing

integrated over time (each iteration weighted by its duration). Blocks "without sharing" are the
entries of every block table (each sequence's own copy); blocks held are the physical blocks in use.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.cli_args import add_study_args, sim_config, study_title, study_trace
from analysis.parallel import executor_options, run_tasks
from analysis.report import Columns
from pagesim.argtypes import out_dir, positive_float, positive_int
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


# ---- the command: `pagesim sharing` ----

def add_parser(sub: argparse._SubParsersAction) -> None:
    sh = sub.add_parser("sharing", help="memory saved by block sharing under parallel sampling and beam search",
                        description="The vLLM paper's Figure 15 measure: blocks saved by sharing / blocks "
                                    "without sharing, time-averaged, for each width and rate (policy vllm).")
    add_study_args(sh, "alpaca-like", [10.0])
    sh.add_argument("--n", type=positive_int, nargs="*", default=[2, 4, 6], help="parallel sampling widths (default 2 4 6)")
    sh.add_argument("--beam-width", type=positive_int, nargs="*", default=[2, 4, 6], help="beam widths (default 2 4 6)")
    sh.add_argument("--beam-decay", type=positive_float, nargs="+", default=[0.5],
                    help="q of the simulated beam rule (parents picked ~ q^rank; measure it with `pagesim beams`): "
                         "one value, or one per --beam-width (default 0.5)")
    sh.add_argument("--beam-picks", help="a measured pick table (`pagesim beams --out`) for the widths it covers, "
                                         "instead of the q^rank rule")
    sh.add_argument("--out", type=out_dir, help="write sharing.csv here")
    sh.set_defaults(func=command)


@dataclass
class SharingStudy:
    """A sharing study as its arguments define it: the widths ("n" or "beam", k), the beam rule's q
    per beam width, the trace and the configuration every run starts from."""

    widths: list[tuple[str, int]]
    decay: dict[int, float]
    trace: Trace
    base: SimConfig


@dataclass
class SharingTables:
    study: SharingStudy
    table: pd.DataFrame  # one row per (decoding, width, rate)


def prepare(args: argparse.Namespace) -> SharingStudy:
    widths = [("n", k) for k in args.n] + [("beam", k) for k in args.beam_width]
    if not widths or any(k < 2 for _, k in widths):
        raise ValueError("--n and --beam-width take widths >= 2 (at least one in all)")
    if len(args.beam_decay) not in (1, len(args.beam_width)):
        raise ValueError(f"--beam-decay: give one value or one per --beam-width ({len(args.beam_width)}), "
                         f"got {len(args.beam_decay)}")
    decay = dict(zip(args.beam_width, args.beam_decay * len(args.beam_width)))
    trace = study_trace(args)
    # --n and --beam-width are lists of widths here, not the config's per-request override
    base = sim_config(args, n=None, beam_width=None, beam_rank_decay=args.beam_decay[0])
    return SharingStudy(widths, decay, trace, base)


def run(args: argparse.Namespace, study: SharingStudy | None = None,
        on_row: Callable[[dict], None] | None = None) -> SharingTables:
    """The sharing table; `on_row(row)` as each run finishes."""
    study = study or prepare(args)
    table = sharing_table(study.trace, study.base, args.rates, study.widths, on_row=on_row, beam_decay=study.decay,
                          jobs=args.jobs, **executor_options(args))
    return SharingTables(study, table)


def command(args: argparse.Namespace) -> int:
    study = prepare(args)
    print_header(args, study)
    write_report(args, run(args, study, on_row=print_row))
    return 0


def print_header(args: argparse.Namespace, study: SharingStudy) -> None:
    print(f"sharing: {len(study.trace)} requests of {study.trace.name}, {study_title(args)}, block size "
          f"{args.block_size}")
    print(COLUMNS.header())


COLUMNS = Columns(("decoding", "decoding", "<18"), ("width", "width", ">5"), ("rate", "rate", ">6.2f"),
                  ("saving", "saving", ">7.1%"), ("req/s", "throughput", ">7.3f"),
                  ("norm lat", "mean_normalized_latency", ">9.4f"), ("preempt", "preemptions", ">8"))


def print_row(r: dict) -> None:
    print(COLUMNS.row(r), flush=True)


def write_report(args: argparse.Namespace, result: SharingTables) -> None:
    """sharing.csv, when --out is given."""
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result.table.to_csv(out / "sharing.csv", index=False)
        print(f"wrote {out}/sharing.csv")
