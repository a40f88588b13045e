"""Model and hardware specs from files (specs/): HF config.json parsing, the catalogues, bad input."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specs import (
    HARDWARE,
    MODELS,
    HardwareSpec,
    ModelSpec,
    kv_capacity_tokens,
    load_hardware,
    load_model,
    read_config,
    resolve_model_name,
)
from specs.catalogue import _variant_config_once

SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
FIXTURES = sorted(SHARED_MODELS.glob("*.json")) if SHARED_MODELS.is_dir() else []
needs_fixtures = pytest.mark.skipif(not FIXTURES, reason=f"{SHARED_MODELS} is absent")
GiB = 1024**3

# Published parameter counts (model cards / papers). Total counts every routed expert.
PUBLISHED_TOTAL = {
    "llama-2-7b-hf": 6.74e9, "codellama-34b-instruct-hf": 33.7e9, "mixtral-8x7b-v0.1": 46.7e9,
    "qwen3-30b-a3b": 30.5e9, "deepseek-v2-lite": 15.7e9, "qwen2.5-7b-instruct": 7.6e9, "yi-34b": 34.4e9,
    "mistral-nemo-instruct-2407": 12.2e9, "qwen3-14b": 14.8e9,
}
# Published "activated" counts use two conventions: Mistral and Qwen count the embedding table
# (every parameter a token touches), DeepSeek counts what a token is multiplied by (lm head, no
# embedding lookup) -- active_params_per_token.
PUBLISHED_ACTIVE = {"mixtral-8x7b-v0.1": (12.9e9, True), "qwen3-30b-a3b": (3.3e9, True),
                    "deepseek-v2-lite": (2.4e9, False)}

# num_params of every preset as sim/specs.py and backend/config.py computed them before the move
# into one catalogue (printed from the code at commit c31ecb6).
PRESET_PARAMS_BEFORE = {
    "opt-13b": 12853473280, "opt-66b": 65719701504, "opt-175b": 174604468224, "llama-7b": 6738415616,
    "llama-13b": 13015864320, "llama-3-8b": 8030261248, "llama-3-70b": 70553706496,
    "llama-3.1-8b": 8030261248, "llama-3.1-70b": 70553706496, "smollm2-135m": 134515008,
    "opt-125m": 125239296, "tiny-llama": 106816, "tiny-llama-tied": 46320, "tiny-opt": 116352,
}


# --- the HF config fixtures ------------------------------------------------------------------------

@needs_fixtures
@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_fixture_loads_with_published_size(path: Path) -> None:
    spec = read_config(path)
    assert spec.name == path.stem and spec.source == str(path)
    if path.stem in PUBLISHED_TOTAL:
        assert spec.num_params == pytest.approx(PUBLISHED_TOTAL[path.stem], rel=0.03)
    if path.stem in PUBLISHED_ACTIVE:
        published, with_embedding = PUBLISHED_ACTIVE[path.stem]
        active = spec.active_params_per_token + (spec.embedding_params if with_embedding else 0)
        assert active == pytest.approx(published, rel=0.03)
    if spec.is_moe:
        assert spec.active_params_per_token < spec.num_params / 3
    else:  # a dense token multiplies by every weight but the embedding table
        assert spec.active_params_per_token == spec.num_params - spec.embedding_params
    assert ModelSpec.from_hf_config(spec.to_hf_config(), spec.name) == spec  # round trip


@needs_fixtures
def test_fixture_shapes() -> None:
    by = {p.stem: read_config(p) for p in FIXTURES}
    assert by["llama-2-7b-hf"].kv_bytes_per_token == 512 * 1024  # fp16, 32 layers x 32 heads x 128
    ds = by["deepseek-v2-lite"]
    assert ds.is_mla and ds.kv_bytes_per_token == 27 * (512 + 64) * 2  # one latent per token per layer
    assert ds.num_dense_layers == 1 and ds.num_moe_layers == 26
    assert ds.shared_expert_intermediate_size == 2 * 1408
    assert ds.attn_flops_per_pair_per_layer == 2 * 16 * (128 + 64) + 2 * 16 * 128
    nemo = by["mistral-nemo-instruct-2407"]
    assert nemo.head_dim == 128 != nemo.hidden_size // nemo.num_heads  # head_dim from the field
    assert by["qwen2.5-7b-instruct"].attention_bias and not by["qwen2.5-7b-instruct"].qk_norm
    assert by["qwen3-14b"].qk_norm and not by["qwen3-14b"].attention_bias
    mix = by["mixtral-8x7b-v0.1"]
    assert (mix.num_experts, mix.experts_per_token, mix.num_moe_layers) == (8, 2, 32)
    assert mix.expert_params == 3 * 4096 * 14336 and mix.router_params_per_layer == 4096 * 8
    q3 = by["qwen3-30b-a3b"]
    assert (q3.num_experts, q3.experts_per_token, q3.moe_intermediate_size) == (128, 8, 768)
    assert by["llama-3.1-70b-instruct"].rope_scaling == "llama3"
    # the cost model's per-layer totals cover every expert, so it runs on MoE specs
    assert mix.num_layers * mix.params_per_layer + mix.embedding_params + mix.lm_head_params \
        + mix.hidden_size == pytest.approx(mix.num_params)


@needs_fixtures
def test_load_model_resolves_hf_ids_in_search_dirs(tmp_path: Path) -> None:
    spec = load_model("meta-llama/Llama-2-7b-hf", [SHARED_MODELS])
    assert spec.name == "llama-2-7b-hf" and spec.num_layers == 32
    assert load_model("codellama/CodeLlama-34b-Instruct-hf", [tmp_path, SHARED_MODELS]).num_layers == 48
    assert load_model(str(SHARED_MODELS / "Yi-34B")).name == "yi-34b"  # beside the path given
    folder = tmp_path / "Mixtral-8x7B-v0.1"
    folder.mkdir()
    (folder / "config.json").write_text((SHARED_MODELS / "mixtral-8x7b-v0.1.json").read_text())
    assert load_model(str(folder)).name == "Mixtral-8x7B-v0.1"  # a folder holding config.json
    assert load_model("mistralai/Mixtral-8x7B-v0.1", [tmp_path]).is_moe  # <name>/config.json
    with pytest.raises(ValueError, match=r"llama-2-7b-hf\.json or llama-2-7b-hf/config\.json in") as e:
        load_model("meta-llama/Llama-2-7b-hf", [tmp_path])
    assert "opt-13b" in str(e.value)  # what was tried includes the catalogue


@needs_fixtures
@pytest.mark.parametrize("model_id, file", [
    ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b-instruct"),  # Meta's older spelling
    ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b"),                # a yymm release
    ("mistralai/Mistral-Nemo-Base-2407", "mistral-nemo-instruct-2407"),
])
def test_variant_ids_find_their_base_config(model_id: str, file: str) -> None:
    _variant_config_once.cache_clear()  # the warning comes once per name in a process
    with pytest.warns(UserWarning, match=f"using .*{file}.json"):
        spec = load_model(model_id, [SHARED_MODELS])
    assert spec == load_model(str(SHARED_MODELS / f"{file}.json"))


@needs_fixtures
def test_an_fp8_checkpoint_id_reads_its_weights_at_one_byte_and_keeps_a_bf16_cache(tmp_path: Path) -> None:
    base = load_model(str(SHARED_MODELS / "qwen3-14b.json"))
    _variant_config_once.cache_clear()
    with pytest.warns(UserWarning, match="one byte a weight"):
        fp8 = load_model("Qwen/Qwen3-14B-FP8", [SHARED_MODELS])
    assert fp8.weight_bytes == base.weight_bytes // 2 and fp8.kv_bytes_per_token == base.kv_bytes_per_token
    # what a SimConfig holds for it finds the same fp8 spec again without the search folders
    again = resolve_model_name("Qwen/Qwen3-14B-FP8", [SHARED_MODELS])
    assert again == str(SHARED_MODELS / "Qwen3-14B-FP8") and load_model(again) == fp8 and fp8.name == "qwen3-14b-fp8"
    # an fp8 config.json says the same (quantization_config, torch_dtype bfloat16), and round-trips
    cfg = dict(json.loads((SHARED_MODELS / "qwen3-14b.json").read_text()), quantization_config={"quant_method": "fp8"})
    (tmp_path / "q.json").write_text(json.dumps(cfg))
    read = load_model(str(tmp_path / "q.json"))
    assert (read.dtype_bytes, read.kv_dtype_bytes) == (1, 2) and read.kv_bytes_per_token == base.kv_bytes_per_token
    (tmp_path / "back.json").write_text(json.dumps(read.to_hf_config()))
    assert load_model(str(tmp_path / "back.json")) == dataclasses.replace(read, name="back")
    assert MODELS["opt-13b"].kv_bytes_per_token == 2 * MODELS["opt-13b"].num_layers * 2 * 5120  # 0: as the weights


# --- bad input ---------------------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
         "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 512,
         "vocab_size": 1000, "max_position_embeddings": 512, "torch_dtype": "bfloat16"}
MIXTRAL = dict(LLAMA, model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=8,
               num_experts_per_tok=2)
QWEN3_MOE = dict(LLAMA, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 head_dim=32, decoder_sparse_step=1, mlp_only_layers=[])


def _write(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("cfg, field", [
    (dict(LLAMA, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]), r"model_type 'gpt_neox' "
     r"\(architectures \['GPTNeoXForCausalLM'\]\) is not supported; supported: llama"),
    (dict(LLAMA, num_key_value_heads=3), "num_key_value_heads"),
    ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, "hidden_size: missing"),
    (dict(LLAMA, num_hidden_layers=0), "num_hidden_layers"),
    (dict(LLAMA, intermediate_size=-4), "intermediate_size"),
    (dict(LLAMA, hidden_size=250), "head_dim"),
    (dict(LLAMA, torch_dtype="int4"), "torch_dtype"),
    (dict(MIXTRAL, num_experts_per_tok=9), "num_experts_per_tok"),
    ({k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}, "num_local_experts: missing"),
    (dict(QWEN3_MOE, decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(QWEN3_MOE, mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(LLAMA, mlp_bias=True), "mlp_bias"),
])
def test_bad_config_names_file_and_field(tmp_path: Path, cfg: dict, field: str) -> None:
    path = _write(tmp_path, cfg)
    with pytest.raises(ValueError, match=rf"^{path}: .*{field}"):
        read_config(path)
    with pytest.raises(ValueError, match=field):  # the same through load_model
        load_model(str(path))


def test_bad_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "model_type": "llama",\n  "hidden_size": ,\n}')
    with pytest.raises(ValueError, match=rf"{path}: line 3"):
        read_config(path)


def test_leading_dense_layers_are_honoured() -> None:
    spec = ModelSpec.from_hf_config(dict(QWEN3_MOE, mlp_only_layers=[0]), "q")
    assert (spec.num_dense_layers, spec.num_moe_layers) == (1, 1)
    dense = ModelSpec.from_hf_config(dict(LLAMA, model_type="qwen3", head_dim=32), "d")
    # one dense layer + one MoE layer: the MLP weights are one of each
    assert spec.num_params - dense.num_params == spec.moe_mlp_params_per_layer - dense.dense_mlp_params_per_layer


def test_spec_invariants_name_the_field() -> None:
    base = MODELS["llama-3-8b"]
    for changes, field in [({"experts_per_token": 2}, "experts_per_token"),
                           ({"num_experts": 8, "experts_per_token": 2}, "moe_intermediate_size"),
                           ({"num_experts": 8, "experts_per_token": 2, "moe_intermediate_size": 64,
                             "num_dense_layers": 32}, "num_dense_layers"),
                           ({"kv_lora_rank": 512}, "qk_rope_head_dim"), ({"dtype_bytes": 3}, "dtype_bytes")]:
        with pytest.raises(ValueError, match=rf"^llama-3-8b: {field}"):
            base.replace(**changes)


# --- the model catalogue -------------------------------------------------------------------------

def test_presets_unchanged_by_the_move() -> None:
    assert {n: m.num_params for n, m in MODELS.items()} == PRESET_PARAMS_BEFORE
    assert MODELS["llama-3-8b"].kv_bytes_per_token == 128 * 1024
    assert load_model("facebook/opt-13b") is MODELS["opt-13b"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_catalogue_files_round_trip(name: str) -> None:
    spec = MODELS[name]
    assert ModelSpec.from_hf_config(spec.to_hf_config(), name) == spec


def test_moe_capacity_counts_every_expert() -> None:
    cfg = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
           "head_dim": 128, "num_hidden_layers": 48, "intermediate_size": 6144, "moe_intermediate_size": 768,
           "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960}
    spec = ModelSpec.from_hf_config(cfg, "qwen3-30b-a3b")
    assert spec.weight_bytes == 2 * spec.num_params > 56 * GiB  # all experts are resident (56.9 GiB)
    with pytest.raises(ValueError, match="does not fit"):
        kv_capacity_tokens(spec, HARDWARE["a100-40gb"])
    h100 = HARDWARE["h100-sxm"]
    free = 0.9 * h100.memory_bytes - spec.weight_bytes
    tokens = kv_capacity_tokens(spec, h100)
    assert 0.9 * free / spec.kv_bytes_per_token < tokens < free / spec.kv_bytes_per_token


# --- hardware ----------------------------------------------------------------------------------------

SHIPPED = ("h100-sxm", "h200", "a100-40gb", "a100-80gb", "l40s", "b200", "mi300x", "rtx-pro-6000", "rtx-4090")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_hardware_files(name: str) -> None:
    hw = load_hardware(name)
    assert hw.name == name and len(hw.source) > 40
    assert hw.peak_fp8_flops == 0 or hw.peak_fp8_flops == pytest.approx(2 * hw.peak_flops, rel=0.05)
    assert 100e12 < hw.peak_flops < 5e15 and 500e9 < hw.mem_bandwidth < 10e12
    assert 16 * GiB < hw.memory_bytes < 200 * GiB and hw.interconnect_latency_s > 0
    path = Path(__file__).resolve().parents[1] / "specs" / "hardware" / f"{name}.json"
    assert load_hardware(str(path)) == hw


@pytest.mark.parametrize(("gpu", "name"), [("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000"),
                                           ("RTXPRO6000", "rtx-pro-6000"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
                                           ("RTX4090", "rtx-4090")])
def test_pcie_gpus_are_found_by_the_names_profiles_give_them(gpu: str, name: str) -> None:
    """The llmservingsim profiles' `gpu` (meta.yaml) and folder names; both GPUs link over PCIe only."""
    hw = load_hardware(gpu)
    assert hw.name == name and hw.interconnect_bandwidth == hw.pcie_bandwidth and "no NVLink" in hw.source


def test_existing_hardware_numbers_kept() -> None:
    MiB = 1024**2
    before = {"a100-40gb": (312e12, 1555e9, 40960 * MiB, 300e9, 32e9), "a100-80gb": (312e12, 2039e9, 81920 * MiB, 300e9, 32e9),
              "h100-sxm": (989e12, 3350e9, 81559 * MiB, 450e9, 64e9), "h200": (989e12, 4800e9, 143771 * MiB, 450e9, 64e9)}
    for name, (flops, bw, mem, ic, pcie) in before.items():
        hw = HARDWARE[name]
        assert (hw.peak_flops, hw.mem_bandwidth, hw.memory_bytes, hw.interconnect_bandwidth, hw.pcie_bandwidth) == \
            pytest.approx((flops, bw, mem, ic, pcie))
    assert load_hardware("NVIDIA H100 80GB HBM3") is HARDWARE["h100-sxm"]


def test_bad_hardware_file_names_file_and_field(tmp_path: Path) -> None:
    good = json.loads((Path(__file__).resolve().parents[1] / "specs" / "hardware" / "h100-sxm.json").read_text())
    path = tmp_path / "gpu.json"
    for key in ("hbm_bandwidth_gb_s", "interconnect_latency_us", "source"):
        path.write_text(json.dumps({k: v for k, v in good.items() if k != key}))
        with pytest.raises(ValueError, match=rf"^{path}: {key}: missing"):
            load_hardware(str(path))
    path.write_text(json.dumps(dict(good, memory_mib=-1)))
    with pytest.raises(ValueError, match=rf"{path}: memory_mib"):
        load_hardware(str(path))
    with pytest.raises(ValueError, match=r"known: a100-40gb.*mi300x"):
        load_hardware("tpu-v5")
    path.write_text(json.dumps(dict(good, name="my-gpu")))
    assert load_hardware(str(path)) == HardwareSpec(**{**HARDWARE["h100-sxm"].__dict__, "name": "my-gpu"})


# --- layering and wiring -------------------------------------------------------------------------------

def test_specs_imports_nothing_of_ours() -> None:
    import ast

    ours = {"policies", "traces", "sim", "backend", "analysis", "pagesim"}
    for path in (Path(__file__).resolve().parents[1] / "specs").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not {n.split(".")[0] for n in names} & ours, (path.name, names)


def test_specs_imports_no_torch_simpy_or_pandas() -> None:
    code = "import sys, specs; bad = {'torch', 'simpy', 'pandas'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_backend_refuses_moe_clearly() -> None:
    from backend.config import PRESETS, ModelConfig

    moe = ModelSpec.from_hf_config(MIXTRAL, "mixtral-tiny")
    with pytest.raises(ValueError, match=r"^backend: mixtral-tiny is mixture-of-experts; the live backend runs "
                                         r"dense Llama-family and OPT models only"):
        ModelConfig.of(moe)
    assert ModelConfig.of(MODELS["tiny-llama"]) == ModelConfig.from_name("tiny-llama")
    assert "llama-3.1-8b" not in PRESETS and "opt-13b" in PRESETS  # llama3 RoPE scaling is not built


@pytest.mark.slow  # imports the whole CLI and runs a small simulation: ~5 s on a busy 2-core machine
def test_cli_takes_config_files_and_models_dir(tmp_path: Path, capsys) -> None:
    from pagesim.cli import main

    (tmp_path / "mixtral-tiny.json").write_text(json.dumps(MIXTRAL))
    out = tmp_path / "run"
    rc = main(["simulate", "--trace", "sharegpt-like", "--num-requests", "20", "--rate", "5", "--quiet",
               "--model", "someone/Mixtral-Tiny", "--models-dir", str(tmp_path), "--hardware", "a100-40gb",
               "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["model"] == str(tmp_path / "mixtral-tiny.json")
    capsys.readouterr()
    assert main(["simulate", "--model", "someone/Mixtral-Tiny", "--out", str(out)]) == 2
    assert main(["simulate", "--model", str(tmp_path / "mixtral-tiny.json"), "--hardware",
                 str(tmp_path / "none.json"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--models-dir" in err[0] and "none.json: no such hardware file" in err[1]
