"""guidellm result files (`guidellm run --output kind=json`) as measured experiments.

guidellm load-tests any OpenAI-compatible server (`pagesim serve`, vLLM, ...) and records every
request: when it was sent, its prompt and output token counts, its time to first token and its
latency. Each benchmark of the file (one load level: concurrent streams, a constant or Poisson
rate, a sweep point) becomes one `Experiment` with one `Stage` whose requests replay at the times
they were sent, so `pagesim fidelity` / `pagesim calibrate` simulate exactly the arrivals the
server saw (a closed-loop run's arrivals depend on the server's speed: replaying them open-loop is
right for the server measured, an approximation for another).

`is_guidellm(obj)` tells such a file from the other formats of analysis/measurement_formats.py;
`guidellm_requests` gives one benchmark as a trace and a requests table, for `pagesim validate
--live-run FILE` (the client's latencies against a simulation of the same arrivals).
Malformed input raises ValueError "<file>: <field path>: <what is wrong>".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.measurement_formats import Fields, resolve_model
from analysis.measurements import Experiment, Latency, Stage
from traces.trace import Trace


def is_guidellm(obj: Any) -> bool:
    """A guidellm report: {"benchmarks": [{"type_": "generative_benchmark", ...}, ...], ...}."""
    return isinstance(obj, dict) and isinstance(obj.get("benchmarks"), list) and bool(obj["benchmarks"]) and all(
        isinstance(b, dict) and b.get("type_") == "generative_benchmark" for b in obj["benchmarks"])


def load_guidellm(path: str | Path, models_dirs: Sequence[str | Path] | None = None,
                  model: str | None = None) -> list[Experiment]:
    """One experiment per benchmark in the file. The model comes from the run's backend config
    (the name the server was asked for) unless `model` is given; it must resolve to a model spec."""
    f = _report(path)
    model_id = model or f.sub("config").sub("spec").sub("backend").str("model")
    try:
        resolved = resolve_model(model_id, models_dirs)
    except ValueError as exc:
        raise ValueError(f"{f.file}: config.spec.backend.model: {exc}") from None
    return [_experiment(b, i, model_id, resolved, Path(path)) for i, b in enumerate(f.items("benchmarks"))]


def _report(path: str | Path) -> Fields:
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not is_guidellm(obj):
        raise ValueError(f"{path}: not a guidellm report (expected \"benchmarks\" of type generative_benchmark)")
    return Fields(obj, path)


def _experiment(b: Fields, i: int, model_id: str, model: str, path: Path) -> Experiment:
    stage, strategy = _stage(b, path)
    return Experiment(name=f"{path.stem}#{i}" if i else path.stem, model_id=model_id, model=model, tp=1,
                      stages=(stage,), workload_name=f"guidellm {strategy}", source=str(path))


def _successful(b: Fields) -> tuple[list[Fields], np.ndarray]:
    """The benchmark's successful requests, in the order they were sent."""
    ok = b.sub("requests").items("successful")
    sent = np.array([r.num("request_start_time") for r in ok])
    order = np.argsort(sent, kind="stable")
    return [ok[i] for i in order], sent[order]


def _stage(b: Fields, path: Path) -> tuple[Stage, str]:
    reqs = b.sub("requests")
    ok, sent = _successful(b)
    failed = sum(len(reqs.raw(k, [])) for k in ("errored", "incomplete"))
    prompt = np.array([r.int("prompt_tokens", minimum=1) for r in ok], np.int64)
    out = np.array([r.int("output_tokens", minimum=1) for r in ok], np.int64)
    ttft = np.array([r.num("time_to_first_token_ms") / 1e3 for r in ok])
    e2e = np.array([r.num("request_latency") for r in ok])
    arrival = sent - sent[0]
    span = float(arrival[-1]) if len(arrival) > 1 else 0.0
    duration = b.num("duration", span, strict=True) if b.has("duration") else max(span, 1e-9)
    strategy = str((b.raw("config", {}).get("strategy") or {}).get("type_", "unknown"))
    stage = Stage(index=0, rate=(len(ok) - 1) / span if span > 0 else float(len(ok)), duration_s=span,
                  load_type="recorded", ttft=_latency(ttft), e2e=_latency(e2e), output_len=float(out.mean()),
                  prompt_len_mean=float(prompt.mean()), throughput_rps=len(ok) / duration, successes=len(ok),
                  failures=failed,
                  requests=Trace(arrival=arrival, prompt_len=prompt, output_len=out, name=f"guidellm-{strategy}",
                                 source=str(path), has_timestamps=True))
    return stage, strategy


def _latency(v: np.ndarray) -> Latency:
    p90, p99 = np.percentile(v, [90, 99])
    return Latency(float(v.mean()), float(p90), float(p99))


def guidellm_requests(path: str | Path, benchmark: int = 0) -> tuple[Trace, pd.DataFrame]:
    """One benchmark of a guidellm file as (trace, requests table): the trace holds its successful
    requests in the order they were sent (ids 0, 1, ... as the simulator numbers a trace's rows),
    at their send times; the table has request_frame's latency columns, measured by the client."""
    benchmarks = _report(path).items("benchmarks")
    if not 0 <= benchmark < len(benchmarks):
        raise ValueError(f"{path}: benchmarks[{benchmark}]: no such benchmark (the file has {len(benchmarks)})")
    b = benchmarks[benchmark]
    stage, _ = _stage(b, Path(path))
    ok, _ = _successful(b)
    trace = stage.requests
    ttft = np.array([r.num("time_to_first_token_ms") / 1e3 for r in ok])
    e2e = np.array([r.num("request_latency") for r in ok])
    out = trace.output_len.astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(out > 1, (e2e - ttft) / (out - 1), np.nan)
    frame = pd.DataFrame({
        "request_id": np.arange(len(trace)), "arrival": trace.arrival, "prompt_len": trace.prompt_len,
        "output_len": out, "first_token_time": trace.arrival + ttft, "finish_time": trace.arrival + e2e,
        "ttft": ttft, "tpot": tpot, "e2e_latency": e2e, "normalized_latency": e2e / out, "status": "finished",
        "reject_reason": ""})
    return trace, frame
