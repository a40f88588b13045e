"""Figures for sweeps and runs (matplotlib, written to PNG), in one house style: panels against the
offered request rate, one colour per policy, router or configuration (the same colour for a name in
every figure), no clipping limits (a panel spanning a decade or more on a log axis), the legend
under the panels (over no data), titles that name files rather than paths, and with seeds the mean
and its 95% t interval as bands, said in the title (analysis.seeds.seeds_note)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import LogFormatter, MaxNLocator

from analysis.seeds import rate_line
from policies.registry import ALIASES, POLICIES
from policies.router import ROUTERS
from sim.profiled import FEATURES, composition_of, features

RATE_LABEL = "offered request rate (req/s)"
PALETTE = tuple(f"C{i}" for i in range(10))
# colours for names past the palette (plug-ins, many setups): tab20's light shades
EXTRA = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d",
         "#9edae5")
# a built-in policy or router keeps its registry place's colour in every figure (policies and routers
# never share a figure, so their places may share colours)
KNOWN = {**{n: i for i, n in enumerate(POLICIES)}, **{n: i for i, n in enumerate(ROUTERS)},
         **{a: list(POLICIES).index(p) for a, p in ALIASES.items()}}


def series_colors(keys: Iterable[Any]) -> dict[Any, str]:
    """One colour per key. Invariant: a built-in policy or router name gets the same colour in every
    figure (its place in the registry); other keys (plug-ins, setups, rates) take the colours this
    figure leaves free, in order of appearance."""
    keys = list(dict.fromkeys(keys))
    colors = {k: PALETTE[KNOWN[k] % len(PALETTE)] for k in keys if isinstance(k, str) and k in KNOWN}
    free = [c for c in PALETTE + EXTRA if c not in colors.values()]
    for k in keys:
        if k not in colors:
            colors[k] = free.pop(0) if free else "0.4"
    return colors


def save_figure(fig: plt.Figure, path: str | Path, dpi: int = 120, layout: bool = True) -> Path:
    """Lay `fig` out (unless `layout` is False: `legend_below` laid it out around its legend), write
    it to `path` (PNG) and close it (an open figure keeps its memory)."""
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path)


def legend_below(fig: plt.Figure, handles: Sequence[Any], labels: Sequence[str], title: str = "",
                 max_cols: int | None = None) -> None:
    """The house legend: one legend for the whole figure, centred under the panels so that it covers
    no data (`max_cols` entries a row, default what the figure's width holds), and the figure's
    title; lays the figure out around both."""
    cols = max(1, min(len(labels), max_cols or max(2, int(fig.get_size_inches()[0] / 2))))
    rows = math.ceil(len(labels) / cols) if labels else 0
    if labels:
        fig.legend(handles, labels, loc="lower center", ncol=cols, frameon=False, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    height = fig.get_size_inches()[1]
    fig.tight_layout(rect=(0, min(0.45, (0.3 * rows + 0.05) / height) if rows else 0, 1, 1))


class PlainLogFormatter(LogFormatter):
    """Log-axis tick labels as plain numbers (0.03, 400) rather than powers of ten (3x10^-2),
    labelling the ticks matplotlib's log formatter would."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""


def plain_log_ticks(axis: Any) -> None:
    """Plain-number labels on a log `axis` (ax.xaxis or ax.yaxis): decades, and the minor ticks
    when the axis spans little more than one decade."""
    axis.set_major_formatter(PlainLogFormatter(labelOnlyBase=False))
    axis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))


LOG_SPAN = 10  # a panel whose values span this factor or more is drawn on a log axis


def style_axes(ax: Any, xlabel: str, ylabel: str, values: np.ndarray | None = None) -> None:
    """Axis labels and grid; a log y axis when `values` (what the panel draws) are all > 0 and span
    LOG_SPAN or more, so that curves spanning decades stay readable; never clipping limits."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if values is not None:
        finite = np.asarray(values, dtype=float)
        finite = finite[np.isfinite(finite)]
        if len(finite) and (finite > 0).all() and finite.max() >= LOG_SPAN * finite.min():
            ax.set_yscale("log")
            plain_log_ticks(ax.yaxis)
    ax.grid(alpha=0.3, which="both" if ax.get_yscale() == "log" else "major")


def _values(table: pd.DataFrame, cols: Iterable[str | None]) -> np.ndarray:
    present = [c for c in cols if c and c in table]
    return table[present].apply(pd.to_numeric, errors="coerce").to_numpy(float) if present else np.array([])


@dataclass(frozen=True)
class Panel:
    """One panel against rate: the column (its p50 or mean, solid), an optional second column drawn
    dotted in the same colour (its p90), the y label, whether it may be log scale (when all its
    values are > 0), fixed y limits (for a share: (0, 1); values outside them are marked at the
    edge), and whether its ticks are whole numbers."""

    col: str
    ylabel: str
    second: str | None = None
    log: bool = True
    ylim: tuple[float, float] | None = None
    integer: bool = False


CATEGORY_COLORS = {"kv_token_states": "#4c72b0", "kv_reserved": "#dd8452", "kv_internal_frag": "#c44e52",
                   "kv_external_frag": "#8172b3"}
CATEGORY_LABELS = {"kv_token_states": "token states", "kv_reserved": "reserved",
                   "kv_internal_frag": "internal fragmentation", "kv_external_frag": "external fragmentation"}

SATURATED = 0.9  # achieved throughput under this share of the offered rate: the server no longer keeps up


def saturation_rate(g: pd.DataFrame) -> float:
    """The lowest offered rate at which one configuration's achieved throughput (mean over seeds)
    falls under SATURATED of it; NaN when it keeps up at every rate swept."""
    by_rate = g.groupby("rate", sort=True).throughput.mean()
    behind = by_rate[by_rate < SATURATED * by_rate.index.to_numpy()]
    return float(behind.index[0]) if len(behind) else float("nan")


def rate_figure(table: pd.DataFrame, by: str, panels: Sequence[Panel], title: str = "",
                label: Callable[[Any], str] = str, cols: int | None = None, saturation: bool = False,
                legend: bool = True) -> plt.Figure:
    """The house figure: one panel per `Panel` against the offered rate (`cols` panels a row, default
    all of up to four, else three), one
    line per value of `by` in its `series_colors` colour, with seeds the mean and 95% interval bands.
    `saturation`: the table has a throughput column; each line's saturation point (`saturation_rate`)
    is a vertical line in its colour, and a panel of achieved throughput gets the offered rate
    dashed. `legend`: place the legend now (False: the caller adds to the figure, then calls
    `legend_below(fig, *house_legend(fig))`)."""
    cols = cols or (len(panels) if len(panels) <= 4 else 3)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.6 * rows + 0.6), squeeze=False)
    colors = series_colors(table[by])
    rates = np.sort(table.rate.unique())
    for ax, panel in zip(axes.flat, panels):
        if saturation and panel.col == "throughput":
            ax.plot(rates, rates, color="0.6", linestyle="--", linewidth=1, label="offered rate")
        for key, g in table.groupby(by, sort=False):
            rate_line(ax, g, panel.col, label(key), color=colors[key])
            if panel.second is not None and panel.second in g:
                rate_line(ax, g, panel.second, "_", color=colors[key], linestyle=":")
            knee = saturation_rate(g) if saturation else math.nan
            if knee == knee:
                ax.axvline(knee, color=colors[key], linewidth=1, alpha=0.6)
        style_axes(ax, RATE_LABEL, panel.ylabel, _values(table, (panel.col, panel.second)) if panel.log else None)
        if panel.ylim is not None:
            _limit(ax, table, panel, colors, by)
        if panel.integer:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    if legend:
        legend_below(fig, *house_legend(fig, p90=any(p.second for p in panels), saturation=saturation), title)
    elif title:
        fig.suptitle(title, fontsize=10)
    return fig


def _limit(ax: Any, table: pd.DataFrame, panel: Panel, colors: dict, by: str) -> None:
    """Fix a panel's y limits; a value outside them is drawn as a triangle on the edge it passes."""
    lo, hi = panel.ylim
    ax.set_ylim(lo, hi)
    for key, g in table.groupby(by, sort=False):
        y = pd.to_numeric(g[panel.col], errors="coerce")
        for edge, outside, marker in ((hi, y > hi, "^"), (lo, y < lo, "v")):
            if outside.any():
                ax.plot(g.rate[outside], [edge] * int(outside.sum()), marker, color=colors[key], clip_on=False)


def house_legend(fig: plt.Figure, p90: bool = False, saturation: bool = False,
                 extra: Sequence[tuple[Any, str]] = ()) -> tuple[list, list[str]]:
    """The legend's entries: every labelled line of the figure once (the series), then the keys to
    line styles the figure uses (offered rate, p50/p90, saturation) and `extra` (handle, label) pairs."""
    handles, labels = [], []
    for ax in fig.axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if "offered rate" in labels:  # a key to a line style: after the series, with the other keys
        i = labels.index("offered rate")
        handles.append(handles.pop(i))
        labels.append(labels.pop(i))
    if p90:
        handles += [plt.Line2D([], [], color="0.3"), plt.Line2D([], [], color="0.3", linestyle=":")]
        labels += ["p50", "p90"]
    if saturation:
        handles.append(plt.Line2D([], [], color="0.3", linewidth=1, alpha=0.6))
        labels.append(f"saturation (throughput < {SATURATED:.0%} of offered)")
    for h, lab in extra:
        handles.append(h)
        labels.append(lab)
    return handles, labels


SERVING_PANELS = (Panel("throughput", "achieved throughput (req/s)", log=False),
                  Panel("ttft_p50", "TTFT (s)", "ttft_p90"),
                  Panel("tpot_p50", "time per output token (s)", "tpot_p90"),
                  Panel("e2e_p90", "E2E latency p90 (s)"))


def serving_figure(table: pd.DataFrame, title: str = "", by: str = "policy", label: Callable[[Any], str] = str,
                   extra: Sequence[Panel] = ()) -> plt.Figure:
    """What `vllm bench serve` and guidellm report, against the offered rate, one colour per `by`:
    achieved throughput (the offered rate dashed), TTFT and time per output token (p50 solid, p90
    dotted) and E2E p90, log scale where a panel spans a decade (no limit clips a curve); each
    configuration's saturation point (`saturation_rate`) marked by a vertical line in its colour;
    then the study's own `extra` panels. With a seed column, means over seeds and their 95%
    interval as bands. The legend sits under the panels, over no data."""
    return rate_figure(table, by, [*SERVING_PANELS, *extra], title, label, saturation=True)


def serving_panels(table: pd.DataFrame, path: str | Path, title: str = "", by: str = "policy",
                   label: Callable[[Any], str] = str, extra: Sequence[Panel] = ()) -> Path:
    """`serving_figure` written to `path`."""
    return save_figure(serving_figure(table, title, by, label, extra), path, layout=False)


def rate_panels(table: pd.DataFrame, by: str, panels: Sequence[Panel], path: str | Path, title: str = "",
                label: Callable[[Any], str] = str, cols: int | None = None) -> Path:
    """`rate_figure` written to `path`."""
    return save_figure(rate_figure(table, by, panels, title, label, cols), path, layout=False)


def latency_vs_rate(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """Mean normalized latency (s/token) against request rate, one line per policy, log scale (the
    vLLM paper's Figure 12; with a seed column: the mean over seeds and its 95% interval)."""
    fig = rate_figure(table, "policy", [Panel("mean_normalized_latency", "mean normalized latency (s/token)")],
                      legend=False)
    fig.set_size_inches(6.5, 4.8)
    legend_below(fig, *house_legend(fig), title, max_cols=4)
    return save_figure(fig, path, layout=False)


def memory_breakdown(memory: dict[str, dict[str, float]], path: str | Path, title: str = "") -> Path:
    """Stacked bars: allocated KV slots by category per policy, as shares (the paper's Figure 2)."""
    fig, ax = plt.subplots(figsize=(6, 4.6))
    policies = list(memory)
    bottoms = [0.0] * len(policies)
    for cat, color in CATEGORY_COLORS.items():
        vals = []
        for p in policies:
            total = sum(memory[p].values()) or 1.0
            vals.append(100 * memory[p].get(cat, 0.0) / total)
        ax.bar(policies, vals, bottom=bottoms, color=color, label=CATEGORY_LABELS[cat])
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, p in enumerate(policies):
        total = sum(memory[p].values()) or 1.0
        ax.text(i, 2, f"{100 * memory[p].get('kv_token_states', 0) / total:.1f}%", ha="center", color="white")
    ax.set_ylabel("% of allocated KV slots")
    ax.set_ylim(0, 100)
    legend_below(fig, *ax.get_legend_handles_labels(), title, max_cols=2)  # bars fill 0-100%: no room inside
    return save_figure(fig, path, layout=False)


def profile_fit_plot(profile: dict, path: str | Path) -> Path:
    """Measured against fitted step times of a profile's grid (log-log), one colour per point kind,
    with the fit's in-sample and held-out errors in the title."""
    coef = [profile["fit"]["coef"].get(f, 0.0) for f in FEATURES]
    ms = profile["measurements"]
    measured = [m["time_s"] * 1e3 for m in ms]
    # as fitted: grid points are the executor alone, served iterations also pay the loop terms
    fitted = [sum(a * b for a, b in zip(features(composition_of(m, i, int(profile["block_size"])),
                                                 m.get("source") == "served"), coef)) * 1e3 for i, m in enumerate(ms)]
    kinds = [m.get("label", "point").split()[0] for m in ms]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for kind in dict.fromkeys(kinds):
        xs = [x for x, k in zip(measured, kinds) if k == kind]
        ys = [y for y, k in zip(fitted, kinds) if k == kind]
        ax.scatter(xs, ys, s=18, label=kind)
    lo, hi = min(measured + fitted) * 0.8, max(measured + fitted) * 1.25
    ax.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("fitted step time (ms)")
    fit = profile["fit"]
    ax.set_title(f"{profile['model'].get('name', '')} on {profile.get('device', {}).get('name', '?')}\n"
                 f"error: mean {fit['mape']:.1%}, max {fit['max_ape']:.1%}, held-out {fit['cv_mape']:.1%}",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return save_figure(fig, path)
