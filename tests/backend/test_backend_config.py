import pytest

pytest.importorskip("torch")

from backend.config import PRESETS, ModelConfig
from backend.weights import weight_shapes


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_and_count_params(name):
    cfg = ModelConfig.from_name(name)
    assert cfg.name == name
    assert cfg.num_params == sum(_numel(s) for s in weight_shapes(cfg).values())


def test_known_param_counts():
    assert ModelConfig.from_name("smollm2-135m").num_params == 134_515_008
    assert abs(ModelConfig.from_name("llama-3-8b").num_params - 8.03e9) < 0.01e9
    assert abs(ModelConfig.from_name("opt-13b").num_params - 12.85e9) < 0.05e9
    assert abs(ModelConfig.from_name("opt-125m").num_params - 125.2e6) < 0.5e6


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match=r"known:.*llama-3-8b.*opt-13b"):
        ModelConfig.from_name("gpt-5")


@pytest.mark.parametrize("field,value", [
    ("num_kv_heads", 4),       # does not divide 9 heads
    ("head_dim", 63),          # rotary needs even
    ("num_layers", 0),
    ("hidden_size", -1),
    ("vocab_size", 2.5),
    ("eos_token_id", 10**6),
    ("norm_eps", 0.0),
    ("rope_theta", -1.0),
    ("arch", "gpt2"),
])
def test_invalid_fields_name_the_field(field, value):
    base = ModelConfig.from_name("smollm2-135m")
    with pytest.raises(ValueError, match=field):
        base.replace(**{field: value})


def test_opt_shape_rules():
    base = ModelConfig.from_name("opt-125m")
    with pytest.raises(ValueError, match="head_dim"):
        base.replace(head_dim=32)
    with pytest.raises(ValueError, match="num_kv_heads"):
        base.replace(num_kv_heads=4)


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3-8b", "opt-125m", "opt-13b", "tiny-llama", "tiny-opt"])
def test_hf_config_round_trip(name):
    cfg = ModelConfig.from_name(name)
    back = ModelConfig.from_hf_config(cfg.to_hf_config(), name=name)
    assert back == cfg


def test_from_hf_config_real_shapes():
    opt125 = {"model_type": "opt", "hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12,
              "ffn_dim": 3072, "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 768,
              "do_layer_norm_before": True, "activation_function": "relu", "bos_token_id": 2, "eos_token_id": 2}
    assert ModelConfig.from_hf_config(opt125, name="opt-125m") == ModelConfig.from_name("opt-125m")
    llama3 = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
              "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
              "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False}
    assert ModelConfig.from_hf_config(llama3, name="llama-3-8b") == ModelConfig.from_name("llama-3-8b")
    # transformers 5 spells rope_theta inside rope_parameters
    v5 = dict(llama3, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    del v5["rope_theta"]
    assert ModelConfig.from_hf_config(v5).rope_theta == 500000.0


@pytest.mark.parametrize("change,field", [
    ({"word_embed_proj_dim": 512}, "word_embed_proj_dim"),
    ({"do_layer_norm_before": False}, "do_layer_norm_before"),
])
def test_unsupported_opt_variants(change, field):
    cfg = dict(ModelConfig.from_name("opt-125m").to_hf_config(), **change)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(cfg)


def test_unsupported_hf_configs():
    cfg = ModelConfig.from_name("llama-3-8b").to_hf_config()
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig.from_hf_config(dict(cfg, rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config({"model_type": "gpt2"})


def test_kv_bytes_per_token():
    # the vLLM paper's OPT-13B: 800 KB per token in fp16
    assert ModelConfig.from_name("opt-13b").kv_bytes_per_token == 2 * 40 * 5120 * 2
