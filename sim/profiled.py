"""The profiled cost model: iteration times fitted to measurements from real runs (calibration).

The calibration loop: the backend's profiler (backend/profiler.py) runs a grid of batch
compositions on a real model and records each one's `StepComposition` numbers and measured time;
`fit_profile` fits a linear step model to them (the BLIS recipe, with the features the roofline
model prices: tokens through the linears, sampled rows through the LM head, query-key pairs and
cached tokens through attention, blocks moved); a *profile file* (JSON) keeps the measurements, the
fit, its error and where it was measured; `ProfiledCostModel.from_profile` prices simulated
iterations from it.

    time = base + tokens * c_tokens + sampled * c_sampled + prefill_attn_pairs * c_pairs
           + prefill_context_tokens * c_prefix + decode_context_tokens * c_decode_ctx
           + decode_context_tokens / block_size * c_decode_blocks
           + swap_blocks * c_swap + copy_blocks * c_copy
           + [in the serving loop] (loop + seqs * c_loop_seqs)

The decode_blocks term is what paged decode attention pays per KV block it reads, beyond the
tokens in it (a table lookup and a gather per block, a short tile for the kernel): it is what makes
small blocks slow. At one block size it cannot be told apart from decode_context_tokens, so it is
fitted only when decodes were measured at two or more block sizes (`pagesim profile
--block-sizes`; each measurement records its `block_size`), and is 0 otherwise.

Coefficients are non-negative (a fit that makes work cheaper with more of it extrapolates badly)
and are fitted on relative error (weights 1 / measured time), since a step's time spans orders of
magnitude across the grid. Measurements come from two sources: grid points (`source` absent or
"grid", chosen compositions timed in isolation) and served iterations (`source` "served", a live
run's iterations, scheduling included); when both are present each source weighs the same in total,
so hundreds of served iterations do not drown the grid. The two `loop` terms are what an iteration
of the serving loop pays beyond the executor's work (scheduling, bookkeeping): fitted on served
iterations only (grid points have them at 0), and always paid by a simulated iteration, which is a
loop iteration. `fit.cv_mape` is the k-fold cross-validated error, the honest one.

Profiles that the project's own runs produced ship in sim/profiles/ and are found by name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from policies.iteration_log import iteration_compositions
from policies.plan import COMPOSITION_COUNTS, StepComposition
from sim.cost_model import CostModel
from sim.shipped import read_checked, resolve_shipped, shipped_names

PROFILE_FORMAT = "pagesim-profile"
PROFILE_VERSION = 1
SHIPPED_DIR = Path(__file__).parent / "profiles"

FEATURES: tuple[str, ...] = ("base", "tokens", "sampled", "prefill_attn_pairs", "prefill_context_tokens",
                             "decode_context_tokens", "decode_blocks", "swap_blocks", "copy_blocks", "loop", "loop_seqs")
COMPOSITION_FIELDS = COMPOSITION_COUNTS  # a measurement's composition: StepComposition.counts()


def features(c: StepComposition, in_loop: bool = True) -> list[float]:
    """The regressors of one composition, in FEATURES order; `in_loop`: an iteration of the serving
    loop (a served or simulated iteration) rather than the executor timed alone (a grid point)."""
    seqs = float(c.num_prefill_seqs + c.num_decode_seqs)
    return [1.0, float(c.prefill_tokens + c.num_decode_seqs), seqs,
            float(c.prefill_attn_pairs), float(c.prefill_context_tokens), float(c.decode_context_tokens),
            c.decode_context_tokens / c.block_size,
            float(c.swap_in_blocks + c.swap_out_blocks), float(c.copy_blocks), float(in_loop), seqs * in_loop]


class ProfiledCostModel(CostModel):
    """A fitted linear step model (see the module docstring). `block_size` is the block size the
    profile was measured at (transfers of other block sizes scale with their bytes);
    `sim_block_size` the one the simulation runs at (default the same), which prices the
    decode_blocks term of every decode step."""

    def __init__(self, coef: dict[str, float], block_size: int = 16, source: str = "",
                 sim_block_size: int | None = None) -> None:
        unknown = set(coef) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown coefficients {sorted(unknown)}; known: {', '.join(FEATURES)}")
        bad = {k: v for k, v in coef.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ValueError(f"coefficients must be finite and >= 0, got {bad}")
        self.coef = {k: float(coef.get(k, 0.0)) for k in FEATURES}
        self.block_size = block_size
        self.sim_block_size = sim_block_size or block_size
        self.source = source
        c = self.coef
        # a simulated iteration is a loop iteration: its loop terms fold into the constant and the
        # per-sequence term (sampled rows and sequences are the same count)
        self._base, self._tok, self._samp = c["base"] + c["loop"], c["tokens"], c["sampled"] + c["loop_seqs"]
        self._pairs, self._prefix = c["prefill_attn_pairs"], c["prefill_context_tokens"]
        self._dctx = self._decode_ctx_coef(self.sim_block_size)

    def _decode_ctx_coef(self, block_size: int) -> float:
        """Seconds per decode context token at a block size (its share of a block's cost included)."""
        return self.coef["decode_context_tokens"] + self.coef["decode_blocks"] / block_size

    @classmethod
    def from_profile(cls, profile: str | Path | dict[str, Any], sim_block_size: int | None = None) -> ProfiledCostModel:
        """From a profile file's path, a shipped profile's name, or a loaded profile dict."""
        p = profile if isinstance(profile, dict) else load_profile(profile)
        return cls(p["fit"]["coef"], int(p["block_size"]), p.get("source", ""), sim_block_size)

    def scaled(self, factor: float) -> ProfiledCostModel:
        """The same model with every step `factor` times as long: the profile's machine measured
        running `factor` times slower than when it was profiled (the model is linear, so scaling
        every coefficient scales every prediction)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor: must be finite and > 0, got {factor}")
        return ProfiledCostModel({k: v * factor for k, v in self.coef.items()}, self.block_size,
                                 f"{self.source} x{factor:.3f}", self.sim_block_size)

    def step_time(self, c: StepComposition) -> float:
        if c.is_empty:
            return 0.0
        # the same additions in the same order as _decode_time, so pure decodes agree bit for bit
        dctx = self._dctx if c.block_size == self.sim_block_size else self._decode_ctx_coef(c.block_size)
        t = (self._base + self._tok * (c.prefill_tokens + c.num_decode_seqs)
             + self._samp * (c.num_prefill_seqs + c.num_decode_seqs) + dctx * c.decode_context_tokens)
        if c.num_prefill_seqs:
            t += self._pairs * c.prefill_attn_pairs + self._prefix * c.prefill_context_tokens
        if c.swap_in_blocks or c.swap_out_blocks:
            t += self.swap_time(c.swap_in_blocks + c.swap_out_blocks, c.block_size)
        if c.copy_blocks:
            t += self.coef["copy_blocks"] * c.copy_blocks * c.block_size / self.block_size
        return float(t)

    def _decode_time(self, seqs, ctx):
        return self._base + self._tok * seqs + self._samp * seqs + self._dctx * ctx

    def decode_step_time(self, num_seqs: int, context_tokens: int) -> float:
        return float(self._decode_time(num_seqs, context_tokens)) if num_seqs > 0 else 0.0

    def decode_step_times(self, num_seqs: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        seqs, ctx = np.broadcast_arrays(np.asarray(num_seqs, dtype=np.float64),
                                        np.asarray(context_tokens, dtype=np.float64))
        return np.where(seqs > 0, self._decode_time(seqs, ctx), 0.0)

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        return self.coef["swap_blocks"] * num_blocks * block_size / self.block_size


# ---- fitting --------------------------------------------------------------------------------------
def _nnls_relative(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the weighted squared relative error
    sum(w * ((X b - y) / y)^2). Columns that are zero throughout are left at 0 (no measurement
    informs them)."""
    from scipy.optimize import nnls

    used = np.flatnonzero(np.any(X != 0, axis=0))
    r = np.sqrt(w)
    A = X[:, used] * (r / y)[:, None]
    scale = np.abs(A).max(axis=0)  # unit columns: nnls is sensitive to wildly different scales
    b, _ = nnls(A / scale, r, maxiter=50 * A.shape[1])
    coef = np.zeros(X.shape[1])
    coef[used] = b / scale
    return coef


def fit_measurements(measurements: Sequence[dict[str, Any]], folds: int = 5, block_size: int = 16) -> dict[str, Any]:
    """Fit FEATURES to measurements (dicts of COMPOSITION_FIELDS plus `time_s`, and `block_size`
    where it is not `block_size`).

    Returns {"coef", "mape", "max_ape", "cv_mape", "num_points"}: in-sample mean (weighted as the
    fit is) and max absolute percentage errors, and the mean of each point's error when it is held
    out (`folds`-fold, points dealt to folds in turn, so deterministic); with served iterations,
    also their own in-sample and held-out means ("served_mape", "served_cv_mape"); and each
    coefficient's range over the held-out fits ("coef_folds": [min, max]; a wide one is poorly
    determined by the measurements)."""
    if len(measurements) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measurements to fit, got {len(measurements)}")
    served = np.array([m.get("source", "grid") == "served" for m in measurements])
    comps = [composition_of(m, i, block_size) for i, m in enumerate(measurements)]
    X = np.array([features(c, bool(s)) for c, s in zip(comps, served)])
    if len({c.block_size for c in comps if c.decode_context_tokens}) < 2:
        X[:, FEATURES.index("decode_blocks")] = 0.0  # one block size cannot tell blocks from tokens
    y = np.array([_time_of(m, i) for i, m in enumerate(measurements)])
    w = np.ones_like(y)
    if served.any() and not served.all():
        w[served] = (~served).sum() / served.sum()
    coef = _nnls_relative(X, y, w)
    ape = np.abs(X @ coef - y) / y
    held = np.empty_like(y)
    k = min(folds, len(y))
    fold_coefs = []
    for f in range(k):
        test = np.arange(len(y)) % k == f
        fold_coefs.append(_nnls_relative(X[~test], y[~test], w[~test]))
        held[test] = np.abs(X[test] @ fold_coefs[-1] - y[test]) / y[test]
    span = np.array(fold_coefs)
    out = {"coef": dict(zip(FEATURES, coef.tolist())), "mape": _wmean(ape, w), "max_ape": float(ape.max()),
           "cv_mape": _wmean(held, w), "num_points": len(y),
           "coef_folds": {f: [float(span[:, j].min()), float(span[:, j].max())] for j, f in enumerate(FEATURES)}}
    if served.any():
        out["served_mape"] = float(ape[served].mean())
        out["served_cv_mape"] = float(held[served].mean())
    return out


def prediction_error(coef: dict[str, float], measurements: Sequence[dict[str, Any]], block_size: int = 16) -> float:
    """Mean absolute percentage error of a fit's coefficients (a profile's `fit.coef`) on
    `measurements` (e.g. the same grid timed on another machine)."""
    if not measurements:
        raise ValueError("no measurements to judge the fit on")
    served = [m.get("source", "grid") == "served" for m in measurements]
    X = np.array([features(composition_of(m, i, block_size), s) for i, (m, s) in enumerate(zip(measurements, served))])
    y = np.array([_time_of(m, i) for i, m in enumerate(measurements)])
    c = np.array([coef.get(f, 0.0) for f in FEATURES])
    return float(np.mean(np.abs(X @ c - y) / y))


def _wmean(x: np.ndarray, w: np.ndarray) -> float:
    return float(np.average(x, weights=w))


def composition_of(m: dict[str, Any], index: int = 0, block_size: int = 16) -> StepComposition:
    """The StepComposition a measurement records (missing fields are 0; its block size is its
    `block_size` field, else `block_size`)."""
    bs = m.get("block_size", block_size)
    if not isinstance(bs, int) or bs < 1:
        raise ValueError(f"measurements[{index}].block_size: expected a positive integer, got {bs!r}")
    kw = {"block_size": bs}
    for f in COMPOSITION_FIELDS:
        v = m.get(f, 0)
        if not isinstance(v, (int, float)) or v < 0 or v != int(v):
            raise ValueError(f"measurements[{index}].{f}: expected a non-negative integer, got {v!r}")
        kw[f] = int(v)
    c = StepComposition(**kw)
    if c.is_empty:
        raise ValueError(f"measurements[{index}]: an empty composition (no tokens, no swaps)")
    return c


def _time_of(m: dict[str, Any], index: int) -> float:
    t = m.get("time_s")
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise ValueError(f"measurements[{index}].time_s: expected a positive number of seconds, got {t!r}")
    return float(t)


# ---- profile files --------------------------------------------------------------------------------
def make_profile(measurements: list[dict[str, Any]], block_size: int, meta: dict[str, Any]) -> dict[str, Any]:
    """A profile dict: `meta` (model, device, software, dtype, ...), the measurements and their fit."""
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **meta, "block_size": block_size,
            "fit": fit_measurements(measurements, block_size=block_size), "measurements": measurements}


def save_profile(profile: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1) + "\n")
    return path


def shipped_profiles() -> list[str]:
    return shipped_names(SHIPPED_DIR)


def resolve_profile(name: str | Path) -> Path:
    """A profile file's path, or the name of one shipped in sim/profiles/."""
    return resolve_shipped(name, SHIPPED_DIR, "profile")


def load_profile(name: str | Path) -> dict[str, Any]:
    """Read and check a profile file; errors name the file and the field."""
    path = resolve_profile(name)
    p = read_checked(path, "profile", PROFILE_FORMAT, PROFILE_VERSION, ("block_size", "fit", "measurements", "model"))
    bs = p["block_size"]
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:  # was: ZeroDivisionError for 0, "fit.coef" else
        raise ValueError(f"{path}: block_size: expected an integer >= 1, got {bs!r}")
    if not isinstance(p["fit"], dict) or not isinstance(p["fit"].get("coef"), dict):
        raise ValueError(f"{path}: field 'fit.coef' must be an object of coefficients")
    try:
        ProfiledCostModel(p["fit"]["coef"], int(p["block_size"]))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: fit.coef: {exc}") from exc
    p["source"] = str(path)
    return p


def measurements_from_runs(run_dirs: Sequence[str | Path], block_size: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Profile measurements from live runs' iteration tables (`pagesim profile --from-run`): one
    "served" measurement per iteration (its measured time, scheduling included), and the profile
    meta (model, device, runs). Errors name the run directory or file: not a run, a simulated run,
    a table without compositions, another block size or another model than the first run's."""
    import pandas as pd

    measurements: list[dict[str, Any]] = []
    runs: list[str] = []
    meta: dict[str, Any] = {}
    for d in map(Path, run_dirs):
        summary_path, its_path = d / "summary.json", d / "iterations.parquet"
        if not summary_path.is_file() or not its_path.is_file():
            raise FileNotFoundError(f"{d}: not a run directory (needs summary.json and iterations.parquet)")
        summary = json.loads(summary_path.read_text())
        if summary.get("mode") != "live":
            raise ValueError(f"{summary_path}: not a live run (a simulated run's times come from a cost model)")
        its = pd.read_parquet(its_path)
        if "prefill_attn_pairs" not in its.columns:
            raise ValueError(f"{its_path}: written by an older pagesim without per-iteration compositions")
        bs = int(summary.get("config", {}).get("block_size", block_size))
        if bs != block_size:
            raise ValueError(f"{d}: block size {bs}, but --block-size is {block_size}")
        model = str(summary.get("model", "?"))
        if meta and meta["model"]["name"] != model:
            raise ValueError(f"{d}: model {model!r}; the other runs are {meta['model']['name']!r}")
        meta = {"model": {"name": model}, "device": {"type": summary.get("device", "?")}}
        measurements += [{"label": f"run {d.name}", **c.counts(), "time_s": float(t), "source": "served"}
                         for c, t in zip(iteration_compositions(its, bs), its.duration)]
        runs.append(str(d))
    meta.update(runs=runs)
    return measurements, meta
