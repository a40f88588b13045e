"""Backend test setup: Triton runs in interpreter mode (CPU) unless a CUDA device is present; shared,
session-scoped SmolLM2 and HF fixtures (loaded once; skipped with a reason when unavailable), and the
SmolLM2 GGUF read once per session however many commands load it in-process."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # the simulator-only install has no torch; the backend tests skip themselves
    HAS_CUDA = False

if not HAS_CUDA:
    # Must happen before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def smollm2_read_once():
    """`load_smollm2` and `GGUFTokenizer.from_gguf` memoized for the session: the fixtures below and every
    `pagesim generate/live/validate/...` run through `cli_main` share one read of the GGUF (each read
    dequantizes 135M weights and parses a 49k-token vocabulary: seconds apiece). Callers get their own
    dict of the same tensors; nothing writes into the tensors (ModelRunner copies them into its model)
    and the tokenizer holds no per-call state."""
    if "torch" not in globals():  # the simulator-only install: no backend to load
        yield
        return
    from backend import weights
    from backend.tokenizer import GGUFTokenizer

    read_weights = functools.cache(weights.load_smollm2)
    read_tokenizer = functools.cache(GGUFTokenizer.from_gguf)

    def load_smollm2():
        config, loaded = read_weights()
        return config, dict(loaded)

    def from_gguf(path=None):
        return read_tokenizer(Path(path or weights.smollm2_gguf_path()).resolve())  # None: the default path

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weights, "load_smollm2", load_smollm2)
        mp.setattr(GGUFTokenizer, "from_gguf", staticmethod(from_gguf))
        yield


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="session")
def smollm2_path():
    from backend.weights import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(config, weights) of SmolLM2-135M-Instruct, dequantized to float32."""
    from backend.weights import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="session")
def smollm2_runner(smollm2):
    """A float32 CPU ModelRunner on the real weights (exact comparisons with HF need float32)."""
    from backend.model_runner import ModelRunner

    config, weights = smollm2
    return ModelRunner(config, weights, device="cpu", dtype=torch.float32, num_gpu_blocks=160, block_size=16)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """HF transformers' model loaded from the same GGUF (float32, CPU)."""
    transformers = pytest.importorskip("transformers", reason="transformers is needed for the HF comparison")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    return model.eval()
