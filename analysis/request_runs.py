"""Per-request benchmark runs (the layout of ../shared/calibration/llmservingsim/bench/...): read,
replayed exactly, and compared request by request and over time.

A run folder holds
- `meta.json`: the engine's arguments (`engine_kwargs`: model, tensor_parallel_size, max_num_seqs,
  max_num_batched_tokens, max_model_len, enable_prefix_caching, ...), `dataset_path` (the workload,
  relative to an ancestor folder of the run), `num_requests`, `started_at`, `tick_seconds`;
- `requests.jsonl`: per request `input_toks`, `output_toks`, `arrival_time` (wall clock, s) and
  `queued_ts`, `scheduled_ts`, `first_token_ts`, `last_token_ts` (one monotonic clock, s);
- `timeseries.csv`: every tick, `t` (s since `started_at`), `running`, `waiting`, `kv_cache_pct`;
- the workload JSONL: per request `input_toks`, `output_toks`, `arrival_time_ns`, `input_tok_ids`.

The two clocks are aligned on the first request (its arrival is when it was queued); then every
request's arrival must precede its queueing (within `CLOCK_SLACK_S`) and the four timestamps must
come in order, or the run is refused naming the line and field. The replay keeps each request's
arrival (relative to the first), prompt token ids (so prefix caching hits what the engine hit) and
output length; the workload must hold the same requests as requests.jsonl, in the same order.

Measured per request: TTFT = first token - arrival, E2E = last token - arrival, TPOT = (last -
first) / (output - 1). Predicted: the simulated request table's client columns when the cost model
has client terms (what the measuring process saw), else the server's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.measurement_formats import (
    Fields,
    hardware_field,
    json_objects,
    model_field,
    read_csv_columns,
    tp_field,
)
from analysis.measurements import Experiment, Latency, Stage
from analysis.plots import house_legend, legend_below, save_figure
from analysis.report import Report
from policies.client_latency import ClientTerms, has_client_latencies, with_client_latencies
from sim.specs import get_hardware
from traces.loaders import read_jsonl
from traces.trace import Trace

CLOCK_SLACK_S = 0.05        # a request queued this long before its aligned arrival: the clocks disagree
STATISTICS = ("mean", "p50", "p90", "p99")
PER_REQUEST = ("ttft", "tpot", "e2e_latency")
OVER_TIME = ("running", "waiting", "kv_usage")
_REQUEST_FIELDS = ("input_toks", "output_toks", "arrival_time", "queued_ts", "scheduled_ts", "first_token_ts",
                   "last_token_ts")
_TIMESERIES_COLUMNS = ("t", "running", "waiting", "kv_cache_pct")


@dataclass(frozen=True)
class MeasuredRun:
    """What a per-request run measured beyond a stage's summary: one row per request (request_id
    0..n-1 in arrival order: arrival relative to the first, prompt_len, output_len, ttft, tpot,
    e2e_latency, seconds) and the engine's gauges over time (t relative to the first arrival,
    running, waiting, kv_usage as a fraction; None when the run has no timeseries.csv)."""

    requests: pd.DataFrame
    timeseries: pd.DataFrame | None
    tick_s: float
    source: str

    def metrics(self) -> dict[str, float]:
        """The measured `REQUEST_RUN_METRICS` (the gauges' means only with a timeseries)."""
        ttft, tpot = self.requests.ttft.to_numpy(np.float64), self.requests.tpot.dropna().to_numpy(np.float64)
        out = {"ttft_p10": float(np.percentile(ttft, 10)), "ttft_p50": float(np.percentile(ttft, 50)),
               "tpot_p50": float(np.percentile(tpot, 50)), "tpot_p90": float(np.percentile(tpot, 90))}
        if self.timeseries is not None:
            out.update(running_mean=float(self.timeseries.running.mean()),
                       waiting_mean=float(self.timeseries.waiting.mean()))
        return out

    def predicted_gauges(self, iterations: pd.DataFrame) -> dict[str, float]:
        """The simulated engine's mean running and waiting requests at this run's ticks."""
        if self.timeseries is None:
            return {}
        g = simulated_gauges(iterations, self.timeseries.t.to_numpy(np.float64))
        return {"running_mean": float(g.running.mean()), "waiting_mean": float(g.waiting.mean())}


def is_request_run(path: Path) -> bool:
    """A folder (or a file in one) with meta.json or requests.jsonl: a per-request run, whose loader
    then names whichever of its files is missing or unreadable (was: a meta.json that was a folder
    sent the run to the pagesim-run reader, which asked for a summary.json)."""
    folder = path if path.is_dir() else path.parent
    return (folder / "meta.json").exists() or (folder / "requests.jsonl").exists()


def load_request_run(path: Path, models_dirs: Sequence[str | Path] | None = None,
                     hardware: str | None = None) -> Experiment:
    """The run as an Experiment of one stage replaying its requests; the stage carries the
    MeasuredRun. Malformed input raises ValueError naming the file, line and field."""
    folder = path if path.is_dir() else path.parent
    for name in ("meta.json", "requests.jsonl"):
        if not (folder / name).exists():
            raise ValueError(f"{folder / name}: missing (a per-request run folder holds meta.json, requests.jsonl "
                             "and timeseries.csv)")
    meta_path = folder / "meta.json"
    meta = Fields(json_objects(meta_path)[0], meta_path)
    engine = meta.sub("engine_kwargs")
    model_id, model = model_field(engine, "model", models_dirs)
    workload_path = _workload_path(folder, meta)
    measured = _read_requests(folder / "requests.jsonl")
    ids = _read_workload(workload_path, measured)
    n = meta.int("num_requests", len(measured), minimum=1)
    if n != len(measured):
        raise meta.error("num_requests", f"{n}, but {folder / 'requests.jsonl'} holds {len(measured)} requests")
    arrival = measured.arrival.to_numpy(np.float64)
    trace = Trace(arrival=arrival, prompt_len=measured.prompt_len.to_numpy(), output_len=measured.output_len.to_numpy(),
                  prompt_token_ids=ids, name=workload_path.stem, source=str(folder))
    tick = meta.num("tick_seconds", 1.0, strict=True)
    timeseries = _read_timeseries(folder / "timeseries.csv", _start_offset(meta, measured.attrs["first_arrival"]))
    run = MeasuredRun(measured, timeseries, tick, str(folder))
    span = float(arrival[-1] - arrival[0])
    stage = Stage(index=0, rate=(len(trace) - 1) / span if span > 0 else 1.0, duration_s=span, load_type="recorded",
                  ttft=_latency(measured.ttft), e2e=_latency(measured.e2e_latency),
                  output_len=float(measured.output_len.mean()), prompt_len_mean=float(measured.prompt_len.mean()),
                  throughput_rps=len(measured) / float((measured.arrival + measured.e2e_latency).max()),
                  successes=len(measured), requests=trace, measured_run=run)
    kw = engine.obj
    return Experiment(
        name=_run_name(folder), model_id=model_id, model=model, tp=tp_field(engine, "tensor_parallel_size", model),
        stages=(stage,), workload_name=trace.name, max_model_len=engine.int("max_model_len", None, minimum=1),
        max_num_batched_tokens=engine.int("max_num_batched_tokens", None, minimum=1),
        max_num_seqs=engine.int("max_num_seqs", None, minimum=1), block_size=engine.int("block_size", 16, minimum=1),
        prefix_caching=engine.bool("enable_prefix_caching", True),
        chunked_prefill=engine.bool("enable_chunked_prefill", True),
        gpu_memory_utilization=engine.num("gpu_memory_utilization", 0.9, strict=True),
        num_gpu_blocks=engine.int("num_gpu_blocks_override", None, minimum=1),
        hardware=hardware or hardware_field(meta, "hardware") or hardware_field(meta, "gpu") or _hardware_of_path(folder),
        source=str(folder) + ("" if kw.get("data_parallel_size", 1) in (1, None) else " (data parallel: not modelled)"),
        engine_version=meta.str("vllm_version") if meta.has("vllm_version") else None)


def run_files(path: Path) -> list[Path]:
    """The files a run folder's data lie in: meta.json, requests.jsonl, timeseries.csv (when there)
    and the workload meta.json names."""
    folder = path if path.is_dir() else path.parent
    meta = Fields(json_objects(folder / "meta.json")[0], folder / "meta.json")
    files = [folder / name for name in ("meta.json", "requests.jsonl", "timeseries.csv") if (folder / name).is_file()]
    return [*files, _workload_path(folder, meta)]


def _run_name(folder: Path) -> str:
    """The run's name: the folders that say what ran (…/<GPU>/<model>/<engine>)."""
    return "/".join(folder.resolve().parts[-3:])


def _hardware_of_path(folder: Path) -> str | None:
    """The GPU a run folder's path names (…/bench/examples/RTXPRO6000/...), when one is a known spec."""
    for part in reversed(folder.resolve().parts):
        try:
            return get_hardware(part).name
        except ValueError:
            continue
    return None


def _workload_path(folder: Path, meta: Any) -> Path:
    """meta.json's dataset_path, resolved against the run folder and each folder above it."""
    rel = meta.str("dataset_path")
    for base in dict.fromkeys((folder, *folder.parents, *folder.resolve().parents)):  # as given first
        if (base / rel).is_file():
            return base / rel
    raise meta.error("dataset_path", f"{rel!r} not found under {folder} or any folder above it")


def _number(path: Path, no: int, obj: dict[str, Any], key: str, integer: bool = False) -> float:
    v = obj.get(key)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    if not ok or (integer and (v != int(v) or v < 1)):
        want = "an integer >= 1" if integer else "a finite number >= 0"
        raise ValueError(f"{path}: line {no}: {key}: expected {want}, got {v!r}")
    return float(v)


def _read_requests(path: Path) -> pd.DataFrame:
    """requests.jsonl as MeasuredRun.requests (attrs["first_arrival"]: the first wall-clock arrival)."""
    rows = []
    for no, obj in read_jsonl(path):
        rows.append([_number(path, no, obj, k, integer=k.endswith("_toks")) for k in _REQUEST_FIELDS] + [no])
    raw = pd.DataFrame(rows, columns=[*_REQUEST_FIELDS, "line"])
    if not raw.arrival_time.is_monotonic_increasing:
        bad = int(np.flatnonzero(np.diff(raw.arrival_time.to_numpy()) < 0)[0]) + 1
        raise ValueError(f"{path}: line {raw.line[bad]}: arrival_time: earlier than the line before (requests must "
                         "be in arrival order)")
    offset = raw.queued_ts[0] - raw.arrival_time[0]  # the clocks aligned on the first request
    arrival = raw.arrival_time + offset
    order = (("arrival_time", arrival - CLOCK_SLACK_S), ("queued_ts", raw.queued_ts),
             ("scheduled_ts", raw.scheduled_ts), ("first_token_ts", raw.first_token_ts),
             ("last_token_ts", raw.last_token_ts))
    for (_, before), (name, after) in itertools.pairwise(order):
        wrong = (after < before).to_numpy()
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise ValueError(f"{path}: line {raw.line[i]}: {name}: {after[i]:.6f} precedes the request's earlier "
                             f"event (clocks aligned on the first request: arrival {arrival[i]:.6f}); the clocks "
                             "cannot be aligned")
    out = raw.output_toks.to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(out > 1, (raw.last_token_ts - raw.first_token_ts) / (out - 1), np.nan)
    frame = pd.DataFrame({"request_id": np.arange(len(raw)), "arrival": raw.arrival_time - raw.arrival_time[0],
                          "prompt_len": raw.input_toks.astype(np.int64), "output_len": raw.output_toks.astype(np.int64),
                          "ttft": raw.first_token_ts - arrival, "tpot": tpot,
                          "e2e_latency": raw.last_token_ts - arrival})
    frame.attrs["first_arrival"] = float(raw.arrival_time[0])
    return frame


def _read_workload(path: Path, measured: pd.DataFrame) -> list[list[int]]:
    """The workload's prompt token ids, checked line by line against the measured requests."""
    lines = read_jsonl(path)
    if len(lines) != len(measured):
        raise ValueError(f"{path}: {len(lines)} requests, but requests.jsonl holds {len(measured)}")
    ids = []
    for i, (no, obj) in enumerate(lines):
        for key, col in (("input_toks", "prompt_len"), ("output_toks", "output_len")):
            v = _number(path, no, obj, key, integer=True)
            if v != measured[col][i]:
                raise ValueError(f"{path}: line {no}: {key}: {int(v)}, but requests.jsonl has {measured[col][i]} "
                                 "for the same request")
        tok = obj.get("input_tok_ids")
        if not isinstance(tok, list) or len(tok) != measured.prompt_len[i] or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tok):
            raise ValueError(f"{path}: line {no}: input_tok_ids: expected {measured.prompt_len[i]} token ids "
                             "(integers >= 0)")
        ids.append(tok)
    return ids


def _start_offset(meta: Any, first_arrival: float) -> float:
    """Seconds from the first arrival to meta.json's started_at (timeseries t counts from it); 0
    when the run does not say when it started."""
    started = meta.raw("started_at", None)
    if started is None:
        return 0.0
    try:
        return datetime.fromisoformat(str(started).replace("Z", "+00:00")).timestamp() - first_arrival
    except ValueError:
        raise meta.error("started_at", f"expected an ISO 8601 time, got {started!r}") from None


def _read_timeseries(path: Path, offset: float) -> pd.DataFrame | None:
    """timeseries.csv with t moved to count from the first arrival and kv_usage as a fraction."""
    if not path.exists():  # a run without gauges (a folder of that name is refused, not skipped)
        return None
    frame = read_csv_columns(path, _TIMESERIES_COLUMNS, f"known: {', '.join(_TIMESERIES_COLUMNS)}")
    for c in _TIMESERIES_COLUMNS:
        values = pd.to_numeric(frame[c], errors="coerce").to_numpy(np.float64)
        bad = ~np.isfinite(values) | (values < 0)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{path}: line {row + 2}: {c}: expected a number >= 0, got {frame[c][row]!r}")
    return pd.DataFrame({"t": frame.t.to_numpy(np.float64) + offset, "running": frame.running.to_numpy(np.float64),
                         "waiting": frame.waiting.to_numpy(np.float64),
                         "kv_usage": frame.kv_cache_pct.to_numpy(np.float64) / 100.0})


def _latency(x: pd.Series) -> Latency:
    p90, p99 = np.percentile(x.to_numpy(np.float64), [90, 99])
    return Latency(float(x.mean()), float(p90), float(p99))


# --- measured against predicted -------------------------------------------------------------------

def predicted_requests(requests: pd.DataFrame, iterations: pd.DataFrame,
                       client: ClientTerms | None = None) -> pd.DataFrame:
    """Per simulated request (by request_id): ttft, tpot, e2e_latency as the measurement saw them:
    with `client`'s terms when given, else the table's own client columns when it has them (the
    run's cost model's terms), else the server's."""
    r = with_client_latencies(requests, iterations, client)
    prefix = "client_" if has_client_latencies(r) else ""
    return pd.DataFrame({"request_id": r.request_id.to_numpy(),
                         **{m: r[f"{prefix}{m}"].to_numpy(np.float64) for m in PER_REQUEST}})


def per_request_comparison(measured: pd.DataFrame, predicted: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per request with measured_* and predicted_* latencies, one row per (metric,
    statistic) with measured, predicted and error % = 100 (predicted - measured) / measured), over
    the requests both finished."""
    both = measured[["request_id", *PER_REQUEST]].merge(predicted, on="request_id", suffixes=("_measured",
                                                                                               "_predicted"))
    rows = []
    for m in PER_REQUEST:
        a, b = both[f"{m}_measured"].dropna(), both[f"{m}_predicted"].dropna()
        for stat in STATISTICS:
            mv, pv = _stat(a, stat), _stat(b, stat)
            rows.append({"metric": m, "statistic": stat, "measured": mv, "predicted": pv,
                         "error_pct": 100 * (pv - mv) / mv if mv else math.nan})
    return both, pd.DataFrame(rows)


def _stat(x: pd.Series, stat: str) -> float:
    if not len(x):
        return math.nan
    return float(x.mean()) if stat == "mean" else float(np.percentile(x.to_numpy(np.float64), int(stat[1:])))


def simulated_gauges(iterations: pd.DataFrame, times: np.ndarray) -> pd.DataFrame:
    """The simulated engine's running and waiting requests and KV-cache usage (allocated blocks'
    share) at each of `times`, as a gauge read then shows them: those of the last iteration that
    started at or before it (nothing running or waiting before the first one and once the engine
    went idle after the last one)."""
    its = iterations.sort_values("start", kind="stable")
    start = its.start.to_numpy(np.float64)
    end = start + its.duration.to_numpy(np.float64)
    kv = its[["kv_token_states", "kv_reserved", "kv_internal_frag", "kv_external_frag"]].sum(axis=1).to_numpy(float)
    total = kv + its.kv_free.to_numpy(np.float64)
    at = np.searchsorted(start, times, side="right") - 1
    live = (at >= 0) & (times < np.maximum.accumulate(end)[np.maximum(at, 0)] + 1e-9) if len(start) else np.zeros(
        len(times), bool)
    idx = np.maximum(at, 0)

    def pick(values: np.ndarray) -> np.ndarray:
        return np.where(live, values[idx], 0.0) if len(values) else np.zeros(len(times))

    return pd.DataFrame({"t": times, "running": pick(its.running.to_numpy(np.float64)),
                         "waiting": pick(its.waiting.to_numpy(np.float64)),
                         "kv_usage": pick(kv / np.maximum(total, 1.0))})


def over_time_comparison(measured: pd.DataFrame, iterations: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]:
    """(measured and predicted gauges at the run's ticks, per gauge: the mean absolute error relative
    to the measured mean, over the ticks; KV usage only when the run logged it non-zero)."""
    sim = simulated_gauges(iterations, measured.t.to_numpy(np.float64))
    table = pd.DataFrame({"t": measured.t})
    errors: dict[str, Any] = {}
    for g in OVER_TIME:
        table[f"{g}_measured"], table[f"{g}_predicted"] = measured[g].to_numpy(), sim[g].to_numpy()
        mean = float(measured[g].mean())
        if g == "kv_usage" and not (measured[g] > 0).any():
            errors[g] = None  # the run logged 0.0 throughout: the gauge was not recorded
            continue
        mae = float(np.abs(sim[g].to_numpy() - measured[g].to_numpy()).mean())
        errors[g] = {"mae": mae, "measured_mean": mean, "relative_mae_pct": 100 * mae / mean if mean else math.nan}
    return table, errors


@dataclass
class RequestRunReport:
    """A per-request run's comparison: `requests` and `statistics` (per_request_comparison),
    `over_time` and `over_time_errors` (over_time_comparison; None without a timeseries)."""

    name: str
    requests: pd.DataFrame
    statistics: pd.DataFrame
    over_time: pd.DataFrame | None
    over_time_errors: dict[str, Any] | None

    def summary(self) -> dict[str, Any]:
        stats = {f"{r.metric}_{r.statistic}": {"measured": r.measured, "predicted": r.predicted,
                                               "error_pct": r.error_pct} for r in self.statistics.itertuples()}
        return {"run": self.name, "per_request": stats, "over_time": self.over_time_errors}


def request_run_report(name: str, run: MeasuredRun, requests: pd.DataFrame, iterations: pd.DataFrame,
                       client: ClientTerms | None = None) -> RequestRunReport:
    """A simulated replay of `run` (its request and iteration tables) compared with what it measured."""
    both, stats = per_request_comparison(run.requests, predicted_requests(requests, iterations, client))
    if run.timeseries is None:
        return RequestRunReport(name, both, stats, None, None)
    table, errors = over_time_comparison(run.timeseries, iterations)
    return RequestRunReport(name, both, stats, table, errors)


def stage_reports(experiments: Sequence[Experiment], results: Sequence[Any],
                  client: ClientTerms | None = None) -> list[RequestRunReport]:
    """The per-request comparison of every simulated stage (measurements.StageResult, with its
    tables kept) whose stage was a per-request run, in order."""
    runs = {(e.name, s.index): s.measured_run for e in experiments for s in e.stages if s.measured_run is not None}
    return [request_run_report(f"{r.experiment}#{r.stage}", runs[(r.experiment, r.stage)], r.requests, r.iterations,
                               client)
            for r in results if (r.experiment, r.stage) in runs and r.requests is not None]


def format_report(report: RequestRunReport) -> str:
    """The comparison as text: a row per latency and statistic, then the gauges' errors."""
    lines = [f"{report.name}: per request ({len(report.requests)} requests)",
             f"  {'metric':<12} {'stat':<5} {'measured':>10} {'predicted':>10} {'error':>8}"]
    for r in report.statistics.itertuples():
        lines.append(f"  {r.metric:<12} {r.statistic:<5} {r.measured:>10.4f} {r.predicted:>10.4f} {r.error_pct:>7.1f}%")
    if report.over_time_errors is not None:
        lines.append(f"  over time, at the run's ticks ({len(report.over_time)}): mean absolute error / measured mean")
        for g, e in report.over_time_errors.items():
            lines.append(f"  {g:<12} " + ("not logged (0 throughout)" if e is None else
                                          f"{e['relative_mae_pct']:.1f}% (MAE {e['mae']:.3g}, mean {e['measured_mean']:.3g})"))
    return "\n".join(lines)


def report_figure(report: RequestRunReport, path: str | Path, title: str = "") -> Path:
    """Top: the measured and predicted distributions (CDFs) of TTFT, time per output token and E2E;
    bottom (with a timeseries): running, waiting and KV usage over time, measured and predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if report.over_time is not None else 1
    fig, axes = plt.subplots(rows, 3, figsize=(15, 4 * rows), squeeze=False)
    labels = {"ttft": "TTFT (s)", "tpot": "time per output token (s)", "e2e_latency": "E2E latency (s)"}
    for ax, m in zip(axes[0], PER_REQUEST):
        for side, style in (("measured", "-"), ("predicted", "--")):
            x = np.sort(report.requests[f"{m}_{side}"].dropna().to_numpy())
            ax.plot(x, np.arange(1, len(x) + 1) / max(len(x), 1), style, label=side)
        ax.set_xlabel(labels[m])
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    if report.over_time is not None:
        for ax, g in zip(axes[1], OVER_TIME):
            e = report.over_time_errors.get(g)
            ax.plot(report.over_time.t, report.over_time[f"{g}_measured"], "-", label="measured")
            ax.plot(report.over_time.t, report.over_time[f"{g}_predicted"], "--", label="predicted")
            ax.set_xlabel("time since the first arrival (s)")
            ax.set_ylabel(g.replace("_", " "))
            ax.set_title("not logged" if e is None else f"MAE {e['relative_mae_pct']:.1f}% of the measured mean")
            ax.grid(alpha=0.3)
    fig.set_size_inches(15, 4 * rows + 0.6)
    legend_below(fig, *house_legend(fig), title or report.name)  # one legend under the panels, over no data
    return save_figure(fig, path, dpi=110, layout=False)


def add_request_run(out: Report, report: RequestRunReport, folder: str, title: str = "") -> None:
    """The comparison said, and its files added to `out` under `folder`: per_request.csv,
    per_request_stats.csv, over_time.csv (with a timeseries) and request_run.png."""
    names = [f"{folder}/per_request.csv", f"{folder}/per_request_stats.csv"]
    out.table(names[0], report.requests)
    out.table(names[1], report.statistics)
    if report.over_time is not None:
        names.append(f"{folder}/over_time.csv")
        out.table(names[-1], report.over_time)
    names.append(f"{folder}/request_run.png")
    out.figure(names[-1], lambda path: report_figure(report, path, title))
    out.say("", format_report(report))
    out.wrote(*names)
