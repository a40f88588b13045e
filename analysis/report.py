"""What studies hand back: plain-text tables of run summaries for the terminal, and the Report of
files and lines a study's command writes and prints (pagesim.report_writer does both)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

ROWS: tuple[tuple[str, str, str], ...] = (
    # (label, path into the summary, format)
    ("requests finished", "num_finished", "{:,.0f}"),
    ("requests rejected", "num_rejected", "{:,.0f}"),
    ("request throughput (req/s)", "request_throughput", "{:.3f}"),
    ("output throughput (tok/s)", "output_token_throughput", "{:,.1f}"),
    ("mean normalized latency (s/tok)", "mean_normalized_latency", "{:.4f}"),
    ("TTFT mean / p90 (s)", "ttft.mean|ttft.p90", "{:.3f}"),
    ("TPOT mean / p90 (s)", "tpot.mean|tpot.p90", "{:.4f}"),
    ("e2e latency mean / p90 (s)", "e2e_latency.mean|e2e_latency.p90", "{:.2f}"),
    ("goodput (req/s)", "goodput", "{:.3f}"),
    ("preemptions", "num_preemptions", "{:,.0f}"),
    ("prefix cache hits (tokens)", "prefix_hit_tokens", "{:,.0f}"),
    ("mean batched sequences", "mean_batched_seqs", "{:.1f}"),
    ("allocated KV holding token states", "kv_token_state_fraction", "{:.1%}"),
    ("KV allocated (of capacity)", "kv_usage", "{:.1%}"),
    ("KV capacity (tokens)", "kv_capacity_tokens", "{:,.0f}"),
    ("first arrival to last finish (s)", "duration_s", "{:,.1f}"),
    ("wall time (s)", "wall_time_s", "{:.2f}"),
)
# shown when a run has client latencies (a cost model with client terms): after the server's TTFT...
CLIENT_ROWS: tuple[tuple[str, str, str], ...] = (
    ("client TTFT mean / p90 (s)", "client_ttft.mean|client_ttft.p90", "{:.3f}"),
    ("client TPOT mean / p90 (s)", "client_tpot.mean|client_tpot.p90", "{:.4f}"),
    ("client e2e latency mean / p90 (s)", "client_e2e_latency.mean|client_e2e_latency.p90", "{:.2f}"),
)


def table_value(x: Any) -> Any:
    """A summary value as a study's table holds it: a null (no SLO, so no goodput) is NaN, as a CSV
    reads it back."""
    return math.nan if x is None else x


def _get(summary: dict[str, Any], path: str) -> Any:
    cur: Any = summary
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _cell(summary: dict[str, Any], paths: str, fmt: str) -> str:
    out = []
    for p in paths.split("|"):
        v = _get(summary, p)
        out.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v))
    return " / ".join(out)


def summary_table(summaries: dict[str, dict[str, Any]]) -> str:
    """Summaries side by side, one column per run."""
    names = list(summaries)
    rows = _rows(summaries.values())
    label_w = max(len(r[0]) for r in rows)
    cells = [[_cell(summaries[n], path, fmt) for n in names] for _, path, fmt in rows]
    widths = [max(len(n), *(len(row[i]) for row in cells)) for i, n in enumerate(names)]
    lines = ["  ".join([" " * label_w] + [n.rjust(w) for n, w in zip(names, widths)])]
    lines.append("  ".join(["-" * label_w] + ["-" * w for w in widths]))
    for (label, _, _), row in zip(rows, cells):
        lines.append("  ".join([label.ljust(label_w)] + [c.rjust(w) for c, w in zip(row, widths)]))
    if any(s.get("num_requests") and s.get("goodput", 0) is None for s in summaries.values()):
        lines.append("(goodput '-': no SLO given (--slo-ttft, --slo-tpot), so there is nothing to count it against)")
    return "\n".join(lines)


def _rows(summaries: Iterable[dict[str, Any]]) -> tuple[tuple[str, str, str], ...]:
    """ROWS, with the client's latencies after the server's e2e row when a run has them (goodput,
    judged on them, then says so)."""
    if not any("client_ttft" in s for s in summaries):
        return ROWS
    at = [r[1] for r in ROWS].index("goodput")
    return (*ROWS[:at], *CLIENT_ROWS, ("goodput, client latencies (req/s)", "goodput", "{:.3f}"), *ROWS[at + 1:])


NUMBER = r"\d[\d,.]*"


def rejection_lines(requests: pd.DataFrame, examples: int = 1) -> list[str]:
    """Why requests were rejected, most common kind first: reasons that differ only in their
    numbers are one kind, printed with its count, the numbers every one of them shares (the
    model's context), N for those that vary, and an example (nothing when none were rejected)."""
    reasons = requests.reject_reason[requests.status == "rejected"].fillna("").astype(str)
    if reasons.empty:
        return []
    kinds = reasons.str.replace(NUMBER, "#", regex=True)
    lines = [f"{len(reasons):,} rejected:"]
    for kind, count in kinds.value_counts().items():
        group = reasons[kinds == kind]
        if "#" not in kind:
            lines.append(f"  {count:,} x {kind or '(no reason)'}")
            continue
        numbers = group.str.findall(NUMBER).tolist()  # same count in each: they share the kind
        shared = [n if all(ns[i] == n for ns in numbers) else "N" for i, n in enumerate(numbers[0])]
        text = "".join(part + number for part, number in zip(kind.split("#"), [*shared, ""]))
        lines.append(f"  {count:,} x {text}, e.g. {'; '.join(group.iloc[:examples].tolist())}")
    return lines


def replica_table(summary: dict[str, Any]) -> str:
    """A multi-replica run's spread: one row per replica (requests, busy share, latency, hits)."""
    router = summary.get("router")
    if not router:
        return ""
    head = f"router {router['name']}: {len(router['replicas'])} replicas, requests max/mean {router['imbalance']:.2f}"
    if "affinity_routed" in router:
        head += f", {router['affinity_routed']:,} routed by prefix match"
    lines = [head, f"{'replica':>7}  {'hardware':<10}  {'KV blocks':>9}  {'requests':>8}  {'busy':>6}  "
                   f"{'norm. latency':>13}  {'prefix hits':>11}  {'preempted':>9}"]
    for r in router["replicas"]:
        lat = r["mean_normalized_latency"]
        lat_s = "-" if isinstance(lat, float) and math.isnan(lat) else f"{lat:.4f}"
        lines.append(f"{r['replica']:>7}  {r['hardware']:<10}  {r['num_gpu_blocks']:>9,}  {r['requests']:>8,}  "
                     f"{r['busy_fraction']:>6.1%}  {lat_s:>13}  {r['prefix_hit_tokens']:>11,}  {r['preemptions']:>9,}")
    return "\n".join(lines)


class Columns:
    """A printed table's columns, each (title, row key, format spec of its values): the header and
    every row come from the same specs, so they stay aligned. A title is laid out with its spec's
    alignment and width ("<12", ">9" of ">9.3f")."""

    def __init__(self, *columns: tuple[str, str, str]) -> None:
        self.columns = columns

    def header(self) -> str:
        return " ".join(f"{title:{_layout(spec)}}" for title, _, spec in self.columns)

    def row(self, r: dict[str, Any]) -> str:
        return " ".join(f"{r[key]:{spec}}" for _, key, spec in self.columns)

    def widened(self, key: str, values: Iterable[str]) -> Columns:
        """These columns with the text column `key` as wide as the longest of `values` (the names
        its rows will hold, e.g. a plug-in router's module path), so those rows stay aligned."""
        longest = max((len(str(v)) for v in values), default=0)

        def fit(title: str, k: str, spec: str) -> tuple[str, str, str]:
            layout = _layout(spec)
            align, width = layout[:1] if layout[:1] in "<>^" else "", layout.lstrip("<>^")
            if k != key or longest <= int(width or 0):
                return title, k, spec
            return title, k, align + str(longest) + spec[len(layout):]

        return Columns(*(fit(*c) for c in self.columns))


def _layout(spec: str) -> str:
    """The alignment and width of a format spec: '>9' of '>9.3f', '<16' of '<16', '>8' of '>8,'."""
    align = spec[0] if spec[:1] in "<>^" and spec else ""
    rest = spec[len(align):]
    width = rest[:len(rest) - len(rest.lstrip("0123456789"))]
    return align + width


@dataclass(frozen=True)
class Wrote:
    """A report's "<before>wrote <folder>/<first>, <second>, ..." line: the folder is the writer's to name."""

    names: tuple[str, ...]
    before: str = ""


@dataclass
class Report:
    """What a study returns for its command to write and say. Invariant: a study never writes a
    file or prints; `files` (name -> how to write it at the path given) are written, in order, into
    the one folder the command names, then `lines` are printed in order (a Wrote line names files
    in that folder). Without a folder the files and the Wrote lines are left out."""

    files: dict[str, Callable[[Path], object]] = field(default_factory=dict)
    lines: list[str | Wrote] = field(default_factory=list)

    def table(self, name: str, frame: pd.DataFrame) -> None:
        """A table written as CSV (without the index)."""
        self.files[name] = lambda path: frame.to_csv(path, index=False)

    def figure(self, name: str, draw: Callable[[Path], object]) -> None:
        """A figure drawn by `draw(path)`."""
        self.files[name] = draw

    def json(self, name: str, data: Any, default: Callable[[Any], Any] | None = None) -> None:
        """An object written as indented JSON (`default` converts what json cannot write)."""
        self.files[name] = lambda path: Path(path).write_text(json_text(data, default))

    def say(self, *lines: str) -> None:
        self.lines.extend(lines)

    def wrote(self, *names: str, before: str = "") -> None:
        """The line naming the files written (some of them: a study names what a reader looks for),
        after `before` on the same line."""
        self.lines.append(Wrote(names, before))


def json_text(data: Any, default: Callable[[Any], Any] | None = None) -> str:
    """A report's JSON file: indented one space, ending in a newline."""
    return json.dumps(data, indent=1, default=default) + "\n"
