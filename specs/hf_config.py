"""HF `config.json` <-> `ModelSpec` fields, by model_type (or the architectures list when it is missing).

Supported: llama, mistral, codellama and yi (Llama shapes), qwen2 (q/k/v biases), qwen3 (q/k norms,
explicit head_dim), opt, mixtral, qwen2_moe, qwen3_moe (leading dense layers via mlp_only_layers;
decoder_sparse_step must be 1), deepseek_v2 / deepseek_v3 (routed + shared experts, leading dense
layers, multi-head latent attention). Every error names the file (or model) and the field.
Left out on purpose: sliding windows (the KV of the whole context is counted), Qwen2-MoE's one-
column shared-expert gate, DeepSeek-V3's multi-token-prediction module and per-expert score biases
(each under 0.1% of the weights at the published sizes, except the MTP module, which serving skips).
"""

from __future__ import annotations

from typing import Any

_LLAMA_LIKE = ("llama", "mistral", "codellama", "yi", "qwen2", "qwen3")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
SUPPORTED = (*_LLAMA_LIKE, "opt", *_MOE)
_BY_ARCHITECTURE = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "YiForCausalLM": "yi",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "OPTForCausalLM": "opt",
    "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
                "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1}


class _Reader:
    """Reads fields of one config dict; every error starts with the file (or model) and the field."""

    def __init__(self, cfg: dict[str, Any], where: str) -> None:
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: not a JSON object")
        self.cfg, self.where = cfg, where

    def fail(self, key: str, why: str) -> ValueError:
        return ValueError(f"{self.where}: {key}: {why}")

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        v = self.cfg.get(key)
        if v is None:
            if default is None:
                raise self.fail(key, "missing")
            return default
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise self.fail(key, f"must be an int >= {minimum}, got {v!r}")
        if v >= 2**63:  # was: passed, and the shapes' arithmetic overflowed int64 or named no file
            raise self.fail(key, f"{v} is beyond int64")
        return v

    def float(self, key: str, default: float) -> float:
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise self.fail(key, f"must be a number > 0, got {v!r}")
        return float(v)

    def token(self, key: str) -> int | None:
        v = self.cfg.get(key)
        return v[0] if isinstance(v, list) and v else (v if isinstance(v, int) else None)


def model_type(cfg: dict[str, Any], where: str) -> str:
    """The config's model family, from model_type or else the architectures list."""
    mt = str(cfg.get("model_type") or "").lower()
    archs = cfg.get("architectures") or []
    if not mt:
        mt = next((_BY_ARCHITECTURE[a] for a in archs if a in _BY_ARCHITECTURE), "")
    if mt not in SUPPORTED:
        raise ValueError(f"{where}: model_type {mt or None!r} (architectures {archs}) is not supported; "
                         f"supported: {', '.join(SUPPORTED)}")
    return mt


def spec_fields(cfg: dict[str, Any], name: str, source: str = "") -> dict[str, Any]:
    """ModelSpec keyword arguments for a HF config dict (the spec checks its own invariants)."""
    where = source or name or "config"
    if not isinstance(cfg, dict):  # a JSON list or number parsed fine, then failed on .get
        raise ValueError(f"{where}: expected a JSON object (a HF config.json), got a JSON {type(cfg).__name__}")
    mt = model_type(cfg, where)
    r = _Reader(cfg, where)
    fields = _opt(r) if mt == "opt" else _llama(r, mt)
    fields.update(name=name, source=source, **_dtype_fields(r), vocab_size=r.int("vocab_size"),
                  num_layers=r.int("num_hidden_layers"),
                  bos_token_id=r.token("bos_token_id"), eos_token_id=r.token("eos_token_id"))
    if mt in _MOE:
        fields.update(_deepseek(r) if mt.startswith("deepseek") else _qwen_mixtral_moe(r, mt))
    return fields


def _dtype_fields(r: _Reader) -> dict[str, int]:
    """dtype_bytes of the weights, and kv_dtype_bytes where the KV cache differs: an fp8 checkpoint
    (DeepSeek-V3, "...-FP8") keeps torch_dtype bfloat16 for its unquantized parts, which is also the
    dtype vLLM's default ("auto") KV cache takes."""
    torch_bytes = _torch_dtype_bytes(r)
    quant = r.cfg.get("quantization_config") or {}
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8":
        return {"dtype_bytes": 1, "kv_dtype_bytes": 0 if torch_bytes == 1 else torch_bytes}
    return {"dtype_bytes": torch_bytes}


def _torch_dtype_bytes(r: _Reader) -> int:
    for key in ("torch_dtype", "dtype"):
        v = r.cfg.get(key)
        if v is not None:
            text = str(v).lower().removeprefix("torch.")
            if text not in _DTYPE_BYTES:
                raise r.fail(key, f"unknown dtype {v!r}; known: {', '.join(_DTYPE_BYTES)}")
            return _DTYPE_BYTES[text]
    return 2


def _rope(r: _Reader) -> tuple[float, str]:
    """(rope_theta, RoPE variant or ""), from the transformers 4 or 5 spelling."""
    params = r.cfg.get("rope_parameters") or {}
    scaling = r.cfg.get("rope_scaling") or params
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default") if isinstance(scaling, dict) else "default"
    theta = r.cfg.get("rope_theta", params.get("rope_theta") if isinstance(params, dict) else None)
    if theta is None:
        theta = 10000.0
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise r.fail("rope_theta", f"must be a number > 0, got {theta!r}")
    return float(theta), "" if kind == "default" else kind


def _llama(r: _Reader, mt: str) -> dict[str, Any]:
    if r.cfg.get("mlp_bias"):
        raise r.fail("mlp_bias", "MLP biases are not supported")
    if r.cfg.get("hidden_act", "silu") != "silu":
        raise r.fail("hidden_act", f"{r.cfg['hidden_act']!r} is not supported (SwiGLU needs 'silu')")
    hidden, heads = r.int("hidden_size"), r.int("num_attention_heads")
    head_dim = r.int("head_dim", default=0)
    if not head_dim:
        if hidden % heads:
            raise r.fail("head_dim", f"missing, and hidden_size {hidden} is not a multiple of "
                                     f"num_attention_heads {heads}")
        head_dim = hidden // heads
    theta, scaling = _rope(r)
    return dict(arch="llama", hidden_size=hidden, num_heads=heads,
                num_kv_heads=r.int("num_key_value_heads", default=heads), head_dim=head_dim,
                intermediate_size=r.int("intermediate_size"),
                max_position=r.int("max_position_embeddings", default=2048), rope_theta=theta,
                rope_scaling=scaling, norm_eps=r.float("rms_norm_eps", 1e-6),
                tied_embeddings=bool(r.cfg.get("tie_word_embeddings", False)),
                attention_bias=mt in ("qwen2", "qwen2_moe") or bool(r.cfg.get("attention_bias", False)),
                qk_norm=mt in ("qwen3", "qwen3_moe"))


def _opt(r: _Reader) -> dict[str, Any]:
    hidden, heads = r.int("hidden_size"), r.int("num_attention_heads")
    if r.cfg.get("word_embed_proj_dim", hidden) != hidden:
        raise r.fail("word_embed_proj_dim", "OPT with an embedding projection (opt-350m) is not supported")
    if not r.cfg.get("do_layer_norm_before", True):
        raise r.fail("do_layer_norm_before", "post-LN OPT (opt-350m) is not supported")
    if r.cfg.get("activation_function", "relu") != "relu":
        raise r.fail("activation_function", f"{r.cfg['activation_function']!r} is not supported")
    if not r.cfg.get("enable_bias", True):
        raise r.fail("enable_bias", "OPT without biases is not supported")
    if hidden % heads:
        raise r.fail("num_attention_heads", f"{heads} does not divide hidden_size {hidden}")
    return dict(arch="opt", hidden_size=hidden, num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                intermediate_size=r.int("ffn_dim"), max_position=r.int("max_position_embeddings", default=2048),
                norm_eps=1e-5, tied_embeddings=bool(r.cfg.get("tie_word_embeddings", True)))


def _qwen_mixtral_moe(r: _Reader, mt: str) -> dict[str, Any]:
    if mt == "mixtral":
        f = r.int("intermediate_size")
        return dict(num_experts=r.int("num_local_experts"), experts_per_token=r.int("num_experts_per_tok"),
                    moe_intermediate_size=f)
    if r.int("decoder_sparse_step", default=1) != 1:
        raise r.fail("decoder_sparse_step", f"{r.cfg['decoder_sparse_step']}: only 1 (every layer after the "
                                            "mlp_only_layers is sparse) is supported")
    dense = r.cfg.get("mlp_only_layers") or []
    if list(dense) != list(range(len(dense))):
        raise r.fail("mlp_only_layers", f"{dense}: only leading dense layers [0, 1, ..., k-1] are supported")
    return dict(num_experts=r.int("num_experts"), experts_per_token=r.int("num_experts_per_tok"),
                moe_intermediate_size=r.int("moe_intermediate_size"), num_dense_layers=len(dense),
                shared_expert_intermediate_size=r.int("shared_expert_intermediate_size", default=0, minimum=0)
                if mt == "qwen2_moe" else 0)


def _deepseek(r: _Reader) -> dict[str, Any]:
    if r.int("moe_layer_freq", default=1) != 1:
        raise r.fail("moe_layer_freq", f"{r.cfg['moe_layer_freq']}: only 1 (every layer after the first "
                                       "first_k_dense_replace is MoE) is supported")
    moe_f = r.int("moe_intermediate_size")
    rope, nope = r.int("qk_rope_head_dim"), r.int("qk_nope_head_dim")
    heads = r.int("num_attention_heads")
    return dict(num_experts=r.int("n_routed_experts"), experts_per_token=r.int("num_experts_per_tok"),
                moe_intermediate_size=moe_f,
                shared_expert_intermediate_size=r.int("n_shared_experts", default=0, minimum=0) * moe_f,
                num_dense_layers=r.int("first_k_dense_replace", default=0, minimum=0),
                q_lora_rank=r.int("q_lora_rank", default=0, minimum=0), kv_lora_rank=r.int("kv_lora_rank"),
                qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=r.int("v_head_dim"),
                head_dim=nope + rope, num_kv_heads=heads)  # one latent serves every head


# ModelSpec field -> the config.json key it is read from, to name the file's field in errors
_HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "max_position": "max_position_embeddings",
            "experts_per_token": "num_experts_per_tok", "norm_eps": "rms_norm_eps",
            "tied_embeddings": "tie_word_embeddings", "dtype_bytes": "torch_dtype"}


def hf_field_error(e: ValueError, prefix: str, where: str) -> ValueError:
    """A spec's invariant error ("<prefix>: <field>: why") re-worded for the config file `where`: the
    config.json key beside the field."""
    rest = str(e).removeprefix(f"{prefix}: ")
    name = rest.split(":", 1)[0]
    if name in _HF_KEYS:
        rest = f"{_HF_KEYS[name]} ({name}){rest[len(name):]}"
    return ValueError(f"{where}: {rest}")


# --- back to a config dict ------------------------------------------------------------------------

def to_hf_config(spec: Any) -> dict[str, Any]:
    """The HF config dict of a ModelSpec (model_type chosen from its flags); spec_fields reads it back
    to equal fields."""
    names = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}
    fp8_checkpoint = spec.dtype_bytes == 1 and spec.kv_dtype_bytes > 1  # torch_dtype is its cache's dtype
    dtype = names[spec.kv_dtype_bytes if fp8_checkpoint else spec.dtype_bytes]
    common = {"num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
              "num_attention_heads": spec.num_heads, "vocab_size": spec.vocab_size, "max_position_embeddings": spec.max_position,
              "tie_word_embeddings": spec.tied_embeddings, "torch_dtype": dtype,
              "bos_token_id": spec.bos_token_id, "eos_token_id": spec.eos_token_id}
    if fp8_checkpoint:
        common["quantization_config"] = {"quant_method": "fp8"}
    if spec.arch == "opt":
        return {"model_type": "opt", "architectures": ["OPTForCausalLM"], **common, "ffn_dim": spec.intermediate_size,
                "word_embed_proj_dim": spec.hidden_size, "do_layer_norm_before": True,
                "activation_function": "relu", "enable_bias": True, "layer_norm_elementwise_affine": True,
                "dropout": 0.0, "attention_dropout": 0.0, "pad_token_id": 1}
    mt = _llama_model_type(spec)
    cfg = {"model_type": mt, "architectures": [next(a for a, t in _BY_ARCHITECTURE.items() if t == mt)], **common,
           "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
           "intermediate_size": spec.intermediate_size, "rope_theta": spec.rope_theta,
           "rms_norm_eps": spec.norm_eps, "hidden_act": "silu", "attention_bias": spec.attention_bias,
           "mlp_bias": False}
    if spec.rope_scaling:
        cfg["rope_scaling"] = {"rope_type": spec.rope_scaling}
    if mt == "mixtral":
        cfg.update(num_local_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token)
    elif mt in ("qwen2_moe", "qwen3_moe"):
        cfg.update(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                   moe_intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1,
                   mlp_only_layers=list(range(spec.num_dense_layers)),
                   shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
    elif mt == "deepseek_v2":
        moe_f = spec.moe_intermediate_size
        del cfg["head_dim"]
        cfg.update(n_routed_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                   moe_intermediate_size=moe_f, n_shared_experts=spec.shared_expert_intermediate_size // moe_f,
                   first_k_dense_replace=spec.num_dense_layers, moe_layer_freq=1,
                   q_lora_rank=spec.q_lora_rank or None, kv_lora_rank=spec.kv_lora_rank,
                   qk_rope_head_dim=spec.qk_rope_head_dim, qk_nope_head_dim=spec.qk_nope_head_dim,
                   v_head_dim=spec.v_head_dim)
    return cfg


def _llama_model_type(spec: Any) -> str:
    if spec.is_mla:
        if spec.shared_expert_intermediate_size % max(spec.moe_intermediate_size, 1):
            raise ValueError(f"{spec.name}: shared_expert_intermediate_size: not a whole number of experts")
        return "deepseek_v2"
    if spec.is_moe:
        if spec.qk_norm:
            if spec.shared_expert_intermediate_size:
                raise ValueError(f"{spec.name}: no HF model type has q/k norms and shared experts")
            return "qwen3_moe"
        if spec.attention_bias:
            return "qwen2_moe"
        if spec.num_dense_layers or spec.shared_expert_intermediate_size:
            raise ValueError(f"{spec.name}: a Mixtral-style config has no dense layers or shared experts")
        return "mixtral"
    if spec.qk_norm:
        return "qwen3"
    return "qwen2" if spec.attention_bias else "llama"
