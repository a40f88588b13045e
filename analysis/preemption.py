"""Recompute or swap? The vLLM paper's Figure 19, from the roofline model and the simulator.

Microbenchmark (its 19a): the time to swap a sequence's KV out and back in over PCIe against the
time to recompute it (a prefill of the same tokens), per block size. Swapping moves the same bytes
at any block size, but vLLM copies each block with one call per layer for keys and one for values,
so small blocks pay many call latencies; recomputing does not depend on the block size.

End to end (its 19b): the same trace simulated with preemption by swapping and by recomputation at
each block size, mean normalized latency (s/token) for each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from analysis.plots import house_legend, legend_below, save_figure, style_axes
from analysis.report import Report
from policies.metrics import headline_mean_normalized_latency
from policies.plan import StepComposition
from sim.cost_model import RooflineCostModel
from sim.run import SimConfig, run_simulation
from sim.specs import get_hardware, get_model
from traces.trace import Trace

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COLORS = {"swap": "#dd8452", "recompute": "#4c72b0"}


def microbenchmark(model: RooflineCostModel, block_sizes: Sequence[int] = BLOCK_SIZES,
                   tokens: int = 1024) -> pd.DataFrame:
    """Per block size: milliseconds to swap `tokens` tokens out, in, and both; to recompute them
    (the prefill work alone: linears, attention and LM head, not the fixed per-iteration overhead,
    which the iteration pays either way); and which is cheaper."""
    if tokens < 1:
        raise ValueError(f"tokens: must be >= 1, got {tokens}")
    work = model.breakdown(StepComposition(num_prefill_seqs=1, prefill_tokens=tokens,
                                           prefill_attn_pairs=tokens * (tokens + 1) // 2))
    recompute = sum(v for k, v in work.items() if k != "overhead") * 1e3
    rows = []
    for bs in block_sizes:
        if bs < 1:
            raise ValueError(f"block sizes must be >= 1, got {bs}")
        one_way = model.swap_time(-(-tokens // bs), bs) * 1e3
        rows.append({"block_size": bs, "swap_out_ms": one_way, "swap_in_ms": one_way, "swap_ms": 2 * one_way,
                     "recompute_ms": recompute, "cheaper": "swap" if 2 * one_way < recompute else "recompute"})
    return pd.DataFrame(rows)


def end_to_end(trace: Trace, base: SimConfig, block_sizes: Sequence[int] = BLOCK_SIZES,
               on_row: Callable[[dict], None] | None = None) -> pd.DataFrame:
    """Simulate `trace` under vllm with preemption by swap and by recompute at each block size."""
    rows = []
    for bs in block_sizes:
        for mode in ("recompute", "swap"):
            cfg = dataclasses.replace(base, policy="vllm", block_size=bs, preemption=mode)
            s = run_simulation(cfg, trace).summary
            row = {"block_size": bs, "preemption": mode, "mean_normalized_latency": headline_mean_normalized_latency(s),
                   "preemptions": s["num_preemptions"], "throughput": s["request_throughput"],
                   "finished": s["num_finished"], "rejected": s["num_rejected"]}
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return pd.DataFrame(rows)


def crossover(micro: pd.DataFrame) -> int | None:
    """The smallest block size from which swapping is cheaper than recomputing at every larger one."""
    cheaper = micro.sort_values("block_size")
    best = None
    for bs, c in zip(cheaper.block_size[::-1], cheaper.cheaper[::-1]):
        if c != "swap":
            break
        best = int(bs)
    return best


def preemption_figure(micro: pd.DataFrame, e2e: pd.DataFrame | None, title: str = "") -> Figure:
    """Left: swap and recompute time against block size; right (when simulated): mean normalized
    latency with each preemption mode against block size. House style: log axes, one colour per
    mode in both panels, the legend under the panels."""
    import matplotlib.pyplot as plt

    panels = 2 if e2e is not None and len(e2e) else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.6), squeeze=False)
    ax = axes[0][0]
    ax.plot(micro.block_size, micro.swap_ms, marker="o", color=COLORS["swap"], label="swap (out + in)")
    ax.plot(micro.block_size, micro.recompute_ms, marker="s", color=COLORS["recompute"], label="recompute")
    sizes = sorted(micro.block_size)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    style_axes(ax, "block size (tokens)", "time (ms)", micro[["swap_ms", "recompute_ms"]].to_numpy(float))
    ax.set_title("microbenchmark", fontsize=10)
    if panels == 2:
        ax = axes[0][1]
        for mode, g in e2e.groupby("preemption", sort=False):
            ax.plot(g.block_size, g.mean_normalized_latency, marker="o", color=COLORS[mode],
                    label="swap (out + in)" if mode == "swap" else mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        style_axes(ax, "block size (tokens)", "mean normalized latency (s/token)",
                   e2e.mean_normalized_latency.to_numpy(float))
        ax.set_title("end to end (simulated)", fontsize=10)
    legend_below(fig, *house_legend(fig), title)
    return fig


def preemption_plot(micro: pd.DataFrame, e2e: pd.DataFrame | None, path: str | Path, title: str = "") -> Path:
    """`preemption_figure` written to `path`."""
    return save_figure(preemption_figure(micro, e2e, title), path, layout=False)


# ---- the study `pagesim preemption` runs ----

@dataclass
class PreemptionStudy:
    """A preemption study's configuration: the model and hardware the roofline prices, the block
    sizes, and the tokens swapped or recomputed in the microbenchmark."""

    model: str
    hardware: str
    block_sizes: list[int]
    tokens: int = 1024

    @property
    def title(self) -> str:
        return f"{self.model} on {self.hardware}"


def run_microbenchmark(study: PreemptionStudy) -> pd.DataFrame:
    """Swap vs recompute time per block size, from the roofline model."""
    return microbenchmark(RooflineCostModel(get_model(study.model), get_hardware(study.hardware)), study.block_sizes,
                          study.tokens)


def micro_report(study: PreemptionStudy, micro: pd.DataFrame) -> Report:
    """preemption_micro.csv (written before the simulations start) and its printed table."""
    report = Report()
    report.table("preemption_micro.csv", micro)
    report.say(f"swap out + in vs recompute of {study.tokens} tokens, {study.title} (roofline)",
               f"{'block size':>10} {'swap ms':>9} {'recompute ms':>13} {'cheaper':>10}")
    report.say(*(f"{r.block_size:>10} {r.swap_ms:>9.2f} {r.recompute_ms:>13.2f} {r.cheaper:>10}"
                 for r in micro.itertuples()))
    cross = crossover(micro)
    report.say(f"swapping is cheaper from block size {cross}" if cross else "recomputing is cheaper at every block size")
    return report


def preemption_report(study: PreemptionStudy, micro: pd.DataFrame, e2e: pd.DataFrame | None) -> Report:
    """preemption_e2e.csv (when the trace was simulated), preemption.png, and the closing line."""
    report = Report()
    if e2e is not None:
        report.table("preemption_e2e.csv", e2e)
    report.figure("preemption.png", lambda path: preemption_plot(micro, e2e, path, study.title))
    report.wrote("preemption_micro.csv", *(["preemption_e2e.csv"] if e2e is not None else []), "preemption.png")
    return report
