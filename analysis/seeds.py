"""Seeds as a study axis: the same study repeated over several seeds, summarised with 95%
confidence intervals.

A study takes either one workload (today's table, no seed column) or one workload per seed: the
i-th drawn with seed base.seed + i (the caller re-draws a synthetic workload's lengths and
arrivals; a trace file's generated arrivals). Each run then takes that seed as its configuration's
seed and as the seed of the arrivals at each rate, and its row gains a `seed` column.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.report import Report
from traces.trace import Trace


def seeded(workload: Trace | Sequence[Trace], base_seed: int) -> tuple[list[tuple[int, Trace]], bool]:
    """([(seed, trace)] in seed order, whether rows carry a seed column). One Trace: its seed is
    base_seed and rows stay as they were; a sequence: the i-th trace is seed base_seed + i."""
    if isinstance(workload, Trace):
        return [(base_seed, workload)], False
    traces = list(workload)
    if not traces:
        raise ValueError("a seeded study needs at least one workload")
    return [(base_seed + i, t) for i, t in enumerate(traces)], True


def seed_workloads(draw: Callable[[int], Trace], base_seed: int, seeds: int) -> Trace | list[Trace]:
    """`draw(seed)` for each of `seeds` seeds from base_seed: one Trace when seeds == 1 (the study's
    table as without seeds), else the list a seeded study takes."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if base_seed + seeds > 2**32:  # numpy and the simulator take seeds in [0, 2**32)
        raise ValueError(f"--seeds {seeds} from --seed {base_seed} goes past the largest seed, 2**32 - 1")
    traces = [draw(base_seed + i) for i in range(seeds)]
    return traces[0] if seeds == 1 else traces


# metrics that are shares of something: their interval stays inside [0, 1]
PROPORTION = re.compile(r"attainment|fraction|usage|jain|meets|share")


def metric_bounds(metric: str, values: np.ndarray) -> tuple[float, float]:
    """Where a metric's mean can lie: [0, 1] for a proportion (by name, or booleans), [0, inf) for
    one whose values are all >= 0 (latencies, throughputs, counts), else unbounded (errors)."""
    if values.dtype == bool or PROPORTION.search(metric):
        return 0.0, 1.0
    finite = values[np.isfinite(values)]
    return (0.0, math.inf) if len(finite) and (finite >= 0).all() else (-math.inf, math.inf)


def mean_interval(x: np.ndarray, bounds: tuple[float, float] = (-math.inf, math.inf)) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `x` (one value per seed, NaN left out) and its 95% t interval,
    clipped to `bounds`; the interval is NaN with fewer than two values. The one interval every
    study's table and figure show."""
    from scipy import stats  # deferred: scipy is slow to import and only seeded studies need it

    x = np.asarray(x, dtype=float)
    x = x[~np.isnan(x)]
    if not len(x):
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if len(x) < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))
    return mean, max(mean - half, bounds[0]), min(mean + half, bounds[1])


def ci_table(table: pd.DataFrame, keys: Sequence[str], metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Per group of `keys`: the number of seeds, and for each metric its mean over seeds and the
    bounds of its 95% interval (`mean_interval`: t distribution, clipped where the metric is
    bounded; NaN with one seed) as <metric>_ci95_low and <metric>_ci95_high. Metrics default to every
    numeric column but the keys and `seed`; booleans count as 0/1 (a share); NaN values (a run with
    no answer) are left out of their metric's mean."""
    if metrics is None:
        metrics = [c for c in table.columns if c not in (*keys, "seed") and _numeric(table[c])]
    bounds = {m: metric_bounds(m, _values(table[m])) for m in metrics}
    rows = []
    for key, g in table.groupby(list(keys), sort=False):
        row: dict[str, Any] = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        row["seeds"] = int(g["seed"].nunique()) if "seed" in g else len(g)
        for m in metrics:
            row[m], row[f"{m}_ci95_low"], row[f"{m}_ci95_high"] = mean_interval(_values(g[m]), bounds[m])
        rows.append(row)
    return pd.DataFrame(rows)


def _values(column: pd.Series) -> np.ndarray:
    if column.dtype == bool:
        return column.to_numpy()
    return pd.to_numeric(column, errors="coerce").astype(float).to_numpy()


def _numeric(column: pd.Series) -> bool:
    """Numbers, booleans, or numbers with missing answers (None) among them."""
    if pd.api.types.is_numeric_dtype(column):
        return True
    values = column.dropna()
    return len(values) > 0 and pd.to_numeric(values, errors="coerce").notna().all()


def rate_line(ax: Any, data: pd.DataFrame, y: str, label: str, x: str = "rate", **style: Any) -> None:
    """One line of `y` against `x`: with a seed column, the mean over seeds and its 95% interval as a
    band (`mean_interval`, the interval the summary table gives); without, the points as they are.
    `style`: matplotlib line properties (color, linestyle)."""
    if "seed" not in data:
        data = data.sort_values(x, kind="stable")  # rates given out of order still draw one line left to right
        ax.plot(data[x], pd.to_numeric(data[y], errors="coerce"), marker="o", label=label, **style)
        return
    bounds = metric_bounds(y, _values(data[y]))
    points = [(at, *mean_interval(_values(g[y]).astype(float), bounds)) for at, g in data.groupby(x, sort=True)]
    xs, means, lows, highs = (np.array(v, dtype=float) for v in zip(*points))
    line, = ax.plot(xs, means, marker="o", label=label, **style)
    ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.2, linewidth=0)


# ---- a seeded study's terminal report ----

def seeds_note(seeds: int) -> str:
    """The figure-title suffix of a seeded study: which interval its bands show."""
    return f"; mean and 95% t interval over {seeds} seeds" if seeds > 1 else ""


FEW_SEEDS = 3  # below this, a 95% t interval is too wide (or too unstable) to tell configurations apart


def few_seeds_note(seeds: int) -> str | None:
    """A warning for a seeded study run on fewer than FEW_SEEDS seeds, else None."""
    if 1 < seeds < FEW_SEEDS:
        from scipy import stats  # deferred: scipy is slow to import and only seeded studies need it
        return (f"only {seeds} seeds: a 95% interval from {seeds} values means little (t = "
                f"{stats.t.ppf(0.975, seeds - 1):.2f} times the standard error); use --seeds {FEW_SEEDS} or more")
    return None


def seed_cell(row: dict) -> str:
    """A printed row's seed column (empty without seeds)."""
    return f" {row['seed']:>5}" if "seed" in row else ""


def seeded_report(table: pd.DataFrame, name: str, keys: list[str], metric: str) -> Report:
    """A report with `table` as the CSV file `name` and, with a seed column, the per-configuration
    means and 95% CIs (`keys` a configuration) as <name>_summary.csv, and `metric`'s lines."""
    report = Report()
    report.table(name, table)
    if "seed" in table:
        add_seed_summary(report, table, keys, name.removesuffix(".csv") + "_summary.csv", metric)
    return report


def add_seed_summary(report: Report, table: pd.DataFrame, keys: list[str], name: str, metric: str,
                     metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """The one place a study's seed summary and its warning are made: the per-configuration means
    and 95% intervals over seeds (`ci_table` of `metrics`, default every numeric column) as the
    report's file `name`, `metric`'s mean and interval per configuration as lines, and, under
    FEW_SEEDS seeds, the warning that the interval means little. Returns the summary."""
    summary = ci_table(table, keys, metrics)
    report.table(name, summary)
    seeds = int(summary.seeds.max()) if len(summary) else 0
    if seeds > 1:
        report.say(f"\n{metric}, mean [95% t interval] over {seeds} seeds:")
    else:
        report.say(f"\n{metric} (one seed: no interval; --seeds {FEW_SEEDS} or more gives one):")
    for r in summary.itertuples(index=False):
        d = r._asdict()
        interval = f" [{d[metric + '_ci95_low']:.4g}, {d[metric + '_ci95_high']:.4g}]" if seeds > 1 else ""
        report.say("  " + " ".join(f"{d[k]}" for k in keys) + f": {d[metric]:.4g}" + interval)
    note = few_seeds_note(seeds)
    if note:
        warnings.warn(note, stacklevel=3)
    report.wrote(name)
    return summary
