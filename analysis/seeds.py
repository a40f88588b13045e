"""Seeds as a study axis: the same study repeated over several seeds, summarised with 95%
confidence intervals.

A study takes either one workload (today's table, no seed column) or one workload per seed: the
i-th drawn with seed base.seed + i (the caller re-draws a synthetic workload's lengths and
arrivals; a trace file's generated arrivals). Each run then takes that seed as its configuration's
seed and as the seed of the arrivals at each rate, and its row gains a `seed` column.
"""

from __future__ import annotations

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


def ci_table(table: pd.DataFrame, keys: Sequence[str], metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Per group of `keys`: the number of seeds, and for each metric its mean over seeds and the
    half-width of its 95% confidence interval (t distribution; NaN with one seed). Metrics default
    to every numeric column but the keys and `seed`; booleans count as 0/1 (a share); NaN values
    (a run with no answer) are left out of their metric's mean."""
    from scipy import stats

    if metrics is None:
        metrics = [c for c in table.columns if c not in (*keys, "seed") and _numeric(table[c])]
    rows = []
    for key, g in table.groupby(list(keys), sort=False):
        row: dict[str, Any] = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        row["seeds"] = int(g["seed"].nunique()) if "seed" in g else len(g)
        for m in metrics:
            x = pd.to_numeric(g[m], errors="coerce").astype(float).dropna().to_numpy()
            row[m] = float(x.mean()) if len(x) else float("nan")
            row[f"{m}_ci95"] = (float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))
                                if len(x) > 1 else float("nan"))
        rows.append(row)
    return pd.DataFrame(rows)


def _numeric(column: pd.Series) -> bool:
    """Numbers, booleans, or numbers with missing answers (None) among them."""
    if pd.api.types.is_numeric_dtype(column):
        return True
    values = column.dropna()
    return len(values) > 0 and pd.to_numeric(values, errors="coerce").notna().all()


def rate_line(ax: Any, data: pd.DataFrame, y: str, label: str, x: str = "rate") -> None:
    """One line of `y` against `x`: with a seed column, the mean over seeds and its 95% CI band
    (seaborn, bootstrap seeded for a repeatable figure); without, the points as they are."""
    if "seed" in data:
        import seaborn as sns

        # legend=False: the line keeps its label, the caller decides which panel shows a legend
        sns.lineplot(data=data, x=x, y=y, marker="o", errorbar=("ci", 95), seed=0, ax=ax, label=label, legend=False)
    else:
        ax.plot(data[x], data[y], marker="o", label=label)


# ---- a seeded study's terminal report ----

def seeds_note(seeds: int) -> str:
    """The figure-title suffix of a seeded study."""
    return f"; 95% CI over {seeds} seeds" if seeds > 1 else ""


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


def add_seed_summary(report: Report, table: pd.DataFrame, keys: list[str], name: str, metric: str) -> None:
    """The per-configuration means and 95% CIs over seeds as the report's file `name`, and `metric`'s lines."""
    summary = ci_table(table, keys)
    report.table(name, summary)
    report.say(f"\n{metric}, mean +- 95% CI over {int(summary.seeds.max())} seeds:")
    for r in summary.itertuples(index=False):
        d = r._asdict()
        report.say("  " + " ".join(f"{d[k]}" for k in keys) + f": {d[metric]:.4g} +- {d[metric + '_ci95']:.2g}")
    report.wrote(name)
