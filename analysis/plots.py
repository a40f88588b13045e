"""Figures for sweeps and runs (matplotlib, written to PNG)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.seeds import rate_line
from sim.profiled import FEATURES, composition_of, features


def save_figure(fig: plt.Figure, path: str | Path, dpi: int = 120) -> Path:
    """Lay `fig` out, write it to `path` (PNG) and close it (an open figure keeps its memory)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path)


CATEGORY_COLORS = {"kv_token_states": "#4c72b0", "kv_reserved": "#dd8452", "kv_internal_frag": "#c44e52",
                   "kv_external_frag": "#8172b3"}
CATEGORY_LABELS = {"kv_token_states": "token states", "kv_reserved": "reserved",
                   "kv_internal_frag": "internal fragmentation", "kv_external_frag": "external fragmentation"}


def latency_vs_rate(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """Mean normalized latency (s/token) against request rate, one line per policy (with a seed
    column: the mean over seeds and a 95% CI band)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, g in table.groupby("policy", sort=False):
        rate_line(ax, g, "mean_normalized_latency", policy)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("mean normalized latency (s/token)")
    finite = table.mean_normalized_latency[table.mean_normalized_latency.notna()]
    if len(finite):
        ax.set_ylim(0, min(float(finite.max()), 10 * float(finite.min()) + 0.5))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def rate_panels(table: pd.DataFrame, by: str, panels: list[tuple[str, str, bool, tuple | None]],
                path: str | Path, title: str = "", label=str) -> Path:
    """One panel per (column, y label, log scale, y limits or None) against request rate, one line
    per value of `by` (legend text `label(value)` in the first panel; log only where every value
    is > 0). With a seed column: the mean over seeds and a 95% CI band per line."""
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 4))
    for ax, (col, ylabel, log, ylim) in zip(axes, panels):
        for key, g in table.groupby(by, sort=False):
            rate_line(ax, g, col, label(key))
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        if log and (table[col] > 0).all():
            ax.set_yscale("log")
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    return save_figure(fig, path)


SATURATED = 0.9  # achieved throughput under this share of the offered rate: the server no longer keeps up


def saturation_rate(g: pd.DataFrame) -> float:
    """The lowest offered rate at which one configuration's achieved throughput (mean over seeds)
    falls under SATURATED of it; NaN when it keeps up at every rate swept."""
    by_rate = g.groupby("rate", sort=True).throughput.mean()
    behind = by_rate[by_rate < SATURATED * by_rate.index.to_numpy()]
    return float(behind.index[0]) if len(behind) else float("nan")


def serving_panels(table: pd.DataFrame, path: str | Path, title: str = "", by: str = "policy") -> Path:
    """What `vllm bench serve` and guidellm report, against the offered rate, one colour per `by`:
    achieved throughput (the offered rate dashed), TTFT and time per output token (p50 solid, p90
    dotted) and E2E p90, log scale for latencies so that no curve leaves a panel; each
    configuration's saturation point (`saturation_rate`) marked by a vertical line in its colour.
    With a seed column, means over seeds and their 95% interval as bands. The legend sits under the
    panels, over no data."""
    panels = [("throughput", None, "achieved throughput (req/s)"), ("ttft_p50", "ttft_p90", "TTFT (s)"),
              ("tpot_p50", "tpot_p90", "time per output token (s)"), ("e2e_p90", None, "E2E latency p90 (s)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.2))
    rates = np.sort(table.rate.unique())
    axes[0].plot(rates, rates, color="0.6", linestyle="--", linewidth=1, label="offered rate")
    colors = {key: f"C{i}" for i, key in enumerate(table[by].unique())}  # one colour per line in every panel
    for ax, (p50, p90, ylabel) in zip(axes, panels):
        for key, g in table.groupby(by, sort=False):
            color = colors[key]
            rate_line(ax, g, p50, str(key) if ax is axes[0] else "_", color=color)
            if p90 is not None and p90 in g:
                rate_line(ax, g, p90, "_", color=color, linestyle=":")
            knee = saturation_rate(g)
            if knee == knee:
                ax.axvline(knee, color=color, linewidth=1, alpha=0.6)
        latencies = table[[c for c in (p50, p90) if c and c in table]].to_numpy(float)
        if ax is not axes[0] and (latencies[np.isfinite(latencies)] > 0).all():
            ax.set_yscale("log")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    handles += [plt.Line2D([], [], color="0.3"), plt.Line2D([], [], color="0.3", linestyle=":"),
                plt.Line2D([], [], color="0.3", linewidth=1, alpha=0.6)]
    labels += ["p50", "p90", f"saturation (throughput < {SATURATED:.0%} of offered)"]
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def memory_breakdown(memory: dict[str, dict[str, float]], path: str | Path, title: str = "") -> Path:
    """Stacked bars: allocated KV slots by category per policy, as shares (the paper's Figure 2)."""
    fig, ax = plt.subplots(figsize=(6, 4))
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
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    return save_figure(fig, path)


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
