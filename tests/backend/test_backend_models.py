"""Llama and OPT on the paged cache (through ModelRunner) against HF transformers' implementations
built from the same config and random weights (tiny sizes: seconds on CPU)."""

import pytest

torch = pytest.importorskip("torch")

from backend.config import ModelConfig
from backend.generate_ref import beam_search, greedy_generate
from backend.model_runner import Batch, ModelRunner, SeqInput
from backend.weights import load_hf_dir, random_weights

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37]]


def _hf_model(config, weights):
    transformers = pytest.importorskip("transformers")
    cls, cfg_cls = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "opt": (transformers.OPTForCausalLM, transformers.OPTConfig),
    }[config.arch]
    model = cls(cfg_cls(**config.to_hf_config())).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-llama-tied", "tiny-opt"])
def tiny(request):
    config = ModelConfig.from_name(request.param)
    weights = random_weights(config, seed=3)
    return config, weights, _hf_model(config, weights)


def _runner(config, weights, block_size=4, **kw):
    kw.setdefault("num_gpu_blocks", 128)
    return ModelRunner(config, weights, device="cpu", dtype=torch.float32, block_size=block_size, **kw)


@torch.no_grad()
def _hf_last_logits(hf, seqs):
    return torch.stack([hf(torch.tensor([s])).logits[0, -1] for s in seqs])


def _tables(n, per=16):
    # interleaved, non-contiguous block ids
    return [[i + n * j for j in range(per)] for i in range(n)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_logits_match_hf_prefill_decode_and_chunks(tiny, block_size):
    config, weights, hf = tiny
    r = _runner(config, weights, block_size=block_size, num_gpu_blocks=200)
    tables = _tables(3, per=-(-40 // block_size))
    # 1) three prompts of different lengths prefilled together; the second samples nothing yet
    first = [PROMPTS[0], PROMPTS[1], PROMPTS[2][:10]]
    out = r.execute(Batch([SeqInput(p, 0, t, samples=(i != 2)) for i, (p, t) in enumerate(zip(first, tables))]))
    torch.testing.assert_close(out, _hf_last_logits(hf, first[:2]), atol=1e-4, rtol=1e-4)
    # 2) decodes mixed with a prefill chunk that attends to its cached prefix
    step = [SeqInput([40], 7, tables[0]), SeqInput(PROMPTS[2][10:], 10, tables[2]), SeqInput([41], 2, tables[1])]
    out = r.execute(Batch(step))
    want = _hf_last_logits(hf, [PROMPTS[0] + [40], PROMPTS[2], PROMPTS[1] + [41]])
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_greedy_matches_hf(tiny):
    config, weights, hf = tiny
    r = _runner(config, weights)
    ours = greedy_generate(r, PROMPTS, max_new_tokens=12)
    chunked = greedy_generate(r, PROMPTS, max_new_tokens=12, prefill_chunk=5)
    with torch.no_grad():
        refs = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert ours == refs
    assert chunked == refs


def test_swap_and_copy_inside_execute(tiny):
    """Swap a sequence's blocks out, let another sequence overwrite them, swap them back in to other
    blocks and continue decoding; and fork via a block copy."""
    config, weights, hf = tiny
    r = _runner(config, weights, num_gpu_blocks=16, num_cpu_blocks=8)
    a, b = PROMPTS[2][:10], PROMPTS[0]
    r.execute(Batch([SeqInput(a, 0, [0, 1, 2])]))                    # a in blocks 0..2 (10 tokens)
    r.execute(Batch([SeqInput(b, 0, [0, 1])], swap_out=[(0, 4), (1, 5), (2, 6)]))  # b clobbers 0, 1
    out = r.execute(Batch([SeqInput([50], 10, [7, 8, 9])], swap_in=[(4, 7), (5, 8), (6, 9)]))
    torch.testing.assert_close(out, _hf_last_logits(hf, [a + [50]]), atol=1e-4, rtol=1e-4)
    # fork a: share its two full blocks, copy the partial third block (3 tokens) to block 12
    out = r.execute(Batch([SeqInput([60], 11, [7, 8, 12]), SeqInput([61], 11, [7, 8, 9])], copies=[(9, 12)]))
    want = _hf_last_logits(hf, [a + [50, 60], a + [50, 61]])
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.0, "never"), (2.0, True), (-0.5, False)])
def test_beam_search_matches_hf(length_penalty, early_stopping):
    config = ModelConfig.from_name("tiny-llama")
    weights = random_weights(config, seed=5)
    hf = _hf_model(config, weights)
    r = _runner(config, weights, num_gpu_blocks=256)
    prompt = [7, 8, 9, 10]
    # an EOS the model actually produces, so that hypotheses finish early
    eos = greedy_generate(r, [prompt], max_new_tokens=4)[0][2]
    ours = beam_search(r, prompt, num_beams=3, max_new_tokens=10, eos_token_id=eos,
                       length_penalty=length_penalty, early_stopping=early_stopping)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=3, do_sample=False, max_new_tokens=10,
                          num_return_sequences=3, eos_token_id=eos, pad_token_id=eos,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          return_dict_in_generate=True, output_scores=True)
    assert len(ours) == 3
    for (tokens, score), seq, ref_score in zip(ours, out.sequences, out.sequences_scores):
        ref = seq[len(prompt):].tolist()
        if eos in ref:
            ref = ref[:ref.index(eos) + 1]
        assert tokens == ref
        assert score == pytest.approx(float(ref_score), abs=1e-4)


def test_runner_rejects_bad_batches():
    config = ModelConfig.from_name("tiny-llama")
    r = _runner(config, random_weights(config))
    with pytest.raises(ValueError, match="block_table"):
        r.execute(Batch([SeqInput([1, 2, 3, 4, 5], 0, [0])]))
    with pytest.raises(ValueError, match="at least one token"):
        r.execute(Batch([SeqInput([], 0, [0])]))
    with pytest.raises(ValueError, match="max_position"):
        r.execute(Batch([SeqInput([1], config.max_position, list(range(128)))]))
    assert r.execute(Batch([], copies=[(0, 1)])).shape == (0, config.vocab_size)


def test_random_weights_keep_activations_sane():
    config = ModelConfig(name="llama-8l", arch="llama", num_layers=8, hidden_size=256, num_heads=8, num_kv_heads=2,
                         head_dim=32, intermediate_size=688, vocab_size=1000, max_position=256)
    w1, w2 = random_weights(config, seed=0), random_weights(config, seed=0)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(w1["lm_head.weight"], random_weights(config, seed=1)["lm_head.weight"])
    r = _runner(config, w1, block_size=16)
    logits = r.execute(Batch([SeqInput(list(range(100)), 0, list(range(7)))]))
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std() < 30
    probs = logits.softmax(-1)
    assert probs.max() < 0.999  # not collapsed onto one token


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_hf_dir_loader(tmp_path, name):
    config = ModelConfig.from_name(name)
    weights = random_weights(config, seed=2)
    hf = _hf_model(config, weights)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded_config, loaded = load_hf_dir(tmp_path)
    assert loaded_config == config.replace(name=tmp_path.name)
    assert set(loaded) == set(weights)
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_hf_dir_loader_accepts_unprefixed_opt_names(tmp_path):
    import json

    from safetensors.torch import save_file

    config = ModelConfig.from_name("tiny-opt")
    weights = random_weights(config, seed=2)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_config()))
    save_file({k.removeprefix("model."): v.contiguous() for k, v in weights.items()}, str(tmp_path / "m.safetensors"))
    _, loaded = load_hf_dir(tmp_path)
    assert set(loaded) == set(weights)


@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_runner_matches_cpu(dtype):
    config = ModelConfig.from_name("tiny-llama")
    weights = random_weights(config, seed=4)
    cpu = _runner(config, weights)
    gpu = ModelRunner(config, weights, device="cuda", dtype=getattr(torch, dtype), num_gpu_blocks=128, block_size=4)
    assert gpu.attention.__module__.endswith("triton_kernels")
    tol = 1e-3 if dtype == "float32" else 0.15
    tables = _tables(3)
    batches = [Batch([SeqInput(p, 0, t) for p, t in zip(PROMPTS, tables)]),
               Batch([SeqInput([40], 7, tables[0]), SeqInput([41], 2, tables[1]), SeqInput([42, 43], 18, tables[2])])]
    for b in batches:
        torch.testing.assert_close(gpu.execute(b).cpu(), cpu.execute(b), atol=tol, rtol=tol)


def test_half_precision_runner_on_cpu_is_close():
    config = ModelConfig.from_name("tiny-llama")
    weights = random_weights(config, seed=6)
    ref = _runner(config, weights)
    half = ModelRunner(config, weights, device="cpu", dtype=torch.bfloat16, num_gpu_blocks=64, block_size=4)
    assert half.kv_cache.gpu.dtype == torch.bfloat16
    assert next(half.model.parameters()).dtype == torch.bfloat16
    batch = Batch([SeqInput(p, 0, t) for p, t in zip(PROMPTS, _tables(3))])
    out = half.execute(batch)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.execute(batch), atol=0.15, rtol=0.05)


def test_prepacked_cpu_linears_match_the_dense_path(tiny):
    config, weights, _ = tiny
    dense, packed = _runner(config, weights, prepack=False), _runner(config, weights, prepack=True)
    assert any(isinstance(m, torch.nn.Linear) for m in dense.model.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.model.modules())  # all prepacked, head too
    batch = Batch([SeqInput(p, 0, t) for p, t in zip(PROMPTS, _tables(3))])
    torch.testing.assert_close(packed.execute(batch), dense.execute(batch), atol=1e-4, rtol=1e-4)
