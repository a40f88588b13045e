"""The live backend's model config: a `specs.ModelSpec` the backend can build.

There is one model-shape type (specs/model.py), read from the one catalogue or any HF config.json
(specs/catalogue.py). `ModelConfig` is that type plus the backend's limit, checked on construction:
it builds dense Llama-family models with plain rotary embeddings and no biases or q/k norms, and
OPT. Anything else raises ValueError naming what the backend lacks.
"""

from __future__ import annotations

from typing import Any

from specs import MODELS, ModelSpec, load_model


class ModelConfig(ModelSpec):
    """A ModelSpec the live backend runs (see the module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        problem = unsupported(self)
        if problem:
            raise ValueError(f"backend: {self.name or 'model'} {problem}")

    @classmethod
    def of(cls, spec: ModelSpec) -> ModelConfig:
        """The backend config of a spec (ValueError if the backend cannot build it)."""
        if isinstance(spec, cls):
            return spec
        return cls(**{f: getattr(spec, f) for f in spec.__dataclass_fields__})

    @classmethod
    def from_name(cls, name: str, search_dirs: tuple[str, ...] = ()) -> ModelConfig:
        """A catalogue entry, config.json path or HF id (see specs.load_model)."""
        return cls.of(load_model(name, search_dirs))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "", source: str = "") -> ModelConfig:
        return cls.of(ModelSpec.from_hf_config(cfg, name, source))


def unsupported(spec: ModelSpec) -> str:
    """Why the backend cannot build `spec` ("is ...; the live backend runs ..."), or ""."""
    why = ""
    if spec.is_moe:
        why = "is mixture-of-experts"
    elif spec.is_mla:
        why = "uses multi-head latent attention"
    elif spec.rope_scaling:
        why = f"uses rope_scaling {spec.rope_scaling!r} (only plain rotary embeddings are built)"
    elif spec.arch == "llama" and (spec.attention_bias or spec.qk_norm):
        why = "has attention biases or q/k norms (Qwen2/Qwen3)"
    if not why:
        return ""
    return f"{why}; the live backend runs dense Llama-family and OPT models only"


# The catalogue entries the backend can build (random weights, or real ones for smollm2-135m).
PRESETS: dict[str, ModelConfig] = {n: ModelConfig.of(s) for n, s in MODELS.items() if not unsupported(s)}
