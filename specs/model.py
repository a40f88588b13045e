"""Transformer shapes: `ModelSpec` and the shipped models."""

from __future__ import annotations

from dataclasses import dataclass

from specs.names import normalize


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer; enough to count parameters, bytes and FLOPs.

    arch "opt": learned positions, LayerNorm (weight + bias), biases on every linear, 2-matrix ReLU MLP.
    arch "llama": rotary positions (no parameters), RMSNorm (weight only), no biases, 3-matrix
    SwiGLU MLP, grouped-query attention when num_kv_heads < num_heads.
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
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ("opt", "llama"):
            raise ValueError(f"{self.name}: arch must be 'opt' or 'llama', got {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")

    # --- parameter counts -------------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_params_per_layer(self) -> int:
        """q, k, v and output projections (with biases for OPT)."""
        h = self.hidden_size
        weights = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        biases = self.q_size + 2 * self.kv_size + h if self.arch == "opt" else 0
        return weights + biases

    @property
    def mlp_params_per_layer(self) -> int:
        """fc1/fc2 with biases (OPT) or gate/up/down without biases (Llama)."""
        h, f = self.hidden_size, self.intermediate_size
        if self.arch == "opt":
            return 2 * h * f + f + h
        return 3 * h * f

    @property
    def norm_params_per_layer(self) -> int:
        """Two norms per layer: LayerNorm has weight and bias, RMSNorm only a weight."""
        return 2 * self._norm_params

    @property
    def params_per_layer(self) -> int:
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
        return (self.embedding_params + self.num_layers * self.params_per_layer
                + self._norm_params + self.lm_head_params)  # + final norm

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def _norm_params(self) -> int:
        return 2 * self.hidden_size if self.arch == "opt" else self.hidden_size


# --- shipped models -------------------------------------------------------------------------------
# Shapes from each model's published config.json (OPT: Zhang et al. 2022, Table 1; LLaMA: Touvron et
# al. 2023; Llama 3: Meta's release; SmolLM2: HuggingFaceTB/SmolLM2-135M).

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("opt-13b", "opt", 40, 5120, 40, 40, 128, 20480, 50272, 2048, tied_embeddings=True),
        ModelSpec("opt-66b", "opt", 64, 9216, 72, 72, 128, 36864, 50272, 2048, tied_embeddings=True),
        ModelSpec("opt-175b", "opt", 96, 12288, 96, 96, 128, 49152, 50272, 2048, tied_embeddings=True),
        ModelSpec("llama-7b", "llama", 32, 4096, 32, 32, 128, 11008, 32000, 2048),
        ModelSpec("llama-13b", "llama", 40, 5120, 40, 40, 128, 13824, 32000, 2048),
        ModelSpec("llama-3-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256, 8192),
        ModelSpec("llama-3-70b", "llama", 80, 8192, 64, 8, 128, 28672, 128256, 8192),
        # Llama 3.1: the same shapes as Llama 3, with a 128K context (max_position_embeddings 131072)
        ModelSpec("llama-3.1-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
        ModelSpec("llama-3.1-70b", "llama", 80, 8192, 64, 8, 128, 28672, 128256, 131072),
        ModelSpec("smollm2-135m", "llama", 30, 576, 9, 3, 64, 1536, 49152, 8192, tied_embeddings=True),
    ]
}

_MODEL_ALIASES = {
    "meta-llama-3-8b": "llama-3-8b", "llama3-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b", "llama3-70b": "llama-3-70b",
    "meta-llama-3.1-8b": "llama-3.1-8b", "llama3.1-8b": "llama-3.1-8b", "llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama-3.1-70b": "llama-3.1-70b", "llama3.1-70b": "llama-3.1-70b",
    "llama-1-7b": "llama-7b", "llama-1-13b": "llama-13b",
}


def get_model(name: str) -> ModelSpec:
    """Look up a shipped model spec by name or alias ("facebook/opt-13b"), case-insensitively."""
    key = normalize(name)
    key = _MODEL_ALIASES.get(key, key)
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[key]
