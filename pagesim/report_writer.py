"""The one place a command writes a study's report and prints its closing lines (analysis.report.Report),
and writes a run's three files (requests.csv, iterations.parquet, summary.json)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.report import Columns, Report, Wrote, json_text
from analysis.seeds import seed_cell


class RowPrinter:
    """A study's table printed as it runs: the header once, then a row as each run finishes (with a
    seed column when the study repeats over seeds)."""

    def __init__(self, columns: Columns, seeds: int = 1) -> None:
        self.columns = columns
        self.seeds = seeds

    def header(self) -> None:
        print(self.columns.header() + (f" {'seed':>5}" if self.seeds > 1 else ""))

    def __call__(self, row: dict) -> None:
        print(self.columns.row(row) + seed_cell(row), flush=True)


def write_report(report: Report, out: str | Path | None) -> None:
    """Write the report's files into `out` (made if missing; a name may hold subfolders, made too),
    then print its lines. Without `out` (an optional --out not given) nothing is written and the
    lines naming written files are left out."""
    folder = None if out is None else Path(out)
    if folder is not None and report.files:
        for name, write in report.files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            write(folder / name)
    for line in report.lines:
        if not isinstance(line, Wrote):
            print(line)
        elif folder is not None:
            print(f"{line.before}wrote {folder}/{', '.join(line.names)}")


def print_study(title: str, rows: RowPrinter, run: Callable[[RowPrinter], Report], out: str | Path | None) -> int:
    """A simulated study's command: its title, its table row by row as `run(rows)` goes, then the
    report `run` returns written to `out`."""
    print(title)
    rows.header()
    write_report(run(rows), out)
    return 0


def write_json(path: str | Path, data: object) -> None:
    """One JSON file at `path` (its folder made if missing), and the line saying so."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json_text(data))
    print(f"wrote {path}")


def write_run(out_dir: str | Path, requests: pd.DataFrame, iterations: pd.DataFrame, summary: dict) -> Path:
    """A run's folder: requests.csv, iterations.parquet and summary.json (the same three files, simulated or live)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    requests.to_csv(out / "requests.csv", index=False)
    iterations.to_parquet(out / "iterations.parquet", index=False)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_jsonable) + "\n")
    return out


def _jsonable(x: object) -> object:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
