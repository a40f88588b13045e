"""guidellm result files (`guidellm run --output kind=json`) as measured experiments.

guidellm load-tests any OpenAI-compatible server (`pagesim serve`, vLLM, ...) and records every
request: when it was sent, its prompt and output token counts, its time to first token and its
latency. Each benchmark of the file (one load level: concurrent streams, a constant or Poisson
rate, a sweep point) becomes one `Experiment` with one `Stage` whose requests replay at the times
they were sent, so `pagesim fidelity` / `pagesim calibrate` simulate exactly the arrivals the
server saw (a closed-loop run's arrivals depend on the server's speed: replaying them open-loop is
right for the server measured, an approximation for another).

`is_guidellm(obj)` tells such a file from the other formats of analysis/measurement_formats.py.
Malformed input raises ValueError "<file>: <field path>: <what is wrong>".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

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
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not is_guidellm(obj):
        raise ValueError(f"{path}: not a guidellm report (expected \"benchmarks\" of type generative_benchmark)")
    f = Fields(obj, path)
    model_id = model or f.sub("config").sub("spec").sub("backend").str("model")
    try:
        resolved = resolve_model(model_id, models_dirs)
    except ValueError as exc:
        raise ValueError(f"{path}: config.spec.backend.model: {exc}") from None
    return [_experiment(Fields(b, path, f"benchmarks[{i}]"), i, model_id, resolved, path)
            for i, b in enumerate(obj["benchmarks"])]


def _experiment(b: Fields, i: int, model_id: str, model: str, path: Path) -> Experiment:
    reqs = b.sub("requests")
    ok = reqs.items("successful")
    failed = sum(len(reqs.raw(k, [])) for k in ("errored", "incomplete"))
    sent = np.array([r.num("request_start_time") for r in ok])
    order = np.argsort(sent, kind="stable")
    prompt = np.array([r.int("prompt_tokens", minimum=1) for r in ok], np.int64)[order]
    out = np.array([r.int("output_tokens", minimum=1) for r in ok], np.int64)[order]
    ttft = np.array([r.num("time_to_first_token_ms") / 1e3 for r in ok])
    e2e = np.array([r.num("request_latency") for r in ok])
    arrival = sent[order] - sent[order][0]
    span = float(arrival[-1]) if len(arrival) > 1 else 0.0
    duration = b.num("duration", span, strict=True) if b.has("duration") else max(span, 1e-9)
    strategy = str((b.raw("config", {}).get("strategy") or {}).get("type_", "unknown"))
    stage = Stage(index=0, rate=(len(ok) - 1) / span if span > 0 else float(len(ok)), duration_s=span,
                  load_type="recorded", ttft=_latency(ttft), e2e=_latency(e2e), output_len=float(out.mean()),
                  prompt_len_mean=float(prompt.mean()), throughput_rps=len(ok) / duration, successes=len(ok),
                  failures=failed,
                  requests=Trace(arrival=arrival, prompt_len=prompt, output_len=out, name=f"guidellm-{strategy}",
                                 source=str(path), has_timestamps=True))
    return Experiment(name=f"{path.stem}#{i}" if i else path.stem, model_id=model_id, model=model, tp=1,
                      stages=(stage,), workload_name=f"guidellm {strategy}", source=str(path))


def _latency(v: np.ndarray) -> Latency:
    p90, p99 = np.percentile(v, [90, 99])
    return Latency(float(v.mean()), float(p90), float(p99))
