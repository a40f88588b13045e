"""Model architectures running on the paged KV cache."""

from __future__ import annotations

from torch import nn

from backend.config import ModelConfig


def build_model(config: ModelConfig) -> nn.Module:
    """An uninitialised model for `config.arch` ("llama" | "opt")."""
    if config.arch == "llama":
        from backend.models.llama import LlamaForCausalLM
        return LlamaForCausalLM(config)
    if config.arch == "opt":
        from backend.models.opt import OPTForCausalLM
        return OPTForCausalLM(config)
    raise ValueError(f"unknown arch {config.arch!r}; known: ['llama', 'opt']")
