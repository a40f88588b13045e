"""Paged attention backends: Triton kernels on CUDA, plain torch on CPU.

`get_attention(device, name=None)` returns a `paged_attention(q, k, v, k_cache, v_cache, meta, scale)`
function; `name` ("torch" | "torch-compiled" | "triton") or the `PAGESIM_ATTENTION` environment
variable overrides the choice. The default is "triton" on CUDA and "torch-compiled" on CPU: the
torch path with its decodes fused by torch.compile (`compiled_decode`; it needs a C++ compiler at
first use and falls back to "torch" without one). Triton is imported only when chosen, so CPU runs
(and `TRITON_INTERPRET=1` tests that must set the variable before the first import) are unaffected.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from backend.attention.metadata import AttentionMetadata

BACKENDS = ("torch", "torch-compiled", "triton")

__all__ = ["BACKENDS", "AttentionMetadata", "default_backend", "get_attention"]


def default_backend(device: str | torch.device) -> str:
    env = os.environ.get("PAGESIM_ATTENTION")
    if env:
        return env
    return "triton" if torch.device(device).type == "cuda" else "torch-compiled"


def get_attention(device: str | torch.device, name: str | None = None) -> Callable[..., torch.Tensor]:
    name = name or default_backend(device)
    if name == "torch":
        from backend.attention import torch_paged
        return torch_paged.paged_attention
    if name == "torch-compiled":
        from backend.attention import compiled_decode
        return compiled_decode.paged_attention
    if name == "triton":
        from backend.attention import triton_kernels
        return triton_kernels.paged_attention
    raise ValueError(f"unknown attention backend {name!r}; known: {list(BACKENDS)}")
