"""Readers of measured serving runs, each into `analysis.measurements.Experiment`s:

- the vllm-h100 `measurements.json` (../shared/calibration/vllm-h100/README.md): experiments, each
  with a shared_prefix workload and stages of constant load, client-measured latencies;
- a `vllm bench serve --save-result` JSON file (one object, or several appended; vLLM 0.8's
  benchmark_serving.py too): one stage at request_rate (burstiness 1 Poisson, inf constant, else
  Gamma), engine settings from its --metadata keys where given (tensor_parallel_size,
  max_num_seqs, max_num_batched_tokens, ...), a sidecar file or options (analysis/bench_settings.py);
  with --save-detailed its input_lens/output_lens are replayed;
- a pagesim run folder (`requests.csv` + `summary.json` of `pagesim simulate` or `pagesim live`):
  one stage replaying the recorded requests at their recorded arrivals;
- a per-request benchmark run folder (`meta.json` + `requests.jsonl` + `timeseries.csv`, the
  llmservingsim layout): analysis/request_runs.py.

Every malformed input raises ValueError "<file>: <field path>: <what is wrong>".
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.bench_settings import check_settings, e2e_from_requests
from analysis.measurements import LOAD_TYPES, Experiment, Latency, SharedPrefix, Stage
from policies.limits import REQUEST_BYTES, check_fits
from specs import get_hardware, load_model, resolve_model_name
from traces import SYNTHETIC, load_trace, make_synthetic
from traces.trace import MAX_ARRIVAL, Trace

_MISSING = object()


class Fields:
    """One JSON object of a file; every error names the file and the field's path."""

    def __init__(self, obj: Any, file: Path | str, path: str = "", origins: dict[str, str] | None = None) -> None:
        self.file, self.path = str(file), path
        self.origins = origins or {}  # top-level keys that came from elsewhere (a sidecar file): where from
        if not isinstance(obj, dict):
            raise self.error("", f"expected an object, got {type(obj).__name__}")
        self.obj = obj

    def error(self, key: str, why: str) -> ValueError:
        where = ".".join(p for p in (self.path, key) if p) or "(top level)"
        return ValueError(f"{self.origins.get(key, self.file)}: {where}: {why}")

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        v = self.obj.get(key)
        if v is None:
            if default is _MISSING:
                raise self.error(key, "missing")
            return default
        return v

    def num(self, key: str, default: Any = _MISSING, minimum: float = 0.0, strict: bool = False) -> Any:
        """A finite number >= minimum (> minimum when strict); `default` when absent."""
        v = self.raw(key, default)
        if v is default and default is not _MISSING:
            return v
        if isinstance(v, str):
            v = _number(v)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or v < minimum or (strict and v == minimum):
            raise self.error(key, f"expected a number {'>' if strict else '>='} {minimum:g}, got {v!r}")
        return float(v)

    def seconds(self, key: str, default: Any = _MISSING, unit_s: float = 1.0, strict: bool = False) -> Any:
        """A time (a latency, a duration) in units of `unit_s` seconds, as given: finite, >= 0 (> 0
        when strict) and within MAX_ARRIVAL (2**32 s), beyond which float64 no longer resolves a
        millisecond (1e308 ms broke the figures' axes: was an OverflowError traceback)."""
        v = self.num(key, default, strict=strict)
        if v is default and default is not _MISSING:
            return v
        if v * unit_s > MAX_ARRIVAL:
            raise self.error(key, f"{v:g} is beyond 2**32 s (about 136 years)")
        return v

    def int(self, key: str, default: Any = _MISSING, minimum: int = 0) -> Any:
        v = self.num(key, default, minimum)
        if v is default and default is not _MISSING:
            return v
        if v != int(v):
            raise self.error(key, f"expected an integer >= {minimum}, got {v!r}")
        return int(v)

    def bool(self, key: str, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0"):
            return v.strip().lower() in ("true", "1")
        if not isinstance(v, bool):
            raise self.error(key, f"expected true or false, got {v!r}")
        return v

    def str(self, key: str, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if not isinstance(v, str) or not v.strip():
            raise self.error(key, f"expected a non-empty string, got {v!r}")
        return v

    def sub(self, key: str) -> Fields:
        return Fields(self.raw(key), self.file, self._join(key))

    def items(self, key: str) -> list[Fields]:
        v = self.raw(key)
        if not isinstance(v, list) or not v:
            raise self.error(key, "expected a non-empty list")
        return [Fields(x, self.file, f"{self._join(key)}[{i}]") for i, x in enumerate(v)]

    def _join(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key


def _number(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def json_objects(path: Path) -> list[Any]:
    """The JSON values in the file: one, or several written one after another (--append-result)."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # past a byte-order mark (was: "Expecting value")
    except (OSError, UnicodeDecodeError) as exc:  # binary or unreadable: name the file
        raise ValueError(f"{path}: cannot read: {exc}") from None
    decoder, pos, out = json.JSONDecoder(), 0, []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        out.append(value)
    if not out:
        raise ValueError(f"{path}: empty file")
    return out


def read_settings(path: Path) -> dict[str, Any]:
    """A server settings file (analysis/bench_settings.py): one JSON object of vLLM argument names."""
    objects = json_objects(path)
    return check_settings(objects[0] if len(objects) == 1 else objects, path)


def default_models_dirs() -> list[Path]:
    """Where HF model ids are looked up when no --models-dir is given: ../shared/models beside the
    repository and beside the working directory, those that exist."""
    here = Path(__file__).resolve().parents[1]
    dirs = [here.parent / "shared" / "models", Path.cwd().parent / "shared" / "models"]
    return list(dict.fromkeys(d.resolve() for d in dirs if d.is_dir()))


def resolve_model(model_id: str, models_dirs: Sequence[str | Path] | None = None) -> str:
    """What SimConfig.model takes for a measured model id: the path of its config.json (a path, or a
    HF id found in `models_dirs`, default `default_models_dirs()`), or a catalogue name. Raises
    ValueError saying what was tried otherwise."""
    dirs = default_models_dirs() if models_dirs is None else [Path(d) for d in models_dirs]
    return resolve_model_name(model_id, dirs)  # raises for an unknown model, or a config it cannot read


def model_field(f: Fields, key: str, models_dirs: Sequence[str | Path] | None) -> tuple[str, str]:
    model_id = f.str(key)
    try:
        return model_id, resolve_model(model_id, models_dirs)
    except ValueError as exc:
        raise f.error(key, str(exc)) from None


def tp_field(f: Fields, key: str, model: str) -> int:
    """The measured tensor parallelism, which must split the model's heads (refused here naming the
    file's field, not later as if the user had passed --tp)."""
    tp = f.int(key, 1, minimum=1)
    spec = load_model(model)
    if math.gcd(spec.num_heads, spec.num_kv_heads) % tp:
        raise f.error(key, f"{tp} does not divide {spec.name}'s {spec.num_heads} attention heads and "
                           f"{spec.num_kv_heads} KV heads evenly")
    return tp


# --- vllm-h100 measurements.json ------------------------------------------------------------------

def source_hardware(source: Any) -> str | None:
    """The hardware spec the file's free-text `source.hardware` names ("NVIDIA H100 80GB HBM3 (SXM),
    one node; ..."), from its leading words; None when it names none."""
    text = source.get("hardware") if isinstance(source, dict) else None
    if not isinstance(text, str):
        return None
    try:
        return get_hardware(text.split("(")[0].split(",")[0]).name
    except ValueError:
        return None


def vllm_h100_experiment(e: Fields, models_dirs: Sequence[str | Path] | None, hardware: str | None) -> Experiment:
    model_id, model = model_field(e, "model_id", models_dirs)
    sp = e.sub("shared_prefix")
    workload = SharedPrefix(sp.int("num_groups", minimum=1), sp.int("num_prompts_per_group", minimum=1),
                            sp.int("system_prompt_len"), sp.int("question_len"), sp.int("output_len", minimum=1))
    load = e.str("load_type", "constant")
    if load not in LOAD_TYPES:
        raise e.error("load_type", f"{load!r}; known: {', '.join(LOAD_TYPES)}")
    if not e.bool("ignore_eos", True):
        raise e.error("ignore_eos", "false: outputs of unknown length cannot be replayed")
    stages = tuple(_vllm_h100_stage(s, load, workload.output_len) for s in e.items("stages"))
    return Experiment(
        name=e.str("name"), model_id=model_id, model=model, tp=tp_field(e, "tp", model), stages=stages,
        workload=workload, workload_name=e.str("workload", "shared_prefix"),
        max_model_len=e.int("max_model_len", None, minimum=1),
        max_num_batched_tokens=e.int("max_num_batched_tokens", None, minimum=1),
        max_num_seqs=e.int("max_num_seqs", None, minimum=1), block_size=e.int("block_size", 16, minimum=1),
        prefix_caching=e.bool("enable_prefix_caching", True), chunked_prefill=e.bool("enable_chunked_prefill", True),
        gpu_memory_utilization=e.num("gpu_memory_utilization", 0.9, strict=True),
        hardware=hardware_field(e, "hardware") or hardware,
        overloaded_by_source=e.bool("overload_excluded_by_source", False), source=e.file)


def _vllm_h100_stage(s: Fields, load: str, output_len: int) -> Stage:
    ttft, e2e = s.sub("ttft_s"), s.sub("e2e_s")
    prompt = s.sub("prompt_len") if s.has("prompt_len") else None
    thr = s.sub("throughput") if s.has("throughput") else None
    rate, duration = s.num("rate", minimum=0, strict=True), s.seconds("duration_s", strict=True)
    _check_stage_size(s, rate, duration)
    return Stage(
        index=s.int("index", 0), rate=rate, duration_s=duration, load_type=load,
        ttft=_latency(ttft), e2e=_latency(e2e), output_len=output_len,
        prompt_len_mean=prompt.num("mean", minimum=1) if prompt else None,
        throughput_rps=thr.num("requests_per_sec") if thr else None,
        successes=s.int("successes", 0), failures=s.int("failures", 0))


def _check_stage_size(s: Fields, rate: float, duration_s: float) -> None:
    """Refuse a stage whose requests (rate over duration_s) the simulator could not hold (was: a
    rate of 2**63 req/s built 10**21 requests until the memory ran out)."""
    n = rate * duration_s
    check_fits(f"{s.file}: {s._join('rate')}: {rate:g} req/s over {duration_s:g} s is {n:.3g} requests",
               [(int(min(n, 2.0**63)), REQUEST_BYTES)])


def _latency(f: Fields, scale: float = 1.0) -> Latency:
    return Latency(f.seconds("mean") * scale, _opt(f.seconds("p90", None)), _opt(f.seconds("p99", None)))


def _opt(v: float | None, scale: float = 1.0) -> float | None:
    return None if v is None else v * scale


# --- vllm bench serve --save-result ---------------------------------------------------------------

def vllm_bench(f: Fields, name: str, models_dirs: Sequence[str | Path] | None) -> Experiment:
    model_id, model = model_field(f, "model_id", models_dirs)
    rate = f.raw("request_rate")
    if rate == "inf" or rate == math.inf:
        raise f.error("request_rate", "'inf' (every request at once) is not supported: give a finite rate")
    rate = f.num("request_rate", minimum=0, strict=True)
    if f.has("max_concurrency"):
        raise f.error("max_concurrency", "a client-side concurrency limit (closed loop) is not supported; pagesim "
                                         "replays open-loop arrivals")
    n = f.int("num_prompts", minimum=1)
    completed = f.int("completed")
    if completed < 1:
        raise f.error("completed", "no request completed: nothing was measured")
    load, cv = _bench_load(f)
    total_out = f.num(_first(f, "total_output_tokens", "total_output"))
    stage = Stage(
        index=0, rate=rate, duration_s=n / rate, load_type=load, burstiness=cv,
        ttft=Latency(f.seconds("mean_ttft_ms", unit_s=1e-3) / 1e3, _opt(f.seconds("p90_ttft_ms", None, 1e-3), 1e-3),
                     _opt(f.seconds("p99_ttft_ms", None, 1e-3), 1e-3)),
        e2e=_bench_e2e(f),
        output_len=total_out / completed,
        prompt_len_mean=f.num(_first(f, "total_input_tokens", "total_input")) / completed,
        throughput_rps=f.num("request_throughput", None), successes=completed,
        failures=f.int("failed", n - completed), requests=_bench_requests(f, n, completed, total_out))
    return Experiment(
        name=name, model_id=model_id, model=model, tp=tp_field(f, _first(f, "tensor_parallel_size", "tp"), model),
        stages=(stage,), workload_name=str(f.raw("dataset_name", "vllm-bench")),
        max_model_len=f.int("max_model_len", None, minimum=1),
        max_num_batched_tokens=f.int("max_num_batched_tokens", None, minimum=1),
        max_num_seqs=f.int("max_num_seqs", None, minimum=1), block_size=f.int("block_size", 16, minimum=1),
        prefix_caching=f.bool("enable_prefix_caching", True),
        gpu_memory_utilization=f.num("gpu_memory_utilization", 0.9, strict=True),
        hardware=hardware_field(f, "hardware"), source=f.file)


def _bench_e2e(f: Fields) -> Latency:
    """The E2E summary, or (older files: vLLM 0.8's benchmark_serving.py has no *_e2el_ms) one
    derived from the per-request ttfts and itls."""
    if f.has("mean_e2el_ms") or not (f.has("ttfts") and f.has("itls")):
        if not f.has("mean_e2el_ms"):
            raise f.error("mean_e2el_ms", "missing, and no per-request ttfts and itls to derive it from")
        return Latency(f.seconds("mean_e2el_ms", unit_s=1e-3) / 1e3, _opt(f.seconds("p90_e2el_ms", None, 1e-3), 1e-3),
                       _opt(f.seconds("p99_e2el_ms", None, 1e-3), 1e-3))
    where = f"{f.file}" + (f": {f.path}" if f.path else "")
    mean, p90, p99 = e2e_from_requests(f.raw("ttfts"), f.raw("itls"), where)
    return Latency(mean / 1e3, p90 / 1e3, p99 / 1e3)


def hardware_field(f: Fields, key: str) -> str | None:
    if not f.has(key):
        return None
    name = f.str(key)
    try:
        get_hardware(name)  # a shipped spec's name, or a hardware JSON file
    except ValueError as exc:
        raise f.error(key, str(exc)) from None
    return name


def _first(f: Fields, *keys: str, default: str | None = None) -> str:
    """The first of `keys` the object has (the field name differs between vLLM versions)."""
    for k in keys:
        if f.has(k):
            return k
    return default or keys[0]


def _bench_load(f: Fields) -> tuple[str, float | None]:
    """vLLM's burstiness is the Gamma shape k (CV 1/sqrt(k)): 1 Poisson, inf constant."""
    b = f.raw("burstiness", 1.0)
    if b == "inf" or b == math.inf:
        return "constant", None
    b = f.num("burstiness", 1.0, minimum=0, strict=True)
    return ("poisson", None) if b == 1 else ("gamma", 1 / math.sqrt(b))


def _bench_requests(f: Fields, n: int, completed: int, total_out: float) -> Trace:
    """The stage's requests: --save-detailed's input_lens and output_lens when present (a failed
    request's 0 output becomes the median of the completed ones), else n requests of the mean
    lengths."""
    if f.has("input_lens") and f.has("output_lens"):
        prompt, out = _int_list(f, "input_lens", n), _int_list(f, "output_lens", n)
        done = out[out > 0]
        out = np.where(out > 0, out, int(np.median(done)) if len(done) else 1)
        if prompt.min() < 1:
            raise f.error("input_lens", "prompt lengths must be >= 1")
    else:
        total_in = f.num(_first(f, "total_input_tokens", "total_input"))
        prompt = np.full(n, max(1, round(total_in / completed)), np.int64)
        out = np.full(n, max(1, round(total_out / completed)), np.int64)
    return Trace(arrival=np.zeros(n), prompt_len=prompt, output_len=out, name="vllm-bench", source=f.file,
                 has_timestamps=False)


def _int_list(f: Fields, key: str, n: int) -> np.ndarray:
    v = f.raw(key)
    if not isinstance(v, list) or len(v) != n or not all(isinstance(x, int) and x >= 0 for x in v):
        raise f.error(key, f"expected {n} integers >= 0 (one per prompt)")
    return np.asarray(v, np.int64)


# --- pagesim run folder ---------------------------------------------------------------------------

def pagesim_run(folder: Path, models_dirs: Sequence[str | Path] | None) -> Experiment:
    summary_path, requests_path = folder / "summary.json", folder / "requests.csv"
    for p in (summary_path, requests_path):
        if not p.is_file():
            raise ValueError(f"{p}: missing (a pagesim run folder holds requests.csv and summary.json)")
    objects = json_objects(summary_path)
    s = Fields(objects[0], summary_path)
    cfg = s.sub("config")
    frame = _requests_frame(requests_path)
    model_id, model = model_field(cfg, "model", models_dirs)
    done = frame[frame.status == "finished"]
    if not len(done):
        raise ValueError(f"{requests_path}: no finished request: nothing was measured")
    spec = cfg.raw("trace", None) or s.raw("trace", None)  # live runs record the spec, simulate the name
    trace = Trace(arrival=frame.arrival.to_numpy(np.float64), prompt_len=frame.prompt_len.to_numpy(),
                  output_len=frame.output_len.to_numpy(), name=str(spec or "run"), source=str(folder))
    trace = _with_recorded_hashes(trace, spec, cfg.int("seed", 0))
    span = float(trace.arrival[-1] - trace.arrival[0])
    rate = cfg.num("rate", None, strict=True) or ((len(trace) - 1) / span if span > 0 else 1.0)
    stage = Stage(index=0, rate=rate, duration_s=span, load_type="recorded", ttft=_frame_latency(done.ttft),
                  e2e=_frame_latency(done.e2e_latency), output_len=float(done.output_len.mean()),
                  prompt_len_mean=float(done.prompt_len.mean()),
                  throughput_rps=s.num("request_throughput", None), successes=len(done),
                  failures=len(frame) - len(done), requests=trace)
    gpu_blocks = s.int("num_gpu_blocks", None, minimum=1) or cfg.int("num_gpu_blocks", None, minimum=1)
    return Experiment(
        # tp checked against the model's heads, as the other formats' (was: 1e308 passed, and fidelity
        # ended "no experiment can be simulated" naming no file)
        name=folder.name, model_id=model_id, model=model, tp=tp_field(cfg, "tp", model), stages=(stage,),
        workload_name=trace.name, max_num_batched_tokens=cfg.int("max_num_batched_tokens", None, minimum=1),
        max_num_seqs=cfg.int("max_num_seqs", None, minimum=1), block_size=cfg.int("block_size", 16, minimum=1),
        prefix_caching=cfg.bool("prefix_caching", False), chunked_prefill=cfg.bool("chunked_prefill", False),
        gpu_memory_utilization=cfg.num("gpu_memory_utilization", 0.9, strict=True), num_gpu_blocks=gpu_blocks,
        policy=cfg.str("policy", "vllm"), preemption=cfg.str("preemption", "recompute"),
        hardware=hardware_field(cfg, "hardware"), source=str(folder))


_RUN_COLUMNS = ("arrival", "prompt_len", "output_len", "ttft", "e2e_latency", "status")


def read_csv_columns(path: Path, columns: Sequence[str], hint: str) -> pd.DataFrame:
    """A CSV file holding (at least) `columns`; else ValueError naming the file, the missing
    columns and `hint`."""
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a CSV file ({exc})") from None
    except OSError as exc:  # a folder, unreadable
        raise ValueError(f"{path}: cannot read: {exc}") from None
    missing = [c for c in columns if c not in frame]
    if missing:
        raise ValueError(f"{path}: missing columns {', '.join(missing)} ({hint})")
    return frame


def _requests_frame(path: Path) -> pd.DataFrame:
    """requests.csv sorted by arrival; arrival a time in [0, 2**32 s], lengths integers >= 1 within
    int64, or ValueError naming the file, row and column (was: numpy's "could not convert string to
    float: 'abc'", or the Trace's "prompt_len[0] = -1", naming no file)."""
    frame = read_csv_columns(path, _RUN_COLUMNS, "a pagesim requests table has them")
    for c in ("arrival", "prompt_len", "output_len"):
        values = pd.to_numeric(frame[c], errors="coerce").to_numpy(np.float64)
        bad = ~np.isfinite(values)
        if c == "arrival":
            bad |= (values < 0) | (values > MAX_ARRIVAL)
        else:
            bad |= (values < 1) | (values >= 2.0**63) | (values != np.floor(values))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            want = "a time in [0, 2**32] s" if c == "arrival" else "an integer >= 1"
            raise ValueError(f"{path}: row {row + 2}: {c}: expected {want}, got {frame[c][row]!r}")
        frame[c] = values if c == "arrival" else values.astype(np.int64)
    return frame.sort_values("arrival", kind="stable", ignore_index=True)


def _frame_latency(x: pd.Series) -> Latency:
    v = x.to_numpy(np.float64)
    p90, p99 = np.percentile(v, [90, 99])
    return Latency(float(v.mean()), float(p90), float(p99))


def _with_recorded_hashes(trace: Trace, spec: Any, seed: int) -> Trace:
    """requests.csv does not hold prefix hashes; the run's workload (a synthetic kind, or a trace
    file that still exists) is generated again and, when its lengths equal the recorded ones, lends
    its hashes, so that prefix caching sees the same sharing. Otherwise the trace has none."""
    if not isinstance(spec, str):
        return trace
    try:
        if spec in SYNTHETIC:
            again = make_synthetic(spec, len(trace), seed=seed)
        elif Path(spec).is_file():
            again = load_trace(spec).head(len(trace))
        else:
            return trace
    except (ValueError, OSError):
        return trace
    if again.prefix_hashes is None or len(again) != len(trace) or not (
            np.array_equal(again.prompt_len, trace.prompt_len) and np.array_equal(again.output_len, trace.output_len)):
        return trace
    return Trace(arrival=trace.arrival, prompt_len=trace.prompt_len, output_len=trace.output_len,
                 prefix_hashes=again.prefix_hashes, hash_block_size=again.hash_block_size, name=trace.name,
                 source=trace.source)
