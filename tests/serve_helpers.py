"""What the tests of `pagesim serve` (live and --emulate) share: a free port, a server started and
waited for, a metric read from /metrics, and a guidellm run against a server."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], port: int, timeout: float = 300) -> subprocess.Popen:
    """`python -m pagesim serve ...` (`args` after `pagesim`), once its /health answers 200 on
    `port`; the test fails with the server's output if it exits or does not answer in `timeout` s."""
    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "pagesim", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"server did not start: {proc.stdout.read()}")
        time.sleep(0.3)


def metric(server: dict, name: str) -> float:
    """The sum of a metric's samples named `name` on the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server["base"] + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def run_guidellm(server: dict, model: str, tmp: Path, streams: int, prompt_tokens: int, output_tokens: int,
                 count: int) -> Path:
    """guidellm (`streams` concurrent streams, `count` synthetic completions) against the server; its
    JSON result file. Prompts are made with SmolLM2's tokenizer, saved as a HF folder (guidellm needs
    one). Skips when guidellm or the tokenizer is missing."""
    from backend.tokenizer import GGUFTokenizer

    exe = shutil.which("guidellm") or str(Path(sys.executable).parent / "guidellm")
    if not Path(exe).exists():
        pytest.skip("guidellm is not installed (dev extra)")
    try:
        tok = GGUFTokenizer.from_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    (tmp / "tok").mkdir()
    tok.tk.save(str(tmp / "tok" / "tokenizer.json"))
    (tmp / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token}))
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": server["base"], "model": model,
                    "request_format": "/v1/completions"},
        "profile": {"kind": "concurrent", "streams": streams},
        "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tmp / "tok")},
        "constraints": [{"kind": "max_requests", "count": count}]}}
    (tmp / "scenario.json").write_text(json.dumps(scenario))
    run = subprocess.run([exe, "run", "--config", str(tmp / "scenario.json"), "--output",
                          f"kind=json,path={tmp / 'result.json'}", "--disable-console"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return tmp / "result.json"
