"""Transformer shapes: `ModelSpec`, one type for the simulator's cost models and the live backend.

A spec is pure data: enough to count parameters, bytes and FLOPs, and (for the dense Llama family
and OPT) to build the model. Families:

- arch "opt": learned positions, LayerNorm (weight + bias), biases on every linear, 2-matrix ReLU MLP.
- arch "llama": rotary positions (no parameters), RMSNorm (weight only), 3-matrix SwiGLU MLP,
  grouped-query attention when num_kv_heads < num_heads. Variants by flag: `attention_bias` (q, k
  and v biases: Qwen2), `qk_norm` (RMSNorm of each head's q and k: Qwen3), mixture of experts
  (`num_experts` > 0: Mixtral, Qwen3-MoE, DeepSeek), multi-head latent attention (`kv_lora_rank` > 0:
  DeepSeek-V2/V3).

Invariants (checked on construction; a violation raises ValueError "<name>: <field>: ...", or from a
config file "<file>: <config.json key> (<field>): ..."):
positive sizes; num_heads a multiple of num_kv_heads; an even rotary dimension; OPT has
num_heads * head_dim == hidden_size and no GQA, MoE or MLA; a MoE spec has 0 < experts_per_token <=
num_experts, a positive expert width and num_dense_layers < num_layers; a dense spec has no expert
fields; an MLA spec has head_dim == qk_nope_head_dim + qk_rope_head_dim and a positive v_head_dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import specs.hf_config as hf_config

ARCHS = ("llama", "opt")

_POSITIVE = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
             "vocab_size", "max_position")
_NON_NEGATIVE = ("num_experts", "experts_per_token", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "num_dense_layers", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                 "v_head_dim")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and constants of a decoder-only transformer (see the module docstring).

    MoE: `num_experts` routed experts of FFN width `moe_intermediate_size`, `experts_per_token` (top-k)
    of them per token, plus always-on shared experts of total width `shared_expert_intermediate_size`;
    the first `num_dense_layers` layers have a dense MLP of `intermediate_size` instead (DeepSeek's
    first_k_dense_replace). 0 experts = a dense model, and then num_dense_layers is 0 too.
    MLA: queries through an optional low-rank `q_lora_rank`; keys and values from one cached latent of
    `kv_lora_rank` plus a shared rotary key of `qk_rope_head_dim` per token; per head, q/k have
    `qk_nope_head_dim + qk_rope_head_dim` (= head_dim) and v has `v_head_dim`.
    `rope_scaling` names a RoPE variant beyond plain rotary ("llama3", "yarn"; "" = plain).
    `norm_eps` is the RMSNorm epsilon (llama) or the LayerNorm epsilon (OPT).
    `source` says where the spec was read from (not part of equality).
    """

    name: str
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    dtype_bytes: int = 2
    kv_dtype_bytes: int = 0  # bytes of one cached key/value element; 0: as the weights (an fp8 checkpoint keeps a bf16 cache)
    tied_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_dense_layers: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: str = ""
    norm_eps: float = 1e-5
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise ValueError(f"{self.name or 'model'}: {problem}")

    def _problem(self) -> str:
        """The first violated invariant as "<field>: why", or ""."""
        if self.arch not in ARCHS:
            return f"arch: {self.arch!r} is not one of {ARCHS}"
        for f in _POSITIVE:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                return f"{f}: must be a positive int, got {v!r}"
        for f in _NON_NEGATIVE:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                return f"{f}: must be an int >= 0, got {v!r}"
        if self.dtype_bytes not in (1, 2, 4):
            return f"dtype_bytes: must be 1, 2 or 4, got {self.dtype_bytes!r}"
        if self.kv_dtype_bytes not in (0, 1, 2, 4):
            return f"kv_dtype_bytes: must be 0 (as dtype_bytes), 1, 2 or 4, got {self.kv_dtype_bytes!r}"
        if self.num_heads % self.num_kv_heads:
            return (f"num_kv_heads: num_heads {self.num_heads} is not a multiple of "
                    f"num_kv_heads {self.num_kv_heads}")
        if not self.norm_eps > 0:
            return f"norm_eps: must be > 0, got {self.norm_eps}"
        for f in ("bos_token_id", "eos_token_id"):
            v = getattr(self, f)
            if v is not None and not 0 <= v < self.vocab_size:
                return f"{f}: {v} outside the vocabulary [0, {self.vocab_size})"
        return self._arch_problem() or self._moe_problem() or self._mla_problem()

    def _arch_problem(self) -> str:
        if self.arch == "llama":
            rotary = self.qk_rope_head_dim if self.is_mla else self.head_dim
            if rotary % 2:
                return f"head_dim: rotary embeddings need an even dimension, got {rotary}"
            if not self.rope_theta > 0:
                return f"rope_theta: must be > 0, got {self.rope_theta}"
            return ""
        if self.num_heads * self.head_dim != self.hidden_size:
            return (f"head_dim: OPT needs num_heads * head_dim == hidden_size "
                    f"({self.num_heads} * {self.head_dim} != {self.hidden_size})")
        if self.num_kv_heads != self.num_heads:
            return f"num_kv_heads: OPT has no GQA, must equal num_heads {self.num_heads}"
        if self.is_moe or self.is_mla or self.qk_norm:
            return "arch: OPT has no experts, latent attention or q/k norms"
        return ""

    def _moe_problem(self) -> str:
        if not self.is_moe:
            for f in ("experts_per_token", "moe_intermediate_size", "shared_expert_intermediate_size",
                      "num_dense_layers"):
                if getattr(self, f):
                    return f"{f}: set on a dense model (num_experts 0)"
            return ""
        if not 0 < self.experts_per_token <= self.num_experts:
            return f"experts_per_token: must be in 1..num_experts {self.num_experts}, got {self.experts_per_token}"
        if not self.moe_intermediate_size:
            return "moe_intermediate_size: a mixture-of-experts model needs the experts' width"
        if self.num_dense_layers >= self.num_layers:
            return f"num_dense_layers: {self.num_dense_layers} leaves no MoE layer of {self.num_layers}"
        return ""

    def _mla_problem(self) -> str:
        if not self.is_mla:
            for f in ("q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
                if getattr(self, f):
                    return f"{f}: set without kv_lora_rank (latent attention)"
            return ""
        for f in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if not getattr(self, f):
                return f"{f}: latent attention (kv_lora_rank {self.kv_lora_rank}) needs it > 0"
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            return (f"head_dim: latent attention needs head_dim == qk_nope_head_dim + qk_rope_head_dim, "
                    f"got {self.head_dim}")
        return ""

    # --- construction -----------------------------------------------------------------------------

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str, source: str = "") -> ModelSpec:
        """A spec from a HF `config.json` dict (specs/hf_config.py lists the supported model types)."""
        fields = hf_config.spec_fields(cfg, name, source)
        try:
            return cls(**fields)
        except ValueError as e:
            raise hf_config.hf_field_error(e, name or "model", source or name) from None

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict describing the same model (`from_hf_config` reads it back equal)."""
        return hf_config.to_hf_config(self)

    # --- kinds ------------------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    # --- widths -----------------------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of one token's key (or value) in one layer; MLA: of its one cached latent."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.num_kv_heads * self.head_dim

    # --- parameter counts -------------------------------------------------------------------------

    @property
    def attn_params_per_layer(self) -> int:
        """q, k, v and output projections, their biases (OPT: all four; Qwen2: q, k, v) and q/k norms.
        MLA: q (direct, or down + norm + up), the latent-and-rotary-key down projection and its norm,
        the latent's up projection to per-head keys and values, and the output projection."""
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        if self.is_mla:
            heads, r = self.num_heads, self.kv_lora_rank
            q_proj = h * q if not self.q_lora_rank else h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q
            kv_down = h * (r + self.qk_rope_head_dim) + r
            kv_up = r * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q_proj + kv_down + kv_up + heads * self.v_head_dim * h
        weights = h * q + 2 * h * kv + q * h
        if self.arch == "opt":
            biases = q + 2 * kv + h
        else:
            biases = q + 2 * kv if self.attention_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return weights + biases + norms

    @property
    def dense_mlp_params_per_layer(self) -> int:
        """A dense MLP of intermediate_size: fc1/fc2 with biases (OPT) or gate/up/down (SwiGLU)."""
        h, f = self.hidden_size, self.intermediate_size
        if self.arch == "opt":
            return 2 * h * f + f + h
        return 3 * h * f

    @property
    def expert_params(self) -> int:
        """One routed expert (SwiGLU of moe_intermediate_size); 0 for a dense model."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def router_params_per_layer(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def shared_expert_params_per_layer(self) -> int:
        return 3 * self.hidden_size * self.shared_expert_intermediate_size

    @property
    def moe_mlp_params_per_layer(self) -> int:
        """Every weight of one MoE layer's MLP: all routed experts, the router, the shared experts."""
        return self.num_experts * self.expert_params + self.router_params_per_layer + self.shared_expert_params_per_layer

    @property
    def mlp_params_per_layer(self) -> int | float:
        """MLP weights per layer: the dense MLP; for MoE the mean over layers of all their MLP weights
        (every expert), so that num_layers * mlp_params_per_layer is the model's MLP total."""
        if not self.is_moe:
            return self.dense_mlp_params_per_layer
        return _mean(self._mlp_params_total, self.num_layers)

    @property
    def norm_params_per_layer(self) -> int:
        """Two norms per layer: LayerNorm has weight and bias, RMSNorm only a weight."""
        return 2 * self._norm_params

    @property
    def params_per_layer(self) -> int | float:
        """Weights of one layer (for MoE the mean over layers, all experts counted)."""
        return self.attn_params_per_layer + self.mlp_params_per_layer + self.norm_params_per_layer

    @property
    def embedding_params(self) -> int:
        """Token embeddings plus, for OPT, learned positions (OPT offsets positions by 2)."""
        tokens = self.vocab_size * self.hidden_size
        positions = (self.max_position + 2) * self.hidden_size if self.arch == "opt" else 0
        return tokens + positions

    @property
    def lm_head_params(self) -> int:
        """Separate output projection; zero when tied to the token embeddings."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Every weight, each routed expert included (embeddings once when tied)."""
        layers = self.num_layers * (self.attn_params_per_layer + self.norm_params_per_layer) + self._mlp_params_total
        return self.embedding_params + layers + self._norm_params + self.lm_head_params  # + final norm

    @property
    def active_params_per_token(self) -> int:
        """Weights one token is multiplied by: attention, norms, dense MLPs, and in MoE layers the
        router, the shared experts and experts_per_token routed experts; then the lm head. The
        embedding lookup is not a multiply, so for a dense model this is num_params - embedding_params
        (published "activated parameters" usually count the embeddings too)."""
        moe = self.router_params_per_layer + self.shared_expert_params_per_layer \
            + self.experts_per_token * self.expert_params
        mlp = self._num_dense_mlp_layers * self.dense_mlp_params_per_layer + self.num_moe_layers * moe
        layers = self.num_layers * (self.attn_params_per_layer + self.norm_params_per_layer) + mlp
        return layers + self._norm_params + self.lm_head_params

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache of one token across all layers: key and value per KV head, or for MLA the one
        latent (kv_lora_rank + qk_rope_head_dim) that all heads share."""
        per_layer = self.kv_size if self.is_mla else 2 * self.kv_size
        return self.num_layers * per_layer * (self.kv_dtype_bytes or self.dtype_bytes)

    @property
    def attn_flops_per_pair_per_layer(self) -> int:
        """FLOPs of one query-key pair in one layer: QK^T and PV, 2 per multiply-add, over all heads.
        MLA scores with (nope + rope)-wide keys and mixes v_head_dim-wide values."""
        if self.is_mla:
            return 2 * self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim) \
                + 2 * self.num_heads * self.v_head_dim
        return 4 * self.num_heads * self.head_dim

    @property
    def _num_dense_mlp_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def _mlp_params_total(self) -> int:
        return (self._num_dense_mlp_layers * self.dense_mlp_params_per_layer
                + self.num_moe_layers * self.moe_mlp_params_per_layer)

    @property
    def _norm_params(self) -> int:
        return 2 * self.hidden_size if self.arch == "opt" else self.hidden_size


def _mean(total: int, n: int) -> int | float:
    """total / n, as an int when it divides exactly (dense models keep integer counts)."""
    q, r = divmod(total, n)
    return q if r == 0 else total / n
