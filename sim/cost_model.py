"""Cost models: how long one engine iteration takes, given its `StepComposition`.

Every model implements `CostModel`. Registered names (see `sim.cost_registry.make_cost_model`):

- "roofline": `RooflineCostModel`, an analytic model from a `HardwareSpec` and a `ModelSpec`.
- "linear": `ConstantCostModel`, a hand-set linear model for tests and back-of-envelope studies.
- "profiled": `sim.profiled.ProfiledCostModel`, a step model fitted to measurements that the
  backend's profiler recorded on real hardware (the calibration loop), built from a profile file.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
from mypy_extensions import mypyc_attr

from policies._compiled import running_compiled
from policies.client_latency import ClientTerms
from policies.plan import StepComposition
from sim.moe import LayerShapes, distinct_experts_table
from sim.specs import HardwareSpec, ModelSpec

ArrayLike = Any  # a float or a numpy array


@mypyc_attr(allow_interpreted_subclasses=True)  # subclassed by other cost models and tests
class CostModel(ABC):
    """Prices iterations. An empty composition (no tokens, no swaps) costs 0: no iteration runs."""

    @abstractmethod
    def step_time(self, c: StepComposition) -> float:
        """Seconds one iteration with composition `c` takes."""

    @abstractmethod
    def swap_time(self, num_blocks: float, block_size: int) -> float:
        """Seconds to move `num_blocks` KV blocks of `block_size` tokens between CPU and GPU (a float:
        the roofline's operator groups pass their counts as floats)."""

    def moe_group_time(self, tokens: float) -> float | None:
        """The MoE layers of one data-parallel rank of a group whose ranks run `tokens` tokens in all
        (sim/dp.py: vLLM's DP ranks of an MoE model step together): None when this model prices its
        MoE layers in `step_time` (no DP group, a dense model, or a model that cannot say)."""
        return None

    def client_terms(self) -> ClientTerms | None:
        """What a client measures beyond this model's server times (policies/client_latency.py), or
        None: the model prices the server only, and runs report server latencies alone."""
        return None

    def decode_step_time(self, num_seqs: int, context_tokens: int) -> float:
        """`step_time` of one pure-decode iteration (subclasses may skip building the composition)."""
        return self.step_time(StepComposition(num_decode_seqs=num_seqs, decode_context_tokens=context_tokens))

    def decode_step_series(self, num_seqs: int, context0: int, steps: int) -> list[float]:
        """`decode_step_time(num_seqs, context0 + num_seqs * j)` for j = 1 .. steps: a few decode
        iterations of one batch whose contexts sum to `context0` before them (plain floats, without
        numpy's per-call cost; the contexts are not listed, which would box each). Subclasses may
        price the terms that depend on the batch size once, if the result stays bit for bit the same."""
        price = self.decode_step_time
        return [price(num_seqs, context0 + num_seqs * j) for j in range(1, steps + 1)]

    def series_steps(self) -> int:
        """Windows of fewer iterations than this are priced by `decode_step_series`, longer ones by
        `decode_step_times` (the two give the same floats; this says which is cheaper here)."""
        return 64

    def decode_step_times(self, num_seqs: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        """Times of pure-decode iterations, elementwise: `num_seqs[i]` sequences whose contexts sum
        to `context_tokens[i]`. Equals `step_time` of the same composition; the simulator uses it to
        price many upcoming iterations at once. Subclasses override it with vectorised maths."""
        seqs = np.asarray(num_seqs)
        ctx = np.asarray(context_tokens)
        out = [self.step_time(StepComposition(num_decode_seqs=int(n), decode_context_tokens=int(k)))
               for n, k in zip(seqs.ravel(), np.broadcast_to(ctx, seqs.shape).ravel(), strict=True)]
        return np.asarray(out, dtype=np.float64).reshape(seqs.shape)


@mypyc_attr(allow_interpreted_subclasses=True)  # subclassed by other cost models and tests
class ConstantCostModel(CostModel):
    """step = base + prefill_per_token * prefill_tokens + decode_per_seq * num_decode_seqs
    (+ swap_per_block per swapped block). For hand-checked tests."""

    def __init__(self, prefill_per_token: float, decode_per_seq: float, base: float,
                 swap_per_block: float = 0.0) -> None:
        self.prefill_per_token = prefill_per_token
        self.decode_per_seq = decode_per_seq
        self.base = base
        self.swap_per_block = swap_per_block

    def step_time(self, c: StepComposition) -> float:
        if c.is_empty:
            return 0.0
        return (self.base + self.prefill_per_token * c.prefill_tokens
                + self.decode_per_seq * c.num_decode_seqs
                + self.swap_time(c.swap_in_blocks + c.swap_out_blocks, c.block_size))

    def swap_time(self, num_blocks: float, block_size: int) -> float:
        return self.swap_per_block * num_blocks

    def decode_step_times(self, num_seqs: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        n = np.asarray(num_seqs, dtype=np.float64)
        return np.where(n > 0, self.base + self.decode_per_seq * n, 0.0)


@mypyc_attr(allow_interpreted_subclasses=True)  # subclassed by other cost models and tests
class RooflineCostModel(CostModel):
    """Analytic roofline model of one tensor-parallel replica.

    time = overhead_s + sum over operator groups of max(FLOPs / (peak * compute eff),
                                                       bytes / (bandwidth * memory eff))
    with groups (per device; work is split evenly over `tp` devices):

    - linear: every transformer-layer weight is read once per iteration; 2 FLOPs per parameter per
      token (biases and norms are counted as parameters: a rounding error); each matmul's input and
      output activations are read and written once.
    - prefill attention: 4 FLOPs per query-key pair per head dim (QK^T and PV) over
      `prefill_attn_pairs`; reads the cached prefix's KV, reads/writes q, k, v, o of new tokens.
    - decode attention: a separate kernel; reads the KV of every decode context (memory bound).
    - lm head: logits only for sampling tokens — one per decode sequence and one per prefill chunk
      (an upper bound: a chunk that does not reach the end of its prompt samples nothing).
    - mixture of experts (sim/moe.py): expert weights are read once per distinct expert the batch's
      tokens touch (expected E (1 - (1 - k/E)^T) per MoE layer), expert FLOPs are T * k passes;
      shared experts and routers are priced like dense weights. `ep` > 1 divides the experts over
      ep devices (expert parallelism) instead of sharding each over tp. `dp` > 1: one of dp
      data-parallel ranks whose MoE layers run together (sim/dp.py): the experts are spread over
      dp x tp devices, step_time leaves them out and `moe_group_time` prices them (and their
      all-to-all over the interconnect) for all ranks' tokens at once.
    - tensor parallel (tp > 1): two all-reduces of the hidden states per layer, ring algorithm,
      2 (tp - 1) / tp of the bytes over the interconnect plus a fixed latency each.
    - swap: KV blocks over PCIe; each device moves its own shard over its own link. vLLM issues
      swaps on one stream and waits for them before the forward pass, so they add, not overlap.
      vLLM's cache engine copies a block with one cudaMemcpyAsync per layer for keys and one for
      values, so each block also pays 2 x layers call latencies: small blocks swap slowly.
    - copy-on-write block copies: read and write of each block in HBM.

    Default efficiencies are engineering priors from kernel microbenchmarks, not fitted to any
    end-to-end result:
      compute_efficiency 0.7: large bf16 cuBLAS GEMMs reach 70-80% of dense peak on A100/H100.
      memory_efficiency 0.8: streaming reads (weights, GEMV-like decode) reach 80-90% of HBM peak.
      attention_compute_efficiency 0.5: FlashAttention-2 forward reaches 50-70% of peak.
      attention_memory_efficiency 0.64: gathering KV through block tables is slower than streaming;
        the vLLM paper measured its paged kernel 20-26% slower than a contiguous one (0.8 / 1.25).
      interconnect_efficiency 0.75: NCCL all-reduce bus bandwidth reaches ~75% of NVLink peak.
      allreduce_latency_s 10 us: small-message all-reduce latency on NVLink.
      pcie_efficiency 0.75: pinned host<->device copies reach ~75% of the PCIe link.
      memcpy_latency_s 2.3 us: the fixed cost of one cudaMemcpyAsync of a KV chunk (FlexKV PR #193
        measured ~2.3 us per call on an H20, dominating chunk-sized transfers).
      overhead_s 4 ms: per-iteration CPU work (scheduling, input preparation, sampling, output
        processing) during which the GPU idles; vLLM issue #6854 measured ~4 ms of GPU bubble per
        decode step (5-13 ms in other setups).
    """

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, tp: int = 1, overhead_s: float = 4e-3,
                 compute_efficiency: float = 0.7, memory_efficiency: float = 0.8,
                 attention_compute_efficiency: float = 0.5, attention_memory_efficiency: float = 0.64,
                 interconnect_efficiency: float = 0.75, allreduce_latency_s: float = 10e-6,
                 pcie_efficiency: float = 0.75, memcpy_latency_s: float = 2.3e-6, ep: int = 1,
                 dp: int = 1) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if ep < 1 or dp < 1:
            raise ValueError(f"ep and dp must be >= 1, got ep={ep}, dp={dp}")
        self.ep, self.dp = ep, dp
        effs = {"compute_efficiency": compute_efficiency, "memory_efficiency": memory_efficiency,
                "attention_compute_efficiency": attention_compute_efficiency,
                "attention_memory_efficiency": attention_memory_efficiency,
                "interconnect_efficiency": interconnect_efficiency, "pcie_efficiency": pcie_efficiency}
        for k, v in effs.items():
            if not 0 < v <= 1:
                raise ValueError(f"{k} must be in (0, 1], got {v}")
        self.model, self.hardware, self.tp = model, hardware, tp
        self.overhead_s = overhead_s
        self.allreduce_latency_s = allreduce_latency_s
        if memcpy_latency_s < 0:
            raise ValueError(f"memcpy_latency_s must be >= 0, got {memcpy_latency_s}")
        self.memcpy_latency_s = memcpy_latency_s
        self._flops = hardware.peak_flops * compute_efficiency
        self._bw = hardware.mem_bandwidth * memory_efficiency
        self._attn_flops = hardware.peak_flops * attention_compute_efficiency
        self._attn_bw = hardware.mem_bandwidth * attention_memory_efficiency
        self._ic_bw = hardware.interconnect_bandwidth * interconnect_efficiency
        self._pcie_bw = hardware.pcie_bandwidth * pcie_efficiency
        self._init_per_token_constants()
        # (overhead + linear, lm_head) of a dense model's pure decode by batch size: a function of
        # the batch size and the constants above, priced once (at most max_num_seqs entries)
        self._decode_terms_memo: dict[int, tuple[float, float]] = {}
        # step_time by plain float maths (_float_step_time) for a dense model priced by this class's
        # own groups; a subclass (which may reprice a group) and MoE models take the general path
        self._float_path = type(self) is RooflineCostModel and not self._expert_params
        # windows priced by the scalar series below this many iterations (series_steps): it costs
        # ~0.2 us an iteration compiled and ~0.35 us interpreted, numpy's vectorised path ~20-50 us
        # a call, so the two meet at ~500 iterations compiled and ~64 interpreted (measured)
        self._series_steps = 512 if running_compiled(sys.modules[__name__]) else 64

    def _init_per_token_constants(self) -> None:
        """Model-wide FLOPs and bytes per unit of work, per device."""
        m, d, tp = self.model, self.model.dtype_bytes, self.tp
        h, f, q, kv, L = m.hidden_size, m.intermediate_size, m.q_size, m.kv_size, m.num_layers
        shapes = LayerShapes.of(m)
        self._grouped = shapes.is_moe and self.dp > 1  # MoE layers priced by moe_group_time, not step_time
        self._moe_layers = shapes.moe_layers
        if shapes.is_moe:
            self._linear_params = shapes.dense_params / tp
            # experts split over ep devices, else each sharded over the tp (x dp) devices
            experts_dev = self.ep if self.ep > 1 else tp * self.dp
            self._expert_params = shapes.moe_layers * shapes.expert_params / experts_dev
            self._expert_passes = shapes.top_k
            self._distinct = distinct_experts_table(shapes.num_experts, shapes.top_k)
        else:
            self._linear_params = L * m.params_per_layer / tp
            self._expert_params = 0.0
        # In + out widths of each matmul: qkv, o, then fc1/fc2 (OPT) or gate_up/down (Llama).
        mlp_io = (h + f) + (f + h) if m.arch == "opt" else (h + 2 * f) + (f + h)
        self._linear_act_bytes = L * d * ((h + q + 2 * kv) + (q + h) + mlp_io) / tp
        self._attn_flops_per_pair = shapes.attn_flops_per_pair / tp
        self._kv_bytes = m.kv_bytes_per_token / tp
        self._qkvo_bytes = L * d * (2 * q + 2 * kv) / tp  # q read, o written, new k and v written
        self._lm_params = m.vocab_size * h / tp
        self._logit_bytes = m.vocab_size * 4 / tp  # fp32 logits per sampled token
        self._allreduce_bytes = d * h * 2 * (tp - 1) / tp  # ring traffic per token per all-reduce

    # --- the pricing maths, shared by step_time and the decode shortcut ----------------------------
    # Each operator group is priced by one function taking floats or arrays, so the general path
    # (_groups, floats) and the pure-decode path (_decode_time, floats or arrays) run the same IEEE
    # operations and agree bit for bit.

    def _roof(self, flops: ArrayLike, nbytes: ArrayLike, peak: float, bw: float) -> ArrayLike:
        a, b = flops / peak, nbytes / bw
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return np.maximum(a, b)
        return max(a, b)  # plain floats: the same IEEE maths without numpy's per-call cost

    def _linear(self, tokens: ArrayLike) -> ArrayLike:
        flops = 2 * self._linear_params * tokens
        nbytes = self._linear_params * self.model.dtype_bytes + self._linear_act_bytes * tokens
        if self._expert_params and not self._grouped:
            flops = flops + 2 * self._expert_params * self._expert_passes * tokens
            nbytes = nbytes + self._expert_params * self.model.dtype_bytes * self._experts_read(tokens)
        return self._roof(flops, nbytes, self._flops, self._bw)

    def moe_group_time(self, tokens: float) -> float | None:
        if not self._grouped:
            return None
        tokens = float(tokens)
        experts = self._roof(2 * self._expert_params * self._expert_passes * tokens,
                             self._expert_params * self.model.dtype_bytes * self._experts_read(tokens),
                             self._flops, self._bw)
        # vLLM's default all2all (allgather_reducescatter): both ways (dp - 1) / dp of the group's
        # hidden states through each device's link, plus a collective's latency, per MoE layer
        moved = (self.dp - 1) / self.dp * tokens * self.model.hidden_size * self.model.dtype_bytes / self._ic_bw
        return float(experts) + self._moe_layers * 2 * (self.allreduce_latency_s + moved)

    def _experts_read(self, tokens: ArrayLike) -> ArrayLike:
        """Expected distinct experts per MoE layer for `tokens` tokens (a table lookup: the scalar and
        the vectorised paths read the same float)."""
        last = len(self._distinct) - 1
        if isinstance(tokens, np.ndarray):
            return self._distinct[np.minimum(tokens, last).astype(np.int64)]
        return float(self._distinct[int(min(tokens, last))])

    def _attention(self, pairs: ArrayLike, context: ArrayLike, tokens: ArrayLike) -> ArrayLike:
        """Query-key pairs scored, cached tokens read, new tokens' q/k/v/o moved."""
        return self._roof(self._attn_flops_per_pair * pairs,
                          self._kv_bytes * context + self._qkvo_bytes * tokens,
                          self._attn_flops, self._attn_bw)

    def _lm_head(self, sampled: ArrayLike) -> ArrayLike:
        return self._roof(2 * self._lm_params * sampled,
                          self._lm_params * self.model.dtype_bytes + self._logit_bytes * sampled,
                          self._flops, self._bw)

    def _allreduce(self, tokens: ArrayLike) -> ArrayLike:
        if self.tp == 1:
            return 0.0 * tokens
        return 2 * self.model.num_layers * (self.allreduce_latency_s + self._allreduce_bytes * tokens / self._ic_bw)

    def _groups(self, pf_seqs: float, pf_tokens: float, pf_pairs: float, pf_ctx: float, dec_seqs: float,
                dec_ctx: float, swap_blocks: float, copy_blocks: float, block_size: int) -> dict[str, float]:
        """Seconds per operator group of one iteration."""
        tokens = pf_tokens + dec_seqs
        sampled = pf_seqs + dec_seqs
        block_bytes = self._kv_bytes * block_size
        busy = tokens > 0 or swap_blocks > 0
        return {
            "overhead": self.overhead_s if busy else 0.0,
            "linear": self._linear(tokens) if tokens > 0 else 0.0,
            "prefill_attn": self._attention(pf_pairs, pf_ctx, pf_tokens) if pf_tokens > 0 else 0.0,
            # a decode scores its whole context, new token included, once
            "decode_attn": self._attention(dec_ctx, dec_ctx, dec_seqs) if dec_seqs > 0 else 0.0,
            "lm_head": self._lm_head(sampled) if sampled > 0 else 0.0,
            "allreduce": self._allreduce(tokens) if tokens > 0 else 0.0,
            "swap": self.swap_time(swap_blocks, block_size),
            "copy": copy_blocks * 2 * block_bytes / self._bw if busy else 0.0,
        }

    @staticmethod
    def _total(groups: dict[str, ArrayLike]) -> ArrayLike:
        total = 0.0
        for t in groups.values():  # fixed order, so both entry points round identically
            total = total + t
        return total

    # --- public API ---------------------------------------------------------------------------------

    def _composition_groups(self, c: StepComposition) -> dict[str, ArrayLike]:
        f = float
        return self._groups(f(c.num_prefill_seqs), f(c.prefill_tokens), f(c.prefill_attn_pairs),
                            f(c.prefill_context_tokens), f(c.num_decode_seqs), f(c.decode_context_tokens),
                            f(c.swap_in_blocks + c.swap_out_blocks), f(c.copy_blocks), c.block_size)

    def breakdown(self, c: StepComposition) -> dict[str, float]:
        """Seconds per operator group for `c` (they sum to `step_time(c)`)."""
        return {k: float(v) for k, v in self._composition_groups(c).items()}

    def step_time(self, c: StepComposition) -> float:
        if c.is_empty:
            return 0.0
        if not (c.num_prefill_seqs or c.swap_in_blocks or c.swap_out_blocks or c.copy_blocks):
            return self.decode_step_time(c.num_decode_seqs, c.decode_context_tokens)
        if self._float_path:
            return self._float_step_time(c)
        return float(self._total(self._composition_groups(c)))

    def _float_step_time(self, c: StepComposition) -> float:
        """_total(_composition_groups(c)) of a dense model for floats: each group's IEEE operations
        (_linear, _attention, _lm_head, _allreduce, swap_time, copy) in the same order, added in
        _groups' order from 0.0, without the dict and the generic (array-or-float) arithmetic that
        the compiled kernel runs them by. A group that is absent adds 0.0 there, which leaves a
        total that is never -0.0 as it is: it is skipped here."""
        pf_seqs, pf_tokens = float(c.num_prefill_seqs), float(c.prefill_tokens)
        pf_pairs, pf_ctx = float(c.prefill_attn_pairs), float(c.prefill_context_tokens)
        dec_seqs, dec_ctx = float(c.num_decode_seqs), float(c.decode_context_tokens)
        swap_blocks, copy_blocks = float(c.swap_in_blocks + c.swap_out_blocks), float(c.copy_blocks)
        tokens = pf_tokens + dec_seqs
        sampled = pf_seqs + dec_seqs
        busy = tokens > 0 or swap_blocks > 0
        flops, bw, attn_flops, attn_bw = self._flops, self._bw, self._attn_flops, self._attn_bw
        d = self.model.dtype_bytes
        total = 0.0 + (self.overhead_s if busy else 0.0)
        if tokens > 0:  # _linear
            p = self._linear_params
            total = total + max(2 * p * tokens / flops, (p * d + self._linear_act_bytes * tokens) / bw)
        if pf_tokens > 0:  # _attention(pf_pairs, pf_ctx, pf_tokens)
            total = total + max(self._attn_flops_per_pair * pf_pairs / attn_flops,
                                (self._kv_bytes * pf_ctx + self._qkvo_bytes * pf_tokens) / attn_bw)
        if dec_seqs > 0:  # _attention(dec_ctx, dec_ctx, dec_seqs)
            total = total + max(self._attn_flops_per_pair * dec_ctx / attn_flops,
                                (self._kv_bytes * dec_ctx + self._qkvo_bytes * dec_seqs) / attn_bw)
        if sampled > 0:  # _lm_head
            lm = self._lm_params
            total = total + max(2 * lm * sampled / flops, (lm * d + self._logit_bytes * sampled) / bw)
        if tokens > 0 and self.tp > 1:  # _allreduce (0.0 * tokens on one GPU)
            total = total + 2 * self.model.num_layers * (self.allreduce_latency_s
                                                         + self._allreduce_bytes * tokens / self._ic_bw)
        total = total + self.swap_time(swap_blocks, c.block_size)
        block_bytes = self._kv_bytes * c.block_size
        return total + (copy_blocks * 2 * block_bytes / bw if busy else 0.0)

    def decode_step_time(self, num_seqs: int, context_tokens: int) -> float:
        if num_seqs <= 0:
            return 0.0
        if self._expert_params or self.tp > 1:
            return self._decode_time(float(num_seqs), float(context_tokens))
        fixed, lm = self._decode_terms(num_seqs)
        return fixed + self._decode_attention(float(context_tokens), float(num_seqs)) + lm

    def decode_step_series(self, num_seqs: int, context0: int, steps: int) -> list[float]:
        if num_seqs <= 0 or self._expert_params or self.tp > 1:
            return super().decode_step_series(num_seqs, context0, steps)
        # the terms of one batch size are the same in every iteration: priced once, added in order
        fixed, lm = self._decode_terms(num_seqs)
        # _decode_attention(float(c), seqs) written out (a bound method is a generic call compiled):
        # the same IEEE operations, qkvo * seqs the same product in every iteration
        seqs = float(num_seqs)
        per_pair, attn_flops, kv, attn_bw = self._attn_flops_per_pair, self._attn_flops, self._kv_bytes, self._attn_bw
        qkvo = self._qkvo_bytes * seqs
        out: list[float] = []
        for j in range(1, steps + 1):
            c = float(context0 + num_seqs * j)
            out.append(fixed + max(per_pair * c / attn_flops, (kv * c + qkvo) / attn_bw) + lm)
        return out

    def series_steps(self) -> int:
        # a dense model's own series prices the batch size's terms once (see __init__)
        return 64 if self._expert_params or self.tp > 1 else self._series_steps

    def _decode_terms(self, num_seqs: int) -> tuple[float, float]:
        """(overhead + linear, lm_head) of a dense model's pure decode of `num_seqs` sequences."""
        terms = self._decode_terms_memo.get(num_seqs)
        if terms is None:
            seqs = float(num_seqs)
            terms = self._decode_terms_memo[num_seqs] = (self._decode_fixed(seqs), self._lm_head(seqs))
        return terms

    def _decode_fixed(self, seqs: float) -> float:
        """overhead + linear of a dense model's pure decode, for a float: the first two terms of
        _decode_time's sum."""
        return self.overhead_s + self._linear(seqs)

    def _decode_attention(self, ctx: float, seqs: float) -> float:
        """_attention(ctx, ctx, seqs) for floats, without its calls (the same IEEE operations)."""
        a = self._attn_flops_per_pair * ctx / self._attn_flops
        b = (self._kv_bytes * ctx + self._qkvo_bytes * seqs) / self._attn_bw
        return max(a, b)

    def _decode_time(self, seqs: ArrayLike, ctx: ArrayLike) -> ArrayLike:
        """step_time of pure decodes (floats or arrays), most of a simulation's pricing: _groups +
        _total with the zero groups left out (adding 0.0 to a positive time is exact)."""
        total = self.overhead_s + self._linear(seqs) + self._attention(ctx, ctx, seqs) + self._lm_head(seqs)
        if self.tp > 1:
            total = total + self._allreduce(seqs)
        return total

    def decode_step_times(self, num_seqs: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        seqs = np.asarray(num_seqs, dtype=np.float64)
        ctx = np.asarray(context_tokens, dtype=np.float64)
        seqs, ctx = np.broadcast_arrays(seqs, ctx)
        return np.where(seqs > 0, self._decode_time(seqs, ctx), 0.0)

    def swap_time(self, num_blocks: float, block_size: int) -> float:
        """Each block: 2 x layers copy calls (keys and values of every layer), then its bytes."""
        per_block = 2 * self.model.num_layers * self.memcpy_latency_s + block_size * self._kv_bytes / self._pcie_bw
        return num_blocks * per_block
