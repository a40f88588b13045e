"""Which block size? The vLLM paper's Figure 18b: one trace simulated at each block size, the KV
cache's capacity in tokens held fixed.

Two costs pull apart. Small blocks: each decode step reads more blocks, which a profile measured at
several block sizes prices (its decode_blocks term, `pagesim profile --block-sizes`); the roofline
model has no such term, so there small blocks cost nothing extra. Large blocks: a sequence's last
block is partly empty (internal fragmentation), so fewer sequences fit, batches shrink and
preemptions grow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from analysis.parallel import run_tasks
from analysis.plots import CATEGORY_COLORS, legend_below, save_figure, series_colors, style_axes
from analysis.rate_study import RateStudy
from analysis.report import Report
from policies.metrics import headline_latency, headline_mean_normalized_latency
from sim.run import SimConfig, build_cost_model, num_blocks_for, run_simulation
from traces import apply_arrivals
from traces.trace import Trace

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REFERENCE_DECODE = (16, 512)  # a decode step of 16 sequences of 512 tokens: the cost model's price per block size


def block_size_sweep(trace: Trace, base: SimConfig, block_sizes: Sequence[int] = BLOCK_SIZES,
                     rates: Sequence[float] = (1.0,), kv_tokens: int | None = None,
                     on_row: Callable[[dict], None] | None = None, jobs: int = 1, executor: str = "process",
                     address: str | None = None) -> pd.DataFrame:
    """Simulate `trace` (vllm) at each block size and rate. The cache holds `kv_tokens` tokens at
    every block size (kv_tokens // block_size blocks); without it, what base's model and hardware
    leave for the cache (the same token count at every block size, up to rounding). `jobs` worker
    processes run the simulations, or `executor` "ray" on the Ray cluster at `address` (the same
    table either way)."""
    if kv_tokens is not None and kv_tokens < max(block_sizes):
        raise ValueError(f"kv_tokens: {kv_tokens} holds not one block of {max(block_sizes)} tokens")
    if min(block_sizes) < 1:
        raise ValueError(f"block sizes must be >= 1, got {min(block_sizes)}")
    tasks = []
    for rate in rates:
        timed = apply_arrivals(trace, rate=rate, seed=base.seed)
        tasks += [(dataclasses.replace(base, policy="vllm", block_size=bs,
                                       num_gpu_blocks=kv_tokens // bs if kv_tokens else None), timed, rate)
                  for bs in block_sizes]
    rows = run_tasks(_block_size_run, tasks, jobs, None if on_row is None else (lambda i, r: on_row(r)),
                     executor, address)
    return pd.DataFrame(rows)


def _block_size_run(cfg: SimConfig, timed: Trace, rate: float) -> dict:
    cost = build_cost_model(cfg)
    res = run_simulation(cfg, timed, cost_model=cost)
    s, it = res.summary, res.iteration_columns(["duration", "kv_token_states", "kv_internal_frag"])
    busy = it.duration.sum()
    allocated = it[["kv_token_states", "kv_internal_frag"]].sum(axis=1).clip(lower=1)
    seqs, ctx = REFERENCE_DECODE
    return {"rate": rate, "block_size": cfg.block_size, "num_gpu_blocks": num_blocks_for(cfg)[0],
            "mean_normalized_latency": headline_mean_normalized_latency(s), "ttft_mean": headline_latency(s, "ttft")["mean"],
            "throughput": s["request_throughput"], "preemptions": s["num_preemptions"],
            "rejected": s["num_rejected"], "mean_batched_seqs": s["mean_batched_seqs"],
            # time-averaged share of allocated slots left empty in partly filled blocks
            "internal_frag": float((it.kv_internal_frag / allocated * it.duration).sum() / busy) if busy else 0.0,
            "reference_decode_ms": cost.decode_step_time(seqs, seqs * ctx) * 1e3}


def best_block_sizes(table: pd.DataFrame, tolerance: float = 0.01) -> dict[float, list[int]]:
    """Per rate, the block sizes whose mean normalized latency is within `tolerance` (relative) of
    the lowest: differences smaller than that are not worth naming a winner for."""
    out = {}
    table = table.sort_values(["rate", "block_size"], kind="stable")  # block sizes given out of order: one line
    for rate, g in table.groupby("rate", sort=False):
        best = g.mean_normalized_latency.min()
        out[float(rate)] = [int(b) for b in g.block_size[g.mean_normalized_latency <= best * (1 + tolerance)]]
    return out


def block_size_figure(table: pd.DataFrame, title: str = "") -> Figure:
    """Left: mean normalized latency against block size, one line per rate, relative to that rate's
    best block size (log scale: no curve leaves the panel); right: what moves it, internal
    fragmentation and the cost model's price of a reference decode step. House style: the legend
    under the panels."""
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    colors = series_colors(table.rate)
    relative = []
    table = table.sort_values(["rate", "block_size"], kind="stable")  # block sizes given out of order: one line
    for rate, g in table.groupby("rate", sort=False):
        best = g.mean_normalized_latency.min()
        relative.append(g.mean_normalized_latency / best)
        ax.plot(g.block_size, relative[-1], marker="o", color=colors[rate],
                label=f"{rate:g} req/s (best {best:.3g} s/token)")
    style_axes(ax, "block size (tokens)", "mean normalized latency / the best block size's",
               pd.concat(relative).to_numpy() if relative else None)
    first = table[table.rate == table.rate.iloc[0]]
    frag_color, step_color = CATEGORY_COLORS["kv_internal_frag"], CATEGORY_COLORS["kv_token_states"]
    ax2.plot(first.block_size, 100 * first.internal_frag, marker="o", color=frag_color)
    sizes = sorted(table.block_size.unique())
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(sizes, [str(b) for b in sizes])
    style_axes(ax2, "block size (tokens)", "allocated KV slots empty (%)")
    ax2.yaxis.label.set_color(frag_color)
    ax3 = ax2.twinx()
    ax3.plot(first.block_size, first.reference_decode_ms, marker="s", color=step_color)
    ax3.set_ylabel(f"decode step, {REFERENCE_DECODE[0]} seqs x {REFERENCE_DECODE[1]} tokens (ms)", color=step_color)
    ax2.set_title(f"at {first.rate.iloc[0]:g} req/s", fontsize=10)
    legend_below(fig, *ax.get_legend_handles_labels(), title, max_cols=3)
    return fig


def block_size_plot(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """`block_size_figure` written to `path`."""
    return save_figure(block_size_figure(table, title), path, layout=False)


# ---- the study `pagesim block-size` runs ----

@dataclass(kw_only=True)
class BlockSizeStudy(RateStudy):
    """A block-size study's configuration (each run sets its own block size and the cache's
    blocks): the block sizes, and the KV capacity in tokens (None: what the hardware leaves)."""

    block_sizes: list[int]
    kv_tokens: int | None = None


@dataclass
class BlockSizeTables:
    study: BlockSizeStudy
    table: pd.DataFrame  # one row per (rate, block size)


def run_block_sizes(study: BlockSizeStudy, on_row: Callable[[dict], None] | None = None) -> BlockSizeTables:
    """The block-size table; `on_row(row)` as each run finishes."""
    table = block_size_sweep(study.trace, study.base, study.block_sizes, study.rates, study.kv_tokens, on_row=on_row,
                             **study.workers.options())
    return BlockSizeTables(study, table)


def block_size_report(result: BlockSizeTables) -> Report:
    """block_size.csv, block_size.png, and the best block sizes per rate."""
    table, study = result.table, result.study
    report = Report()
    report.table("block_size.csv", table)
    report.figure("block_size.png", lambda path: block_size_plot(table, path, f"{study.trace.name}, {study.title}"))
    report.say("ref ms: the cost model's decode step of 16 sequences of 512 tokens at that block size",
               "within 1% of the lowest mean normalized latency: "
               + "; ".join(f"{r:g} req/s: block size {', '.join(map(str, bs))}"
                           for r, bs in best_block_sizes(table).items()))
    report.wrote("block_size.csv", "block_size.png")
    return report
