"""The calibrated roofline: operator accounting with the fitted parameters of a hardware x engine pair.

`CalibratedCostModel` prices an iteration of any model (a `ModelSpec`, MoE included: sim/moe.py) at
any tensor-parallel degree from `CalibrationParams`, which describe the machine and the serving
engine, never a model:

    step = iteration_overhead + per_seq * sequences
         + sum over layers and GEMMs of gemm_latency + max(2 P (M + m_half) / (peak * gemm_eff_max),
                                            (P + M (K + N)) * bytes / (bandwidth * weight_mem_eff))
         + elementwise kernels: floor each + bytes / (bandwidth * elementwise_mem_eff)
         + prefill attention: FLOPs / (peak * prefill_attn_eff) + prefix KV / (bandwidth * attn_mem_eff)
         + decode attention: max(FLOPs / (peak * prefill_attn_eff), KV / (bandwidth * attn_mem_eff))
         + lm head (a GEMM over the sampled rows) + all-reduces (tp > 1: latency + bytes / bus bandwidth)
         + swaps and block copies (as the roofline model)

A GEMM of M tokens reaches gemm_eff_max * M / (M + m_half) of peak: small-M GEMMs waste most of the
tensor cores, which the 2 P (M + m_half) form says without dividing by M. The GEMM, elementwise and
all-reduce terms are fitted to per-operator kernel times (analysis/calibrate.py, Vidur's profiles);
the rest (overheads, attention, the client terms) to end-to-end measurements by simulating them.

The client terms are not part of an iteration: `client_terms` says what a client-measured TTFT and
E2E include beyond the server (HTTP, tokenization, streaming); `client_output_lag_steps` says how many
engine iterations after the one that produced it a token reaches the client (an engine that sends a
step's outputs while the next step runs: the lag then costs a step of whatever model runs, not a fixed
time). Every run with a calibrated model applies them once to its request table
(policies/client_latency.py), so its tables and summary carry the client's latencies beside the server's.

Calibrations are JSON files (`save_calibration`, `load_calibration`); the project's own ship in
sim/calibrations/ and are found by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from policies.client_latency import ClientTerms
from policies.plan import StepComposition
from sim.cost_model import CostModel
from sim.moe import LayerShapes, distinct_experts_table
from sim.shipped import read_checked, resolve_shipped, shipped_names
from sim.specs import HardwareSpec, ModelSpec, get_hardware

ArrayLike = Any
CALIBRATION_FORMAT = "pagesim-calibration"
CALIBRATION_VERSION = 1
SHIPPED_DIR = Path(__file__).parent / "calibrations"
# Elementwise kernels per layer as vLLM runs them: two RMSNorms with the residual add fused in,
# the rotary embedding (in place on q and k) and the gated activation.
_ELEMENTWISE_KERNELS = 4


@dataclass(frozen=True)
class CalibrationParams:
    """Parameters of one hardware x engine pair (defaults: engineering priors, used before a fit).
    Efficiencies are fractions of the hardware's datasheet peaks; times in seconds."""

    gemm_latency_s: float = 3e-6        # one GEMM kernel's fixed time (launch, tail)
    gemm_eff_max: float = 0.75          # large-M GEMM compute efficiency
    gemm_m_half: float = 16.0           # tokens at which a GEMM reaches half of gemm_eff_max
    weight_mem_eff: float = 0.8         # weight-streaming (small-M GEMM) memory efficiency
    elementwise_mem_eff: float = 0.5    # norms, rotary, activation, adds
    elementwise_floor_s: float = 2e-6   # one small kernel's time at no work
    allreduce_latency_s: float = 10e-6
    allreduce_bus_eff: float = 0.6      # ring bus bandwidth as a fraction of the interconnect's
    iteration_overhead_s: float = 2e-3  # host work per iteration (scheduling, input prep, sampling)
    per_seq_s: float = 20e-6            # host + kernel work per scheduled sequence
    attn_mem_eff: float = 0.6           # paged KV reads (decode attention, cached prefixes)
    prefill_attn_eff: float = 0.5       # attention FLOPs efficiency
    client_ttft_s: float = 5e-3         # HTTP + tokenization + first chunk: added to TTFT and E2E
    client_per_output_token_s: float = 0.0  # streaming cost per output token after the first (E2E only)
    client_output_lag_steps: float = 0.0  # iterations between a token's step and its reaching the client
    pcie_eff: float = 0.75
    memcpy_latency_s: float = 2.3e-6

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"calibration parameter {f.name}: expected a finite number >= 0, got {v!r}")
            if f.name.endswith("_eff") or f.name == "gemm_eff_max":
                if not 0 < v <= 1:
                    raise ValueError(f"calibration parameter {f.name}: an efficiency must be in (0, 1], got {v}")

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any], where: str = "params") -> CalibrationParams:
        known = {f.name for f in dataclasses.fields(CalibrationParams)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{where}: unknown parameters {sorted(unknown)}; known: {', '.join(sorted(known))}")
        for k, v in d.items():  # float() took "12" as 12 and said nothing of which field a list was in
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{where}: {k}: expected a finite number >= 0, got {v!r}")
        return CalibrationParams(**{k: float(v) for k, v in d.items()})


@dataclass(frozen=True)
class _Gemm:
    """One weight matrix class per device: `params` weights, `io` input + output widths, `count`
    layers it appears in."""

    params: float
    io: float
    count: int


class CalibratedCostModel(CostModel):
    """See the module docstring. `ep` > 1: experts divided over ep devices (expert parallelism).
    `dp` > 1 (an MoE model): this is one of dp data-parallel ranks whose MoE layers run together
    (sim/dp.py): the experts are spread over dp x tp GPUs (whole experts when ep = dp x tp, else each
    expert sharded over them), `step_time` leaves the MoE layers out, and `moe_group_time` prices
    them, with their all-to-all, for the tokens of all ranks at once."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, params: CalibrationParams | None = None,
                 tp: int = 1, ep: int = 1, dp: int = 1) -> None:
        if tp < 1 or ep < 1 or dp < 1:
            raise ValueError(f"tp, ep and dp must be >= 1, got tp={tp}, ep={ep}, dp={dp}")
        self.model, self.hardware, self.tp, self.ep, self.dp = model, hardware, tp, ep, dp
        self.params = p = params or CalibrationParams()
        self._d = model.dtype_bytes
        self._compute = hardware.peak_flops * p.gemm_eff_max
        self._wbw = hardware.mem_bandwidth * p.weight_mem_eff
        self._ebw = hardware.mem_bandwidth * p.elementwise_mem_eff
        self._abw = hardware.mem_bandwidth * p.attn_mem_eff
        self._aflops = hardware.peak_flops * p.prefill_attn_eff
        self._icbw = hardware.interconnect_bandwidth * p.allreduce_bus_eff
        self._pcie = hardware.pcie_bandwidth * p.pcie_eff
        self._init_shapes()

    def _init_shapes(self) -> None:
        m, tp, s = self.model, self.tp, LayerShapes.of(self.model)
        h, q, kv, f, L = m.hidden_size, m.q_size, m.kv_size, m.intermediate_size, m.num_layers
        self.shapes = s
        dense_layers = L - s.moe_layers
        gemms = []
        if s.attn_params == L * (2 * h * q + 2 * h * kv):  # standard q/k/v/o projections
            gemms += [_Gemm(h * (q + 2 * kv) / tp, h + (q + 2 * kv) / tp, L), _Gemm(q * h / tp, q / tp + h, L)]
        else:  # other attention (MLA, biases): one matrix class of the same weights
            gemms.append(_Gemm(s.attn_params / L / tp, 2 * h, L))
        if dense_layers:
            mlp = (s.dense_mlp_params - L * getattr(m, "norm_params_per_layer", 0)) / dense_layers
            up = 2 * f if m.arch == "llama" else f
            gemms += [_Gemm(mlp * up / (up + f) / tp, h + up / tp, dense_layers),
                      _Gemm(mlp * f / (up + f) / tp, f / tp + h, dense_layers)]
        if s.shared_params:
            gemms.append(_Gemm(s.shared_params / s.moe_layers / tp, 2 * h, s.moe_layers))
        self._gemms = gemms
        self._lm = _Gemm(m.vocab_size * h / tp, h + m.vocab_size / tp, 1)
        act = (3 * s.top_k * s.moe_intermediate if s.is_moe else (3 * f if m.arch == "llama" else 2 * f))
        # per token, all layers: each add+norm reads x and the residual, writes both; rotary reads and
        # writes q and k; the activation reads gate and up, writes their product
        self._ew_bytes = self._d * L * (8 * h + 2 * (q + kv) / tp + act / tp)
        self._ew_floor = _ELEMENTWISE_KERNELS * L * self.params.elementwise_floor_s
        self._kv_bytes = m.kv_bytes_per_token / tp
        self._pair_flops = s.attn_flops_per_pair / tp
        self._ar_bytes = self._d * h * 2 * (tp - 1) / tp  # ring traffic per token per all-reduce
        # a DP group's MoE layers are priced once for all ranks (moe_group_time), not in step_time
        self._grouped = s.is_moe and self.dp > 1
        if s.is_moe:
            self._experts_dev = self.ep if self.ep > 1 else tp * self.dp
            self._distinct = distinct_experts_table(s.num_experts, s.top_k)

    # --- the pricing maths: floats or arrays, the same IEEE operations either way -------------------

    @staticmethod
    def _max(a: ArrayLike, b: ArrayLike) -> ArrayLike:
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return np.maximum(a, b)
        return max(a, b)

    def _gemm(self, g: _Gemm, tokens: ArrayLike) -> ArrayLike:
        compute = 2 * g.params * (tokens + self.params.gemm_m_half) / self._compute
        memory = (g.params + tokens * g.io) * self._d / self._wbw
        return g.count * (self.params.gemm_latency_s + self._max(compute, memory))

    def _experts(self, tokens: ArrayLike) -> ArrayLike:
        """MoE layers: E_distinct experts read once each, T*k expert passes, at T*k/E_distinct tokens
        per expert (each pays the small-M inefficiency: 2 P (T k + E_distinct m_half) FLOP-time)."""
        s, last = self.shapes, len(self._distinct) - 1
        if isinstance(tokens, np.ndarray):
            distinct = self._distinct[np.minimum(tokens, last).astype(np.int64)]
        else:
            distinct = float(self._distinct[int(min(tokens, last))])
        distinct = distinct / self._experts_dev if self.ep > 1 else distinct
        passes = tokens * s.top_k / (self.ep if self.ep > 1 else 1)
        per = s.expert_params / (1 if self.ep > 1 else self._experts_dev)
        compute = 2 * per * (passes + distinct * self.params.gemm_m_half) / self._compute
        memory = distinct * per * self._d / self._wbw
        return s.moe_layers * (2 * self.params.gemm_latency_s + self._max(compute, memory))  # gate_up, down

    def _linears(self, tokens: ArrayLike) -> ArrayLike:
        total = 0.0
        for g in self._gemms:
            total = total + self._gemm(g, tokens)
        if self.shapes.is_moe and not self._grouped:
            total = total + self._experts(tokens)
        return total + self._ew_floor + tokens * self._ew_bytes / self._ebw

    def _all_to_all(self, tokens: float) -> float:
        """Dispatch and combine of every MoE layer over the dp ranks, as vLLM's default all2all
        backend (allgather_reducescatter) moves them: an all-gather of all ranks' hidden states and a
        reduce-scatter of the experts' outputs, each (dp - 1) / dp of the group's tokens' bytes
        through each GPU's link, plus the collective's latency."""
        per_layer = (self.dp - 1) / self.dp * tokens * self.model.hidden_size * self._d / self._icbw
        return self.shapes.moe_layers * 2 * (self.params.allreduce_latency_s + per_layer)

    def _allreduce(self, tokens: ArrayLike) -> ArrayLike:
        return 2 * self.model.num_layers * (self.params.allreduce_latency_s + self._ar_bytes * tokens / self._icbw)

    def _decode_attn(self, ctx: ArrayLike) -> ArrayLike:
        return self._max(ctx * self._pair_flops / self._aflops, ctx * self._kv_bytes / self._abw)

    def _decode_time(self, seqs: ArrayLike, ctx: ArrayLike) -> ArrayLike:
        """step_time of pure decodes (floats or arrays): the one formula both entry points use."""
        p = self.params
        total = (p.iteration_overhead_s + p.per_seq_s * seqs + self._linears(seqs) + self._decode_attn(ctx)
                 + self._gemm(self._lm, seqs))
        if self.tp > 1:
            total = total + self._allreduce(seqs)
        return total

    # --- public API ---------------------------------------------------------------------------------

    def breakdown(self, c: StepComposition) -> dict[str, float]:
        """Seconds per operator group (they sum to step_time(c) up to rounding)."""
        if c.is_empty:
            return {}
        p, f = self.params, float
        tokens, sampled = f(c.prefill_tokens + c.num_decode_seqs), f(c.num_prefill_seqs + c.num_decode_seqs)
        busy_tokens = tokens > 0
        return {
            "overhead": p.iteration_overhead_s + p.per_seq_s * sampled,
            "linear": self._linears(tokens) if busy_tokens else 0.0,
            "prefill_attn": (c.prefill_attn_pairs * self._pair_flops / self._aflops
                             + c.prefill_context_tokens * self._kv_bytes / self._abw),
            "decode_attn": self._decode_attn(f(c.decode_context_tokens)) if c.num_decode_seqs else 0.0,
            "lm_head": self._gemm(self._lm, sampled) if sampled else 0.0,
            "allreduce": self._allreduce(tokens) if self.tp > 1 and busy_tokens else 0.0,
            "swap": self.swap_time(c.swap_in_blocks + c.swap_out_blocks, c.block_size),
            "copy": c.copy_blocks * 2 * self._kv_bytes * c.block_size / self._abw,
        }

    def step_time(self, c: StepComposition) -> float:
        if c.is_empty:
            return 0.0
        if not (c.num_prefill_seqs or c.swap_in_blocks or c.swap_out_blocks or c.copy_blocks):
            return float(self._decode_time(float(c.num_decode_seqs), float(c.decode_context_tokens)))
        return float(sum(self.breakdown(c).values()))

    def decode_step_time(self, num_seqs: int, context_tokens: int) -> float:
        return float(self._decode_time(float(num_seqs), float(context_tokens))) if num_seqs > 0 else 0.0

    def decode_step_times(self, num_seqs: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        seqs, ctx = np.broadcast_arrays(np.asarray(num_seqs, dtype=np.float64),
                                        np.asarray(context_tokens, dtype=np.float64))
        return np.where(seqs > 0, self._decode_time(seqs, ctx), 0.0)

    def moe_group_time(self, tokens: float) -> float | None:
        """The MoE layers on one GPU of a DP group whose ranks run `tokens` tokens in all (all of
        them go through every rank's GPUs: experts, then all-to-all); None unless dp > 1 on an MoE
        model (step_time then prices the experts itself)."""
        if not self._grouped:
            return None
        return float(self._experts(float(tokens))) + self._all_to_all(float(tokens))

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        per_block = (2 * self.model.num_layers * self.params.memcpy_latency_s
                     + block_size * self._kv_bytes / self._pcie)
        return num_blocks * per_block

    def client_terms(self) -> ClientTerms:
        """The calibration's client terms: every run with this model reports client latencies too."""
        p = self.params
        return ClientTerms(p.client_ttft_s, p.client_per_output_token_s, p.client_output_lag_steps)


# --- calibration files ------------------------------------------------------------------------------

@dataclass
class Calibration:
    """A calibration file's content: the parameters, the hardware they were fitted on, and the rest
    (engine, sources, fit errors, command) as `meta`."""

    params: CalibrationParams
    hardware: str
    name: str = ""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str = ""

    def cost_model(self, model: ModelSpec, hardware: HardwareSpec, tp: int = 1, ep: int = 1,
                   dp: int = 1) -> CalibratedCostModel:
        """The cost model of `model` on `hardware`; warns when `hardware` is not the fitted one."""
        if get_hardware(self.hardware).name != hardware.name:
            warnings.warn(f"calibration {self.name or self.source} was fitted on {self.hardware}, but is used on "
                          f"{hardware.name}: its efficiencies and overheads may not hold there", stacklevel=2)
        return CalibratedCostModel(model, hardware, self.params, tp=tp, ep=ep, dp=dp)

    def to_dict(self) -> dict[str, Any]:
        return {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "name": self.name,
                "hardware": self.hardware, "params": self.params.to_dict(), **self.meta}


def shipped_calibrations() -> list[str]:
    return shipped_names(SHIPPED_DIR)


def resolve_calibration(name: str | Path) -> Path:
    """A calibration file's path, or the name of one shipped in sim/calibrations/."""
    return resolve_shipped(name, SHIPPED_DIR, "calibration")


def load_calibration(name: str | Path) -> Calibration:
    """Read and check a calibration file (or a shipped one by name); errors name the file and field."""
    path = resolve_calibration(name)
    d = read_checked(path, "calibration", CALIBRATION_FORMAT, CALIBRATION_VERSION, ("hardware", "params"))
    if not isinstance(d["params"], dict):
        raise ValueError(f"{path}: field 'params' must be an object")
    if not isinstance(d["hardware"], str):
        raise ValueError(f"{path}: field 'hardware' must be a hardware spec's name, got {d['hardware']!r}")
    try:
        params = CalibrationParams.from_dict(d["params"], where=f"{path}: params")
        get_hardware(str(d["hardware"]))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    meta = {k: v for k, v in d.items() if k not in ("format", "version", "name", "hardware", "params")}
    return Calibration(params, str(d["hardware"]), str(d.get("name") or path.stem), meta, str(path))


def save_calibration(cal: Calibration, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cal.to_dict(), indent=1) + "\n")
    return path
