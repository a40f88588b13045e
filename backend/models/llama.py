"""Llama-family decoder (RMSNorm, rotary, GQA, SwiGLU, tied or untied head) on the paged cache.

HF weight names are loaded with q/k/v fused into one projection and gate/up into another.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.config import ModelConfig
from backend.models.layers import (
    ForwardContext,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    WeightReader,
    apply_rotary,
)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.h, self.hkv, self.d = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=False)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.attn = PagedAttention(layer, self.h, self.hkv, self.d, self.d ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = apply_rotary(q.view(T, self.h, self.d), cos, sin)
        k = apply_rotary(k.view(T, self.hkv, self.d), cos, sin)
        return self.o_proj(self.attn(q, k, v.view(T, self.hkv, self.d), ctx))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], ctx) -> logits [len(ctx.meta.sample_rows), vocab]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = None if config.tied_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position, config.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        x = self.norm(x[ctx.meta.sample_rows])
        return F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in (fusing q/k/v and gate/up). Missing or unexpected names raise."""
        take = WeightReader(weights)
        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
            a = layer.self_attn
            a.qkv_proj.weight.copy_(torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"]))
            a.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
            m = layer.mlp
            m.gate_up_proj.weight.copy_(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            m.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
        take.finish()
