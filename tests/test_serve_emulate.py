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
    from sim.calibrated import load_calibration

    # the calibration's output lag as run, unrounded (1.28 steps: the fraction is held, tests/test_output_lag.py)
    assert summary["output_lag_steps"] == load_calibration("vllm-v1-h100").params.client_output_lag_steps
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


def _port_pair() -> int:
    """A free port whose successor is free too (one for each of two replicas)."""
    for _ in range(20):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    pytest.skip("no two consecutive free ports")


class _SseReader(threading.Thread):
    """Reads GET /v1/kv_events into `batches` (the decoded JSON of each event) until it ends."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.batches, self.ids = url, [], []

    def run(self) -> None:
        with httpx.stream("GET", self.url, timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("id: "):
                    self.ids.append(int(line[4:]))
                elif line.startswith("data: "):
                    self.batches.append(json.loads(line[6:]))

    def events(self, kind: str) -> list[dict]:
        return [e for b in list(self.batches) for e in b["events"] if e["type"] == kind]

    def wait_for(self, test, what: str, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while not test():
            assert time.time() < deadline, f"the KV-event stream never showed {what}: {self.batches[-3:]}"
            time.sleep(0.05)


def _chain(tokens: list[int], block_size: int = 16) -> list[int]:
    """docs/serving.md's block hashes of a token-id prompt's full blocks (unsigned 64-bit)."""
    out, parent = [], 0
    for j in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[j * block_size:(j + 1) * block_size])))
        out.append(parent & (2**64 - 1))
    return out


def test_kv_events_streams_per_replica_http_and_zmq(tmp_path):
    """--kv-events on two replicas with a 64-block cache: replica 0's stream shows BlockStored for
    a prompt's full blocks (the documented hashes, its token ids, chained), then BlockRemoved for
    them once other prompts evict them; replica 1's stream stays its own. The same batches come
    over vLLM's ZeroMQ + msgpack format, and its replay socket gives them from sequence 0."""
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    base, zport, rport = _port_pair(), _port_pair(), _port_pair()
    proc = _start([*CLI, "--replicas", "2", "--port-base", str(base), "--prefix-caching", "--num-gpu-blocks", "64",
                   "--kv-events", "--kv-events-zmq", f"tcp://127.0.0.1:{zport}",
                   "--kv-events-replay", f"tcp://127.0.0.1:{rport}", "--out", str(tmp_path / "run")], base)
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{zport}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        readers = [_SseReader(f"http://127.0.0.1:{base + i}/v1/kv_events") for i in range(2)]
        for r in readers:
            r.start()
        readers[0].wait_for(lambda: readers[0].batches, "its opening snapshot")
        assert readers[0].batches[0]["snapshot"] and readers[0].batches[0]["events"][0]["type"] == "AllBlocksCleared"
        assert httpx.get(f"http://127.0.0.1:{base}/v1/kv_events?since=x", timeout=10).status_code == 400
        time.sleep(0.3)  # ZeroMQ's subscription reaches the publisher
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{base}/v1", api_key="none", max_retries=0)
        prompt = list(range(1000, 1000 + 3 * 16 + 5))
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
        want = _chain(prompt)
        readers[0].wait_for(lambda: any(e["block_hashes"][:3] == want for e in readers[0].events("BlockStored")),
                            "the prompt's blocks stored")
        stored = next(e for e in readers[0].events("BlockStored") if e["block_hashes"][:3] == want)
        assert stored["token_ids"][:48] == prompt[:48] and stored["parent_block_hash"] is None
        assert stored["block_size"] == 16 and stored["medium"] == "GPU"
        for k in range(4):  # distinct prompts of 20 blocks each: the first prompt's idle blocks are evicted
            c.completions.create(model=MODEL, prompt=list(range(2000 + 400 * k, 2000 + 400 * k + 320)), max_tokens=2,
                                 extra_body={"ignore_eos": True})
        removed = lambda: {h for e in readers[0].events("BlockRemoved") for h in e["block_hashes"]}
        readers[0].wait_for(lambda: set(want) <= removed(), "the prompt's blocks removed")
        assert readers[0].ids == sorted(readers[0].ids) and len(set(readers[0].ids[1:])) == len(readers[0].ids) - 1
        assert not readers[1].events("BlockStored")  # replica 1 served nothing
        # vLLM's reset: the cache forgets every hash at once, and says so
        assert httpx.post(f"http://127.0.0.1:{base}/reset_prefix_cache", timeout=30).json() == {"reset": True}
        readers[0].wait_for(lambda: any(e["type"] == "AllBlocksCleared" for b in readers[0].batches[1:]
                                        if not b["snapshot"] for e in b["events"]), "the reset")
        # vLLM's wire format: (topic, 8-byte sequence number, msgpack [ts, events])
        got = {}
        while sub.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b""  # the default topic
            got[int.from_bytes(seq, "big")] = msgpack.unpackb(payload)
        assert got and all(isinstance(ts, float) for ts, _ in got.values())
        z_stored = [e for _, evs in got.values() for e in evs if e[0] == "BlockStored"]
        assert any(e[1][:3] == want and e[3][:48] == prompt[:48] and e[4] == 16 for e in z_stored)
        replay = ctx.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{rport}")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while replay.poll(5000):
            _, seq, payload = replay.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        assert replayed[0] == (0, [replayed[0][1][0], [["AllBlocksCleared"]]])
        assert [s for s, _ in replayed] == list(range(len(replayed))) and len(replayed) >= max(got) + 1
    finally:
        ctx.destroy(linger=0)
        out = _stop(proc)
    for r in readers:
        r.join(10)
        assert not r.is_alive(), "the KV-event stream did not end with the server"
    assert proc.returncode == 0, out


# --- benchmarks/bench_emulate's fidelity window (no server) -------------------------------------

def _bench_stage(name: str):
    from benchmarks import bench_emulate

    if not bench_emulate.MEASUREMENTS.exists():
        pytest.skip(f"no measurements at {bench_emulate.MEASUREMENTS}")
    return bench_emulate._stage(name)


def test_fidelity_warm_up_is_whole_prompt_cycles():
    import dataclasses

    from benchmarks.bench_emulate import warm_up_requests

    exp, stage = _bench_stage("codegen#0")
    cycle = exp.workload.num_groups * exp.workload.prompts_per_group
    assert warm_up_requests(exp, stage, 1) == cycle
    assert warm_up_requests(exp, stage, 2) == 2 * cycle
    assert warm_up_requests(exp, stage, 0) == 0
    assert warm_up_requests(dataclasses.replace(exp, workload=None), stage, 1) == 0  # recorded requests: no cycle
    with pytest.raises(ValueError, match="--warm-up-cycles"):
        warm_up_requests(exp, stage, -1)


def test_first_prompt_cycle_meets_a_cold_prefix_cache():
    """Why the warm-up: the stage's prompts repeat every cycle, so after the first one the prefix cache
    holds them and the engine's TTFT drops; a window of the first cycle alone overstates TTFT against
    a measurement of minutes. The window's figures leave the warm-up out."""
    from analysis.measurements import stage_config
    from benchmarks.bench_emulate import CALIBRATION, simulate_window, warm_up_requests

    exp, stage = _bench_stage("codegen#0")
    cfg = stage_config(exp, stage, calibration=CALIBRATION)
    skip = warm_up_requests(exp, stage, 1)
    trace, res = simulate_window(exp, stage, cfg, skip / stage.rate + 5.0, skip)
    assert len(trace) > skip and len(res.requests) == len(trace) - skip
    assert res.requests.request_id.min() == skip
    _, cold = simulate_window(exp, stage, cfg, skip / stage.rate + 5.0, 0)
    engine_ttft = (cold.requests.first_token_time - cold.requests.arrival).to_numpy()
    first, later = engine_ttft[:skip].mean(), engine_ttft[skip:].mean()
    assert later < 0.9 * first
    assert res.predicted["ttft_mean"] < cold.predicted["ttft_mean"]


def test_client_metrics_leave_out_the_warm_up_and_failures():
    from benchmarks.bench_emulate import client_metrics

    records = [{"ttft": 1.0, "e2e": 9.0, "tokens": 5}, {"error": "ReadError"},
               {"ttft": 0.1, "e2e": 0.5, "tokens": 5}, {"ttft": 0.3, "e2e": 0.9, "tokens": 5}]
    got = client_metrics(records, time_scale=0.5, skip=1)
    assert got["ttft_mean"] == pytest.approx(0.5 * 0.2)
    assert got["e2e_mean"] == pytest.approx(0.5 * 0.7)
    assert got["tpot"] == pytest.approx(0.5 * (0.7 - 0.2) / 4)
    with pytest.raises(ValueError, match="no successful request"):
        client_metrics(records[:2], time_scale=1.0, skip=1)


def test_fidelity_window_grows_until_simulate_over_it_matches_the_whole_stage():
    import argparse

    from analysis.measurements import simulate_stage, stage_config
    from benchmarks.bench_emulate import CALIBRATION, STEADY_METRICS, steady_window, warm_up_requests

    exp, stage = _bench_stage("codegen#0")
    cfg = stage_config(exp, stage, calibration=CALIBRATION)
    skip = warm_up_requests(exp, stage, 1)
    whole = simulate_stage(exp, stage, cfg, seed=cfg.seed).predicted
    args = argparse.Namespace(duration=5.0, max_duration=20.0, steady_tolerance=0.02)
    duration, trace, sim, steady = steady_window(exp, stage, cfg, skip, whole, args)
    assert steady and duration in (5.0, 10.0, 20.0)
    assert all(abs(sim.predicted[m] / whole[m] - 1) <= 0.02 for m in STEADY_METRICS)
    assert trace.arrival[-1] - trace.arrival[0] <= skip / stage.rate + duration
    # a target no window reaches: doubled up to --max-duration, then flagged
    far = {**whole, "ttft_mean": 1.5 * whole["ttft_mean"]}
    duration, _, _, steady = steady_window(exp, stage, cfg, skip, far, args)
    assert not steady and duration == 20.0
