"""`pagesim generate` and `pagesim live` end to end, and their bad-input errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest

pytest.importorskip("torch")

from pagesim.cli import main as cli_main


def test_unknown_model_lists_known(capsys):
    assert cli_main(["generate", "--model", "gpt-9", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "gpt-9" in err and "smollm2-135m" in err


def test_generate_json_greedy(smollm2_path, capsys):
    code = cli_main(["generate", "--prompt", "The capital of France is", "--prompt", "1, 2, 3,",
                     "--max-tokens", "4", "--json"])
    assert code == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x["prompt"] for x in lines] == ["The capital of France is", "1, 2, 3,"]
    for x in lines:
        (c,) = x["completions"]
        assert 1 <= len(c["token_ids"]) <= 4 and isinstance(c["text"], str)
        assert x["prompt_token_ids"]
    assert "Paris" in lines[0]["completions"][0]["text"]


def test_generate_with_each_cpu_attention_backend_gives_the_same_tokens(smollm2_path, capsys):
    outs = []
    for backend in ("torch", "torch-compiled"):
        assert cli_main(["generate", "--prompt", "1, 2, 3,", "--max-tokens", "6", "--json", "--attention", backend]) == 0
        outs.append(json.loads(capsys.readouterr().out)["completions"][0]["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 6
    assert cli_main(["generate", "--prompt", "hi", "--attention", "flash"]) == 2
    assert "unknown attention backend 'flash'" in capsys.readouterr().err


def test_generate_rejects_empty_and_too_long_prompts(smollm2_path, capsys):
    assert cli_main(["generate", "--prompt", "", "--max-tokens", "2"]) == 2
    assert "empty" in capsys.readouterr().err
    assert cli_main(["generate", "--prompt", "word " * 9000, "--max-tokens", "2"]) == 2
    assert "context" in capsys.readouterr().err


def test_cuda_without_a_cuda_device_is_a_value_error():
    import torch

    from backend.model_runner import ModelRunner
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    # was: torch's "Torch not compiled with CUDA enabled" AssertionError, a traceback from `pagesim live
    # --device cuda` mid-load; a ValueError is the commands' one-line error
    with pytest.raises(ValueError, match=r"device 'cuda': this torch .* sees no CUDA device; use --device cpu"):
        ModelRunner(None, {}, "cuda")


def test_live_replays_a_trace_and_writes_the_sim_tables(smollm2_path, tmp_path):
    trace = tmp_path / "t.csv"  # three short requests (the fixed workload's 512 + 128 tokens took minutes on CPU)
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,40,12\n0.1,24,8\n0.2,56,10\n")
    out = tmp_path / "live"
    code = cli_main(["live", "--trace", str(trace), "--num-requests", "3", "--rate", "20", "--no-realtime",
                     "--model", "smollm2-135m", "--num-gpu-blocks", "128", "--out", str(out), "--quiet"])
    assert code == 0
    req = pd.read_csv(out / "requests.csv")
    assert len(req) == 3 and (req.status == "finished").all()
    it = pd.read_parquet(out / "iterations.parquet")
    assert it.duration.gt(0).all() and it.decode_tokens.sum() > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "live" and summary["num_finished"] == 3
