"""OPT decoder (pre-LayerNorm, learned positions with OPT's offset of 2, ReLU MLP, biases) on the
paged cache. Covers opt-125m ... opt-66b (not opt-350m's projection / post-LN variant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.config import ModelConfig
from backend.models.layers import ForwardContext, PagedAttention, WeightReader

POSITION_OFFSET = 2  # OPT's learned position table starts at row 2


class OPTAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.h, self.d = config.num_heads, config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.q_size, bias=True)
        self.out_proj = nn.Linear(config.q_size, config.hidden_size, bias=True)
        self.attn = PagedAttention(layer, self.h, self.h, self.d, self.d ** -0.5)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).view(T, 3, self.h, self.d).unbind(1)
        return self.out_proj(self.attn(q, k, v, ctx))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn_layer_norm = nn.LayerNorm(h, eps=config.norm_eps)
        self.self_attn = OPTAttention(config, layer)
        self.final_layer_norm = nn.LayerNorm(h, eps=config.norm_eps)
        self.fc1 = nn.Linear(h, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, h)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), ctx)
        return x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))


class OPTForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], ctx) -> logits [len(ctx.meta.sample_rows), vocab]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_positions = nn.Embedding(config.max_position + POSITION_OFFSET, h)
        self.layers = nn.ModuleList(OPTDecoderLayer(config, i) for i in range(config.num_layers))
        self.final_layer_norm = nn.LayerNorm(h, eps=config.norm_eps)
        self.lm_head = None if config.tied_embeddings else nn.Linear(h, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids) + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x, ctx)
        x = self.final_layer_norm(x[ctx.meta.sample_rows])
        return F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in (fusing q/k/v). Missing or unexpected names raise."""
        take = WeightReader(weights)
        d = "model.decoder."
        self.embed_tokens.weight.copy_(take(d + "embed_tokens.weight"))
        self.embed_positions.weight.copy_(take(d + "embed_positions.weight"))
        self.final_layer_norm.weight.copy_(take(d + "final_layer_norm.weight"))
        self.final_layer_norm.bias.copy_(take(d + "final_layer_norm.bias"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"{d}layers.{i}."
            a = layer.self_attn
            for kind in ("weight", "bias"):
                getattr(a.qkv_proj, kind).copy_(torch.cat([take(p + f"self_attn.{x}_proj.{kind}") for x in "qkv"]))
                getattr(a.out_proj, kind).copy_(take(p + f"self_attn.out_proj.{kind}"))
                for mod in ("self_attn_layer_norm", "final_layer_norm", "fc1", "fc2"):
                    getattr(getattr(layer, mod), kind).copy_(take(p + f"{mod}.{kind}"))
        take.finish()
