"""`pagesim serve --emulate` driven by clients no one here wrote (the official `openai` package,
httpx, guidellm): a server subprocess for the module, Llama-7B emulated on an H100 at 5x real time;
the last test stops it with SIGTERM and reads its tables. A second server runs two replicas."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from tests.serve_helpers import free_port, metric, run_guidellm, start_server

pytestmark = pytest.mark.slow
MODEL = "llama-7b"
CLI = ["serve", "--emulate", "--model", MODEL, "--hardware", "h100-sxm",
       "--calibration", "vllm-v1-h100", "--time-scale", "5", "--debug"]


def _start(args: list[str], port: int) -> subprocess.Popen:
    return start_server(args, port, timeout=120)


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("emulate")
    port = free_port()
    proc = _start([*CLI, "--port", str(port), "--out", str(out / "run")], port)
    yield {"base": f"http://127.0.0.1:{port}", "proc": proc, "out": out / "run"}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="none", max_retries=0)


def _tokenizer():
    from backend.text_tokens import ByteChunkTokenizer
    from sim.specs import get_model

    return ByteChunkTokenizer(get_model(MODEL).vocab_size)  # the server's documented approximation


def test_completions_lengths_usage_and_text_agree(server):
    c, tok = _client(server), _tokenizer()
    r = c.completions.create(model=MODEL, prompt="Tell me a story about a cat", max_tokens=25,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 25
    assert len(tok.encode(r.choices[0].text)) == 25  # a client counting the text's tokens agrees
    assert r.usage.prompt_tokens == len(tok.encode("Tell me a story about a cat"))
    # without ignore_eos: a drawn length (mean 128), capped; "stop" when it ends before the cap
    ends = [c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=40, seed=s) for s in range(6)]
    for e in ends:
        n = e.usage.completion_tokens
        assert 1 <= n <= 40 and e.choices[0].finish_reason == ("length" if n == 40 else "stop")
        assert len(tok.encode(e.choices[0].text)) == n
    again = c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=40, seed=3)
    assert again.choices[0].text == ends[3].choices[0].text  # the request's seed decides its text


def test_chat_stream_and_whole_agree(server):
    c = _client(server)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, seed=9)
    chunks = [ch for ch in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, seed=9, stream=True,
                                                     stream_options={"include_usage": True})]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_and_stop_strings(server):
    c = _client(server)
    base = c.completions.create(model=MODEL, prompt="abc", max_tokens=30, seed=4, extra_body={"ignore_eos": True})
    words = base.choices[0].text.split(" ")
    stop = " " + words[10]
    cut = c.completions.create(model=MODEL, prompt="abc", max_tokens=30, seed=4, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base.choices[0].text[:base.choices[0].text.index(stop)]
    many = c.completions.create(model=MODEL, prompt="abc", max_tokens=8, n=3, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2] and many.usage.completion_tokens == 24


@pytest.mark.parametrize("body,status,param", [
    ({"model": "other", "prompt": "x"}, 400, "model"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"model": MODEL}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    r = httpx.post(server["base"] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status and r.json()["error"]["param"] == param


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    aborted = metric(server, "pagesim:requests_aborted_total")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                break
    deadline = time.time() + 30
    while metric(server, "pagesim:requests_aborted_total") < aborted + 1:
        assert time.time() < deadline, "the disconnected request was not aborted"
        time.sleep(0.1)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert httpx.get(server["base"] + "/health").status_code == 200  # --debug checked the pool


def test_metrics_vllm_names_and_release_lag(server):
    _client(server).completions.create(model=MODEL, prompt="x y z", max_tokens=3)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total", "vllm:generation_tokens_total",
                 "vllm:prompt_tokens_total", "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "pagesim:emulator_behind", "pagesim:emulator_time_scale"):
        httpx.get(server["base"] + "/metrics")
        assert name in httpx.get(server["base"] + "/metrics").text, name
    assert metric(server, "vllm:time_to_first_token_seconds_count") >= 1
    assert metric(server, "pagesim:token_release_lag_seconds_count") >= 3
    assert metric(server, "pagesim:emulator_time_scale") == 5


def test_guidellm_load(server, tmp_path):
    """guidellm (concurrent streams) against the emulated server: every request succeeds with the
    asked output length."""
    from analysis.benchmark_results import load_guidellm

    (exp,) = load_guidellm(run_guidellm(server, MODEL, tmp_path, streams=4, prompt_tokens=64, output_tokens=20,
                                        count=16))
    stage = exp.stages[0]
    assert stage.successes == 16 and stage.failures == 0
    assert set(stage.requests.output_len) == {20}


def test_sigterm_drains_in_flight_and_writes_tables(server):
    c = _client(server)
    seen = []

    def long_stream():
        for ch in c.completions.create(model=MODEL, prompt=list(range(100, 140)), max_tokens=300, stream=True,
                                       extra_body={"ignore_eos": True}):
            seen.extend(ch.choices)

    t = threading.Thread(target=long_stream)
    t.start()
    time.sleep(0.3)
    out = _stop(server["proc"])
    t.join(30)
    assert server["proc"].returncode == 0, out
    assert len(seen) == 300 and seen[-1].finish_reason == "length"  # drained, not cut
    summary = json.loads((server["out"] / "summary.json").read_text())
    assert summary["mode"] == "emulate" and summary["time_scale"] == 5 and summary["pool_whole"]
    assert summary["release_lag"]["releases"] >= 300
    import pandas as pd

    req = pd.read_csv(server["out"] / "requests.csv")
    assert (req.status == "finished").sum() >= 15 and int(req.output_len.max()) == 300


def test_replicas_on_consecutive_ports(tmp_path):
    base = free_port()
    with socket.socket() as s:  # the second port must be free too
        try:
            s.bind(("127.0.0.1", base + 1))
        except OSError:
            pytest.skip("the port after a free one is taken")
    proc = _start([*CLI, "--replicas", "2", "--port-base", str(base), "--out", str(tmp_path / "run")], base)
    try:
        for i in range(2):
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{base + i}/v1", api_key="none", max_retries=0)
            r = c.completions.create(model=MODEL, prompt="hi", max_tokens=4 + i, extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 4 + i
    finally:
        out = _stop(proc)
    assert proc.returncode == 0, out
    for i in range(2):
        summary = json.loads((tmp_path / "run" / f"replica-{i}" / "summary.json").read_text())
        assert summary["replica"] == i and summary["num_finished"] == 1


def _read_to_close(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_replicas_get_the_servers_timeouts_and_bounded_shutdown(tmp_path):
    """The emulated front end is `pagesim serve`'s (backend/http_server.py): a slow head gets 408 on
    either replica; on SIGTERM a stalled body and a stream that would run for seconds are cut off at
    --shutdown-timeout, the stream ends with finish_reason "abort", and both replicas write tables."""
    base = free_port()
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", base + 1))
        except OSError:
            pytest.skip("the port after a free one is taken")
    proc = _start([*CLI, "--time-scale", "1", "--replicas", "2", "--port-base", str(base), "--header-timeout", "0.5",
                   "--shutdown-timeout", "1", "--out", str(tmp_path / "run")], base)
    try:
        slow_head = socket.create_connection(("127.0.0.1", base + 1), timeout=10)
        slow_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert _read_to_close(slow_head).startswith(b"HTTP/1.1 408")
        slow_head.close()
        stalled = socket.create_connection(("127.0.0.1", base), timeout=10)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: 100\r\n\r\n{\"model\":")
        seen = []
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{base}/v1", api_key="none", max_retries=0)

        def long_stream():  # about 13 s of emulated decode at time scale 1
            for ch in c.completions.create(model=MODEL, prompt="hi", max_tokens=1900, stream=True,
                                           extra_body={"ignore_eos": True}):
                seen.extend(ch.choices)

        t = threading.Thread(target=long_stream)
        t.start()
        deadline = time.time() + 20
        while not seen and time.time() < deadline:
            time.sleep(0.05)
        t0 = time.perf_counter()
        out = _stop(proc)
        took = time.perf_counter() - t0
        t.join(10)
        stalled.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert took < 8, f"the shutdown took {took:.1f} s with --shutdown-timeout 1"
    assert 0 < len(seen) < 1900 and seen[-1].finish_reason == "abort"
    import pandas as pd

    for i in range(2):
        summary = json.loads((tmp_path / "run" / f"replica-{i}" / "summary.json").read_text())
        assert summary["replica"] == i and summary["pool_whole"]
    req = pd.read_csv(tmp_path / "run" / "replica-0" / "requests.csv")
    assert list(req.status) == ["aborted"] and req.reject_reason[0] == "aborted: server shutdown"
