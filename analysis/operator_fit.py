"""Fit the shape-generic operator terms of a `CalibrationParams` to per-operator kernel times.

Input: Vidur's profiling CSVs (`<gpu>_<model>_mlp.csv`: the median time in ms of each non-attention
operator of one layer at a number of tokens, with the model's shape and tensor-parallel degree;
`<gpu>_dgx_all_reduce.csv`: all-reduce time by message size in bytes and number of GPUs). Every row,
whatever its model or TP degree, is one point of the same curves (sim/calibrated.py):

    GEMM (P weights per device, io = input + output width, M tokens): latency +
        max(2 P (M + m_half) / (peak * gemm_eff_max), (P + M io) * 2 B / (bandwidth * weight_mem_eff))
    elementwise kernel (b bytes per token):  floor + M b / (bandwidth * elementwise_mem_eff)
    all-reduce of S bytes over n GPUs:        latency + S * 2 (n - 1) / n / (interconnect * bus_eff)

fitted by least squares on log(predicted / measured) with a soft-L1 loss (a few noisy kernels do not
pull the curves), so each row weighs by its relative error. The GEMMs' memory efficiency comes from
their memory-bound rows alone (few tokens: see `fit_gemm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from sim.specs import HardwareSpec

_DTYPE_BYTES = 2  # the profiles are fp16/bf16
_GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
_ELEMENTWISE = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")
_SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp", "num_tokens",
                  "num_tensor_parallel_workers")


@dataclass
class OperatorPoints:
    """Operator measurements as arrays: kind ("gemm"/"elementwise"), tokens M, weights P per device,
    io width, bytes per token, measured seconds, and a label (operator name)."""

    kind: np.ndarray
    tokens: np.ndarray
    params: np.ndarray
    io: np.ndarray
    bytes_per_token: np.ndarray
    time_s: np.ndarray
    label: np.ndarray


def read_operator_csv(path: str | Path) -> OperatorPoints:
    """The GEMM and elementwise rows of one Vidur mlp.csv; errors name the file and the column."""
    path = Path(path)
    df = pd.read_csv(path)
    need = [*_SHAPE_COLUMNS, *(f"time_stats.{op}.median" for op in _GEMMS + _ELEMENTWISE)]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
    h = df.n_embd.to_numpy(float)
    hd = h / df.n_head.to_numpy(float)
    q, kv = h, df.n_kv_head.to_numpy(float) * hd
    f = df.n_expanded_embd.to_numpy(float)
    tp = df.num_tensor_parallel_workers.to_numpy(float)
    up = np.where(df.use_gated_mlp.astype(bool).to_numpy(), 2 * f, f)
    d = _DTYPE_BYTES
    ops = {  # name: (kind, weights per device, io width, bytes per token)
        "attn_pre_proj": ("gemm", h * (q + 2 * kv) / tp, h + (q + 2 * kv) / tp, 0 * h),
        "attn_post_proj": ("gemm", q * h / tp, q / tp + h, 0 * h),
        "mlp_up_proj": ("gemm", h * up / tp, h + up / tp, 0 * h),
        "mlp_down_proj": ("gemm", f * h / tp, f / tp + h, 0 * h),
        "input_layernorm": ("elementwise", 0 * h, 0 * h, d * 2 * h),
        "post_attention_layernorm": ("elementwise", 0 * h, 0 * h, d * 2 * h),
        "attn_rope": ("elementwise", 0 * h, 0 * h, d * 2 * (q + kv) / tp),
        "mlp_act": ("elementwise", 0 * h, 0 * h, d * (up + f) / tp),
        "add": ("elementwise", 0 * h, 0 * h, d * 3 * h),
    }
    parts = []
    for name, (kind, p, io, b) in ops.items():
        t = df[f"time_stats.{name}.median"].to_numpy(float) * 1e-3
        parts.append((np.full(len(df), kind), df.num_tokens.to_numpy(float), p, io, b, t, np.full(len(df), name)))
    cols = [np.concatenate(c) for c in zip(*parts, strict=True)]
    ok = np.isfinite(cols[5]) & (cols[5] > 0)
    return OperatorPoints(*(c[ok] for c in cols))


def concat_points(points: list[OperatorPoints]) -> OperatorPoints:
    return OperatorPoints(*(np.concatenate([getattr(p, f) for p in points]) for f in OperatorPoints.__dataclass_fields__))


def gemm_time(tokens: np.ndarray, params: np.ndarray, io: np.ndarray, hw: HardwareSpec,
              eff_max: float, m_half: float, mem_eff: float) -> np.ndarray:
    compute = 2 * params * (tokens + m_half) / (hw.peak_flops * eff_max)
    memory = (params + tokens * io) * _DTYPE_BYTES / (hw.mem_bandwidth * mem_eff)
    return np.maximum(compute, memory)


def fit_gemm(pts: OperatorPoints, hw: HardwareSpec, memory_bound_tokens: float = 16) -> dict[str, float]:
    """gemm_latency_s, weight_mem_eff, gemm_eff_max, gemm_m_half from the GEMM rows, and the fit's
    median |error|.

    Two regimes, each fitted where it governs: on the rows of at most `memory_bound_tokens` tokens a
    GEMM streams its weights, time = latency + bytes / (bandwidth x weight_mem_eff) (linear least
    squares on relative error); then the compute curve (gemm_eff_max, gemm_m_half) from every row
    with those fixed. One joint fit would trade the decode regime's terms for the middle rows' shape."""
    g = pts.kind == "gemm"
    m, p, io, t = pts.tokens[g], pts.params[g], pts.io[g], pts.time_s[g]
    small = m <= memory_bound_tokens
    if small.sum() < 2:
        raise ValueError(f"fewer than 2 GEMM rows of <= {memory_bound_tokens:g} tokens: cannot fit weight streaming")
    nbytes = (p + m * io)[small] * _DTYPE_BYTES
    a = np.vstack([np.ones_like(nbytes), nbytes]).T / t[small][:, None]
    (lat, per_byte), *_ = np.linalg.lstsq(a, np.ones(int(small.sum())), rcond=None)
    lat = max(float(lat), 0.0)
    mem_eff = float(np.clip(1 / (per_byte * hw.mem_bandwidth), 0.05, 1.0))

    def resid(x: np.ndarray) -> np.ndarray:
        return np.log((lat + gemm_time(m, p, io, hw, x[0], x[1], mem_eff)) / t)

    r = least_squares(resid, [0.7, 16.0], bounds=([0.05, 0.0], [1.0, 4096.0]), loss="soft_l1", f_scale=0.1)
    err = np.abs(np.expm1(resid(r.x)))
    return {"gemm_latency_s": lat, "weight_mem_eff": mem_eff, "gemm_eff_max": float(r.x[0]),
            "gemm_m_half": float(r.x[1]), "gemm_median_abs_error": float(np.median(err)), "gemm_points": int(g.sum())}


def fit_elementwise(pts: OperatorPoints, hw: HardwareSpec) -> dict[str, float]:
    """elementwise_floor_s and elementwise_mem_eff from the elementwise rows."""
    e = pts.kind == "elementwise"
    m, b, t = pts.tokens[e], pts.bytes_per_token[e], pts.time_s[e]

    def resid(x: np.ndarray) -> np.ndarray:
        return np.log((x[0] * 1e-6 + m * b / (hw.mem_bandwidth * x[1])) / t)

    r = least_squares(resid, [2.0, 0.5], bounds=([0.0, 0.01], [100.0, 1.0]), loss="soft_l1", f_scale=0.1)
    err = np.abs(np.expm1(resid(r.x)))
    return {"elementwise_floor_s": float(r.x[0] * 1e-6), "elementwise_mem_eff": float(r.x[1]),
            "elementwise_median_abs_error": float(np.median(err)), "elementwise_points": int(e.sum())}


def read_allreduce_csv(path: str | Path) -> pd.DataFrame:
    """(size bytes, num_workers, median seconds), the median over ranks of each (size, workers)."""
    path = Path(path)
    df = pd.read_csv(path)
    for c in ("size", "num_workers", "time_stats.all_reduce.median"):
        if c not in df.columns:
            raise ValueError(f"{path}: missing column {c}")
    out = df.groupby(["size", "num_workers"], as_index=False)["time_stats.all_reduce.median"].median()
    out = out.rename(columns={"time_stats.all_reduce.median": "time_s"})
    out["time_s"] *= 1e-3
    return out[out.time_s > 0]


def fit_allreduce(df: pd.DataFrame, hw: HardwareSpec) -> dict[str, float]:
    """allreduce_latency_s and allreduce_bus_eff (ring: 2 (n - 1) / n of the bytes per GPU)."""
    s, n, t = df["size"].to_numpy(float), df.num_workers.to_numpy(float), df.time_s.to_numpy(float)
    ring = s * 2 * (n - 1) / n

    def resid(x: np.ndarray) -> np.ndarray:
        return np.log((x[0] * 1e-6 + ring / (hw.interconnect_bandwidth * x[1])) / t)

    r = least_squares(resid, [10.0, 0.6], bounds=([0.0, 0.01], [1000.0, 1.0]), loss="soft_l1", f_scale=0.1)
    err = np.abs(np.expm1(resid(r.x)))
    return {"allreduce_latency_s": float(r.x[0] * 1e-6), "allreduce_bus_eff": float(r.x[1]),
            "allreduce_median_abs_error": float(np.median(err)), "allreduce_points": len(df)}


def fit_operators(directory: str | Path, hw: HardwareSpec, gpu: str = "h100") -> tuple[dict[str, float], dict]:
    """(parameters, report) from the `<gpu>_*_mlp.csv` and `<gpu>_dgx_all_reduce.csv` in `directory`.
    The report has each fit's median |error|, its number of points and the files used."""
    directory = Path(directory)
    mlp = sorted(directory.glob(f"{gpu}_*_mlp.csv"))
    if not mlp:
        # --operators takes either kind: say both (was: only Vidur's, for a kernel tree missing its dense.csv)
        raise FileNotFoundError(f"{directory}: no {gpu}_*_mlp.csv operator profiles (Vidur's) and no "
                                "<org>/<model>/<variant>/tp<N>/dense.csv kernel profiles")
    pts = concat_points([read_operator_csv(p) for p in mlp])
    report = {**fit_gemm(pts, hw), **fit_elementwise(pts, hw)}
    ar = directory / f"{gpu}_dgx_all_reduce.csv"
    files = [*mlp]
    if ar.is_file():
        report.update(fit_allreduce(read_allreduce_csv(ar), hw))
        files.append(ar)
    params = {k: v for k, v in report.items() if not k.endswith(("_error", "_points"))}
    report["files"] = [str(f) for f in files]
    return params, report
