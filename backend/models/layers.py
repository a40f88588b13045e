"""Building blocks shared by the models: the forward context, paged attention layer, RMSNorm and
rotary embeddings (HF's rotate-half convention, float32 tables).

Activations are flat: [T, hidden] for T tokens from several sequences.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from backend.attention.metadata import AttentionMetadata
from backend.kv_cache import PagedKVCache


@dataclass
class ForwardContext:
    """Everything a forward pass needs besides token ids and positions."""

    meta: AttentionMetadata
    kv_cache: PagedKVCache
    attention: Callable[..., torch.Tensor]


class PagedAttention(nn.Module):
    """Stores this step's K/V into the paged cache, then attends through the block tables."""

    def __init__(self, layer: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.layer, self.num_heads, self.num_kv_heads = layer, num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        cache = ctx.kv_cache
        cache.store(self.layer, k, v, ctx.meta.slot_mapping, ctx.meta.per_step)
        o = ctx.attention(q, k, v, cache.key_cache(self.layer), cache.value_cache(self.layer), ctx.meta,
                          self.scale)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_position, head_dim] (float32), computed as HF does."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.theta = head_dim, max_position, theta
        self.register_buffer("cos", torch.empty(max_position, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_position, head_dim), persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)compute the tables on the buffers' device (also after `to_empty`)."""
        if self.cos.is_meta:
            return
        dev, d = self.cos.device, self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=dev).float() / d))
        freqs = torch.arange(self.max_position, dtype=torch.float32, device=dev)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, head_dim] in `dtype`."""
        return self.cos[positions].to(dtype)[:, None], self.sin[positions].to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n, D] rotated by position: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@torch.no_grad()
def prepack_linears(model: nn.Module) -> nn.Module:
    """CPU float32: swap every nn.Linear for oneDNN's prepacked one (torch.utils.mkldnn), which streams
    weights from memory faster at serving batch sizes (benchmarks/profile_live_step.py); a tied head
    gets its own prepacked copy of the embedding. Results differ from the dense path only by
    float rounding (accumulation order)."""
    if getattr(model, "lm_head", False) is None:  # tied: the head reads the embedding
        emb = model.embed_tokens.weight
        head = nn.Linear(emb.shape[1], emb.shape[0], bias=False)
        head.weight.copy_(emb)
        model.lm_head = head

    def swap(mod: nn.Module) -> None:
        for name, child in mod.named_children():
            if isinstance(child, nn.Linear):
                setattr(mod, name, mkldnn.to_mkldnn(child))
            else:
                swap(child)

    with warnings.catch_warnings():  # its modules are TorchScript ones, which torch now calls deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.utils import mkldnn
        swap(model)
    return model


class WeightReader:
    """Hands out HF-named weights for loading; `finish()` raises if any were never taken, so a
    checkpoint that does not match the architecture fails loudly instead of loading partly."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights
        self.used: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise KeyError(f"missing weight {name!r}")
        self.used.add(name)
        return self.weights[name]

    def finish(self) -> None:
        extra = set(self.weights) - self.used
        if extra:
            raise KeyError(f"unexpected weights: {sorted(extra)[:5]}")
