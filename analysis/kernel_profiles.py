"""vLLM layer-wise kernel profiles in the llmservingsim layout, as operator points to fit.

A GPU's folder (`profiler/perf/<GPU>/`) holds `<org>/<model>/<variant>/tp<N>/` folders, each with
- `dense.csv` (layer, tokens, time_us): one layer's kernels by token count: the GEMMs qkv_proj,
  o_proj, gate_up_proj, down_proj (sharded for tensor parallelism N) and the elementwise kernels
  layernorm (the layer's input RMSNorm, no residual before it), rotary_emb, act_fn (and embedding,
  final_layernorm, qk_norm, which the calibrated model does not price separately: not used);
- `per_sequence.csv` (layer, sequences, time_us): lm_head (a GEMM over the sampled rows), sampler;
- `attention.csv` (prefill_chunk, kv_prefill, n_decode, kv_decode, time_us): one layer's attention;
- `moe.csv` for mixture-of-experts models (not used yet: the expert GEMMs stay those of the dense fit).
The shapes come from the model's config (found by its HF id, as measurement files find theirs),
split over N devices as the profiler split them. Every row becomes a point of the same curves as
Vidur's profiles (analysis/operator_fit.py); attention rows fit the attention efficiencies:

    decode (no prefill):   time = floor + KV bytes read / (bandwidth * attn_mem_eff)
    prefill (no decode, no cached prefix): time = floor + attention FLOPs / (peak * prefill_attn_eff)

(the floors, one kernel launch each, are reported, not kept: the calibrated model prices attention
without one, and the end-to-end fit's per-iteration overhead absorbs them.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from analysis.measurement_formats import resolve_model
from analysis.operator_fit import OperatorPoints, concat_points, fit_elementwise, fit_gemm
from sim.specs import HardwareSpec, ModelSpec, get_model

_DTYPE_BYTES = 2
_COLUMNS = {"dense.csv": ("layer", "tokens", "time_us"), "per_sequence.csv": ("layer", "sequences", "time_us"),
            "attention.csv": ("prefill_chunk", "kv_prefill", "n_decode", "kv_decode", "time_us")}
# the columns that count (tokens, sequences, context lengths): integers, exact in float64 (<= 2**53);
# dense and per-sequence rows profile at least one token or sequence
_COUNTS = {"tokens": 1, "sequences": 1, "prefill_chunk": 0, "kv_prefill": 0, "n_decode": 0, "kv_decode": 0}
_USED = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "layernorm", "rotary_emb", "act_fn"}
_NOT_PRICED = {"embedding", "final_layernorm", "qk_norm"}  # known, priced elsewhere or not at all


@dataclass
class ProfileFolder:
    """One `<org>/<model>/<variant>/tp<N>/` folder: the model it profiled and its TP degree."""

    path: Path
    model_id: str
    tp: int


def is_profile_tree(directory: str | Path) -> bool:
    """A folder holding llmservingsim profiles (a GPU's folder, or one above or below it)."""
    return any(Path(directory).glob("**/tp*/dense.csv"))


def profile_folders(directory: str | Path) -> list[ProfileFolder]:
    """Every tp<N> folder with a dense.csv under `directory`, the model id read from the path
    (<org>/<model>/<variant>/tp<N>)."""
    out = []
    for dense in sorted(Path(directory).glob("**/tp*/dense.csv")):
        folder = dense.parent
        try:
            tp = int(folder.name[2:])
        except ValueError:
            raise ValueError(f"{folder}: expected a folder named tp<N> (N devices)") from None
        parts = folder.parts
        if len(parts) < 4:
            raise ValueError(f"{folder}: expected <org>/<model>/<variant>/tp<N>")
        out.append(ProfileFolder(folder, f"{parts[-4]}/{parts[-3]}", tp))
    return out


def read_csv(path: Path) -> pd.DataFrame:
    """A profile CSV with exactly the columns its name says (`_COLUMNS`); bad rows named by line."""
    try:
        df = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as exc:
        raise ValueError(f"{path}: not a CSV file ({exc})") from None
    want = _COLUMNS[path.name]
    if tuple(df.columns) != want:
        unknown = [c for c in df.columns if c not in want]
        missing = [c for c in want if c not in df.columns]
        raise ValueError(f"{path}: columns {list(df.columns)}: " + "; ".join(
            s for s in (f"unknown {unknown}" if unknown else "", f"missing {missing}" if missing else "") if s)
            + f" (expected {', '.join(want)})")
    for c in want[1:] if want[0] == "layer" else want:
        values = pd.to_numeric(df[c], errors="coerce").to_numpy(np.float64)
        bad = ~np.isfinite(values) | (values < 0)
        expected = "a number >= 0"
        if c in _COUNTS:  # was: 0, 0.5 or 2**63 tokens fitted as they were; 1e308 ended the fit unnamed
            bad |= (values != np.floor(values)) | (values < _COUNTS[c]) | (values > 2.0**53)
            expected = f"an integer >= {_COUNTS[c]}"
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{path}: line {row + 2}: {c}: expected {expected}, got {df[c][row]!r}")
    return df


def dense_points(folder: ProfileFolder, model: ModelSpec) -> OperatorPoints:
    """dense.csv and per_sequence.csv's lm_head as GEMM and elementwise points."""
    h, q, kv, f, tp, d = (model.hidden_size, model.q_size, model.kv_size, model.intermediate_size, folder.tp,
                          _DTYPE_BYTES)
    up = 2 * f if model.arch == "llama" else f
    ops = {  # layer: (kind, weights per device, io width, bytes per token)
        "qkv_proj": ("gemm", h * (q + 2 * kv) / tp, h + (q + 2 * kv) / tp, 0.0),
        "o_proj": ("gemm", q * h / tp, q / tp + h, 0.0),
        "gate_up_proj": ("gemm", h * up / tp, h + up / tp, 0.0),
        "down_proj": ("gemm", f * h / tp, f / tp + h, 0.0),
        "layernorm": ("elementwise", 0.0, 0.0, d * 2 * h),  # the one-layer model's first norm: reads x, writes y
        "rotary_emb": ("elementwise", 0.0, 0.0, d * 2 * (q + kv) / tp),
        "act_fn": ("elementwise", 0.0, 0.0, d * (up + f) / tp),
        "lm_head": ("gemm", model.vocab_size * h / tp, h + model.vocab_size / tp, 0.0),
    }
    dense_path = folder.path / "dense.csv"
    dense = read_csv(dense_path)
    unknown = sorted(set(dense.layer) - _USED - _NOT_PRICED)
    if unknown:
        raise ValueError(f"{dense_path}: layer: unknown {unknown} (known: {', '.join(sorted(_USED | _NOT_PRICED))})")
    rows = dense[dense.layer.isin(_USED)].rename(columns={"tokens": "m"})
    per_seq = folder.path / "per_sequence.csv"
    if per_seq.exists():
        ps = read_csv(per_seq)
        rows = pd.concat([rows, ps[ps.layer == "lm_head"].rename(columns={"sequences": "m"})], ignore_index=True)
    spec = np.array([ops[name] for name in rows.layer], dtype=object)
    t = rows.time_us.to_numpy(np.float64) * 1e-6
    ok = t > 0
    cols = (spec[:, 0].astype(str), rows.m.to_numpy(np.float64), spec[:, 1].astype(float), spec[:, 2].astype(float),
            spec[:, 3].astype(float), t, rows.layer.to_numpy(str))
    return OperatorPoints(*(c[ok] for c in cols))


@dataclass
class AttentionPoints:
    """Attention rows of one folder: decode-only (the KV tokens all sequences read) and prefill-only
    (one chunk of c tokens: c (c + 1) / 2 query-key pairs), with the bytes and FLOPs per token / pair."""

    decode_ctx: np.ndarray
    decode_s: np.ndarray
    prefill_pairs: np.ndarray
    prefill_s: np.ndarray
    kv_bytes_per_token: float
    flops_per_pair: float


def attention_points(folder: ProfileFolder, model: ModelSpec) -> AttentionPoints | None:
    path = folder.path / "attention.csv"
    if not path.exists():  # (a folder of that name is refused by read_csv, not skipped)
        return None
    a = read_csv(path)
    layers = model.num_layers
    kv_bytes = model.kv_bytes_per_token / layers / folder.tp  # one layer, this device's heads
    pair_flops = 4 * model.q_size / folder.tp                 # QK^T and PV: 2 FLOPs per MAC, two GEMMs
    dec = a[(a.prefill_chunk == 0) & (a.n_decode > 0)]
    pre = a[(a.n_decode == 0) & (a.kv_prefill == 0) & (a.prefill_chunk > 0)]
    c = pre.prefill_chunk.to_numpy(np.float64)
    # kv_decode is each decoding sequence's context: n_decode of them are read
    return AttentionPoints((dec.n_decode * dec.kv_decode).to_numpy(np.float64), dec.time_us.to_numpy(np.float64) * 1e-6,
                           c * (c + 1) / 2, pre.time_us.to_numpy(np.float64) * 1e-6, kv_bytes, pair_flops)


def fit_attention(points: list[AttentionPoints], hw: HardwareSpec) -> dict[str, float]:
    """attn_mem_eff and prefill_attn_eff (with each regime's floor, reported) over every folder's rows."""
    out: dict[str, float] = {}
    if not points:  # no folder has an attention.csv: the priors stay (was: numpy's "need at least one array")
        return out
    for name, x_of, t_of, scale in (
            ("attn_mem_eff", lambda p: p.decode_ctx * p.kv_bytes_per_token, lambda p: p.decode_s, hw.mem_bandwidth),
            ("prefill_attn_eff", lambda p: p.prefill_pairs * p.flops_per_pair, lambda p: p.prefill_s, hw.peak_flops)):
        work = np.concatenate([x_of(p) for p in points])
        t = np.concatenate([t_of(p) for p in points])
        if len(t) < 2:
            continue

        def resid(x: np.ndarray, work: np.ndarray = work, t: np.ndarray = t, scale: float = scale) -> np.ndarray:
            return np.log((x[0] * 1e-6 + work / (scale * x[1])) / t)

        r = least_squares(resid, [5.0, 0.5], bounds=([0.0, 0.01], [1000.0, 1.0]), loss="soft_l1", f_scale=0.1)
        err = np.abs(np.expm1(resid(r.x)))
        out.update({name: float(r.x[1]), f"{name}_floor_s": float(r.x[0] * 1e-6),
                    f"{name}_median_abs_error": float(np.median(err)), f"{name}_points": len(t)})
    return out


def profile_inputs(directory: str | Path, models_dirs: Any = None) -> tuple[OperatorPoints, list[AttentionPoints],
                                                                               list[str], dict[str, str]]:
    """(GEMM and elementwise points, attention points, files used, folders skipped with why) of
    every profile folder under `directory` whose model's config can be found."""
    points, attention, files, skipped = [], [], [], {}
    folders = profile_folders(directory)
    if not folders:  # was: "no profile folder whose model can be read ()", naming no file it looked for
        raise ValueError(f"{directory}: no kernel profiles: expected <org>/<model>/<variant>/tp<N>/dense.csv under it")
    for folder in folders:
        try:
            model = get_model(resolve_model(folder.model_id, models_dirs))
        except ValueError:  # (the catalogue's message names absolute paths: not kept in a shipped file)
            skipped[str(folder.path)] = f"no config.json for model {folder.model_id} (catalogue, models dirs)"
            continue
        points.append(dense_points(folder, model))
        files += [str(p) for p in (folder.path / "dense.csv", folder.path / "per_sequence.csv") if p.is_file()]
        att = attention_points(folder, model)
        if att is not None:
            attention.append(att)
            files.append(str(folder.path / "attention.csv"))
    if not points:
        raise ValueError(f"{directory}: no profile folder whose model can be read ({'; '.join(skipped.values())})")
    return concat_points(points), attention, files, skipped


def fit_profiles(directory: str | Path, hw: HardwareSpec, models_dirs: Any = None) -> tuple[dict[str, float], dict]:
    """(parameters, report) from the profiles under `directory`: the GEMM and elementwise curves
    (analysis/operator_fit.py) and the attention efficiencies. No all-reduce is profiled there: the
    all-reduce terms stay the priors (or the end-to-end fit's)."""
    pts, attention, files, skipped = profile_inputs(directory, models_dirs)
    try:
        report = {**fit_gemm(pts, hw), **fit_elementwise(pts, hw), **fit_attention(attention, hw)}
    except ValueError as exc:  # times the curves cannot take (1e308 us): was scipy's message, naming no file
        raise ValueError(f"{directory}: the kernel times do not fit: {exc}") from None
    # the attention floors are reported, not parameters (module docstring)
    params = {k: v for k, v in report.items() if not k.endswith(("_error", "_points", "_eff_floor_s"))}
    report["files"] = files
    if skipped:
        report["skipped"] = skipped
    return params, report
