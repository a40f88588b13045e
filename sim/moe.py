"""Per-layer weight shapes of a model as a cost model prices them, mixture-of-experts included.

`LayerShapes.of(model)` reads a `ModelSpec`; the MoE properties (is_moe, num_moe_layers, ...) are
read with getattr and dense defaults, so a spec without them prices as a dense model.

Mixture of experts (top-k routing over E experts): per MoE layer and iteration of T tokens,
- every token passes through k experts: FLOPs = 2 * T * k * expert_params;
- each expert that at least one token picked is read from memory once. With each token's k picks
  spread uniformly, one expert is missed by all T tokens with probability (1 - k/E)^T, so the
  expected number of distinct experts read is E * (1 - (1 - k/E)^T): k at T = 1, E as T grows;
- shared experts and the router are read and run for every token.
Expert parallelism over `ep` devices: each device holds E/ep experts and reads the distinct ones it
holds (E_distinct/ep in expectation) and runs T*k/ep expert passes; attention stays tensor-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def expected_distinct_experts(tokens: float, num_experts: int, top_k: int) -> float:
    """E * (1 - (1 - k/E)^T): experts that T tokens with top-k routing touch, in expectation."""
    if num_experts <= 0 or top_k <= 0:
        return 0.0
    if top_k >= num_experts:
        return float(num_experts) if tokens > 0 else 0.0
    return float(num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens))


def distinct_experts_table(num_experts: int, top_k: int, max_tokens: int = 1 << 16) -> np.ndarray:
    """expected_distinct_experts for T = 0..n-1, stopping where it has reached E in float64 (index
    with min(T, len - 1)). A table, so scalar and vectorised pricing read the very same numbers."""
    if num_experts <= 0 or top_k <= 0:
        return np.zeros(1)
    t = np.arange(max_tokens, dtype=np.float64)
    table = num_experts * (1.0 - np.power(1.0 - min(top_k, num_experts) / num_experts, t))
    done = np.flatnonzero(table >= num_experts)
    return table[: done[0] + 1].copy() if done.size else table


@dataclass(frozen=True)
class LayerShapes:
    """Parameter counts summed over layers (whole model, before tensor parallelism)."""

    num_layers: int
    attn_params: int           # q, k, v, o projections of every layer
    dense_mlp_params: int      # MLPs of the dense layers (+ norms: a rounding error, counted here)
    moe_layers: int
    num_experts: int
    top_k: int
    expert_params: int         # one expert of one layer
    shared_params: int         # shared experts + router, summed over MoE layers (run for every token)
    moe_intermediate: int      # one expert's intermediate width
    attn_flops_per_pair: float  # FLOPs per query-key pair, summed over layers (MLA aware)

    @property
    def is_moe(self) -> bool:
        return self.moe_layers > 0 and self.num_experts > 0

    @property
    def dense_params(self) -> int:
        """Weights every token runs through: attention, dense MLPs, shared experts, routers."""
        return self.attn_params + self.dense_mlp_params + self.shared_params

    @staticmethod
    def of(model: object) -> LayerShapes:
        L = int(model.num_layers)
        moe_layers = int(getattr(model, "num_moe_layers", 0) or 0) if getattr(model, "is_moe", False) else 0
        dense_layers = L - moe_layers  # (a spec's num_dense_layers counts only MoE models' leading dense layers)
        norms = getattr(model, "norm_params_per_layer", 0)
        dense_mlp = getattr(model, "dense_mlp_params_per_layer", None)
        if dense_mlp is None:
            dense_mlp = model.mlp_params_per_layer
        shared = moe_layers * (int(getattr(model, "shared_expert_params_per_layer", 0) or 0)
                               + int(getattr(model, "router_params_per_layer", 0) or 0))
        per_pair = getattr(model, "attn_flops_per_pair_per_layer", None)
        if per_pair is None:
            per_pair = 4 * model.q_size  # QK^T and PV: 2 FLOPs each per head dim
        return LayerShapes(
            num_layers=L, attn_params=L * int(model.attn_params_per_layer),
            dense_mlp_params=dense_layers * int(dense_mlp) + L * int(norms),
            moe_layers=moe_layers, num_experts=int(getattr(model, "num_experts", 0) or 0) if moe_layers else 0,
            top_k=int(getattr(model, "experts_per_token", 0) or 0) if moe_layers else 0,
            expert_params=int(getattr(model, "expert_params", 0) or 0) if moe_layers else 0,
            shared_params=shared, moe_intermediate=int(getattr(model, "moe_intermediate_size", 0) or 0),
            attn_flops_per_pair=float(L * per_pair))
