"""Model shapes: `ModelConfig`, named presets and conversion from a HF `config.json`.

A config is pure data (no torch): the simulator-side cost models and the live backend can both read
it. Invariants checked on construction: positive sizes, `num_heads % num_kv_heads == 0`, an even
`head_dim` for rotary models, OPT's `hidden_size == num_heads * head_dim` and
`num_kv_heads == num_heads`. A violation raises ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ARCHS = ("llama", "opt")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder-only transformer.

    `norm_eps` is the RMSNorm epsilon for llama and the LayerNorm epsilon for OPT.
    `max_position` is the longest supported context (OPT's learned table has 2 extra rows).
    """

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    name: str = ""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch: {self.arch!r} is not one of {ARCHS}")
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "max_position"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{f}: must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps: must be > 0, got {self.norm_eps}")
        for f in ("bos_token_id", "eos_token_id"):
            v = getattr(self, f)
            if v is not None and not 0 <= v < self.vocab_size:
                raise ValueError(f"{f}: {v} outside the vocabulary [0, {self.vocab_size})")
        if self.arch == "llama":
            if self.head_dim % 2:
                raise ValueError(f"head_dim: rotary embeddings need an even head_dim, got {self.head_dim}")
            if self.rope_theta <= 0:
                raise ValueError(f"rope_theta: must be > 0, got {self.rope_theta}")
        else:
            if self.num_heads * self.head_dim != self.hidden_size:
                raise ValueError(f"head_dim: OPT needs num_heads * head_dim == hidden_size "
                                 f"({self.num_heads} * {self.head_dim} != {self.hidden_size})")
            if self.num_kv_heads != self.num_heads:
                raise ValueError(f"num_kv_heads: OPT has no GQA, must equal num_heads {self.num_heads}")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def num_params(self) -> int:
        """Parameter count (embeddings included once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.arch == "llama":
            layer = attn + 3 * h * i + 2 * h
            extra = h
        else:
            layer = attn + 2 * self.kv_size + 2 * self.q_size + 2 * h * i + i + h + 4 * h
            extra = (self.max_position + 2) * h + 2 * h
        head = 0 if self.tie_embeddings else v * h
        return v * h + self.num_layers * layer + extra + head

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- conversions ---------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """A preset by name (see `PRESETS`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model config {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from a HF `config.json` dict (model_type llama/mistral or opt)."""
        mt = cfg.get("model_type")
        if mt in ("llama", "mistral"):
            return _llama_from_hf(cfg, name)
        if mt == "opt":
            return _opt_from_hf(cfg, name)
        raise ValueError(f"model_type: {mt!r} is not supported; supported: ['llama', 'mistral', 'opt']")

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict describing the same model (for tests and export)."""
        if self.arch == "llama":
            return {
                "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": self.num_layers, "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
                "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position,
                "rope_theta": self.rope_theta, "rms_norm_eps": self.norm_eps,
                "tie_word_embeddings": self.tie_embeddings, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False,
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            }
        return {
            "model_type": "opt", "architectures": ["OPTForCausalLM"],
            "num_hidden_layers": self.num_layers, "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads, "ffn_dim": self.intermediate_size,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position,
            "word_embed_proj_dim": self.hidden_size, "do_layer_norm_before": True,
            "activation_function": "relu", "enable_bias": True, "layer_norm_elementwise_affine": True,
            "tie_word_embeddings": self.tie_embeddings, "dropout": 0.0, "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": 1,
        }


def _rope_theta(cfg: dict[str, Any]) -> float:
    rp = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or rp
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in ("default", None):
        raise ValueError(f"rope_scaling: rope type {kind!r} is not supported (only 'default')")
    return float(cfg.get("rope_theta", rp.get("rope_theta", 10000.0)))


def _llama_from_hf(cfg: dict[str, Any], name: str) -> ModelConfig:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("attention_bias: llama models with biases are not supported")
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    return ModelConfig(
        arch="llama", num_layers=cfg["num_hidden_layers"], hidden_size=hidden, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        max_position=cfg.get("max_position_embeddings", 2048), rope_theta=_rope_theta(cfg),
        norm_eps=cfg.get("rms_norm_eps", 1e-6), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=_first(cfg.get("bos_token_id")), eos_token_id=_first(cfg.get("eos_token_id")), name=name,
    )


def _opt_from_hf(cfg: dict[str, Any], name: str) -> ModelConfig:
    hidden = cfg["hidden_size"]
    if cfg.get("word_embed_proj_dim", hidden) != hidden:
        raise ValueError("word_embed_proj_dim: OPT with an embedding projection (opt-350m) is not supported")
    if not cfg.get("do_layer_norm_before", True):
        raise ValueError("do_layer_norm_before: post-LN OPT (opt-350m) is not supported")
    if cfg.get("activation_function", "relu") != "relu":
        raise ValueError(f"activation_function: {cfg['activation_function']!r} is not supported")
    heads = cfg["num_attention_heads"]
    return ModelConfig(
        arch="opt", num_layers=cfg["num_hidden_layers"], hidden_size=hidden, num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=cfg["ffn_dim"],
        vocab_size=cfg["vocab_size"], max_position=cfg.get("max_position_embeddings", 2048),
        norm_eps=1e-5, tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        bos_token_id=_first(cfg.get("bos_token_id")), eos_token_id=_first(cfg.get("eos_token_id")), name=name,
    )


def _first(v: Any) -> int | None:
    return v[0] if isinstance(v, (list, tuple)) else v


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        arch="llama", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, max_position=8192, rope_theta=100000.0, norm_eps=1e-5,
        tie_embeddings=True, bos_token_id=1, eos_token_id=2, name="smollm2-135m"),
    "llama-3-8b": ModelConfig(
        arch="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, max_position=8192, rope_theta=500000.0, norm_eps=1e-5,
        tie_embeddings=False, bos_token_id=128000, eos_token_id=128001, name="llama-3-8b"),
    "opt-125m": ModelConfig(
        arch="opt", num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=12, head_dim=64,
        intermediate_size=3072, vocab_size=50272, max_position=2048, tie_embeddings=True,
        bos_token_id=2, eos_token_id=2, name="opt-125m"),
    "opt-13b": ModelConfig(
        arch="opt", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40, head_dim=128,
        intermediate_size=20480, vocab_size=50272, max_position=2048, tie_embeddings=True,
        bos_token_id=2, eos_token_id=2, name="opt-13b"),
    # Tiny configs for tests: seconds on CPU, GQA in the llama one.
    "tiny-llama": ModelConfig(
        arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=256, max_position=512, rope_theta=10000.0, norm_eps=1e-6,
        tie_embeddings=False, bos_token_id=1, eos_token_id=2, name="tiny-llama"),
    "tiny-llama-tied": ModelConfig(
        arch="llama", num_layers=2, hidden_size=48, num_heads=3, num_kv_heads=1, head_dim=16,
        intermediate_size=96, vocab_size=128, max_position=256, rope_theta=50000.0, norm_eps=1e-5,
        tie_embeddings=True, bos_token_id=1, eos_token_id=2, name="tiny-llama-tied"),
    "tiny-opt": ModelConfig(
        arch="opt", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16,
        intermediate_size=128, vocab_size=256, max_position=512, tie_embeddings=True,
        bos_token_id=2, eos_token_id=2, name="tiny-opt"),
}
