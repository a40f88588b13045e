"""The HTTP server under stuck and hostile clients, with real sockets on loopback: uvicorn with the
GuardedHttpProtocol and the BoundedServer (backend/http_server.py) over the OpenAI API and the
AsyncEngine, in this process on the tiny random-weights model (a server thread per test; a
"signal" is `handle_exit` called from the test, as the signal handler would). Every wait is bounded."""

from __future__ import annotations

import json
import logging
import math
import re
import signal
import socket
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("uvicorn")
pytest.importorskip("httptools")
pytest.importorskip("prometheus_client")

from backend.async_engine import AsyncEngine
from backend.http_api import OpenAIServer, ServeOptions
from backend.http_server import http_server
from backend.live_executor import build_live_replica, load_model
from backend.model_runner import ModelRunner
from backend.serve_metrics import ServeMetrics
from policies.metrics import summarize
from policies.replica_config import ReplicaConfig

MODEL = "tiny"
WAIT = 20.0  # the most any step of these tests waits for the server


class ByteTokenizer:
    """One token per id, decoded as that character (the tiny model's vocabulary is 256 ids)."""

    vocab_size = 256

    def encode(self, text):
        return [ord(c) % 256 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(r.getMessage() + (" TRACEBACK" if r.exc_info else "") for r in self.records)


class Served:
    """A server on a free loopback port in a background thread; `stop()` returns the tables."""

    def __init__(self, tiny, max_pending=0, drain=True, shutdown_timeout=20.0, header_timeout=10.0,
                 body_timeout=30.0) -> None:
        config = tiny[0]
        self.engine = _engine(tiny)
        self.metrics = ServeMetrics(MODEL)
        self.engine.observer = self.metrics
        api = OpenAIServer(self.engine, ByteTokenizer(), self.metrics,
                           ServeOptions(MODEL, config.max_position, max_pending, body_timeout=body_timeout))
        self.server = http_server(api, self.engine, self.metrics, "127.0.0.1", 0, drain=drain,
                                  shutdown_timeout=shutdown_timeout, header_timeout=header_timeout)
        self.engine.start()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + WAIT
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.log = LogLines()  # after uvicorn configured its loggers (that drops their handlers)
        logging.getLogger("uvicorn.error").addHandler(self.log)

    def signal(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self):
        if self.thread.is_alive():
            self.signal()
            self.thread.join(WAIT)
        assert not self.thread.is_alive()
        self.engine.stop(drain=False, timeout=WAIT)
        logging.getLogger("uvicorn.error").removeHandler(self.log)
        return self.engine.tables()

    def metric(self, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = self.metrics.exposition().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    def wait_for(self, name: str, value: float) -> None:
        deadline = time.time() + WAIT
        while self.metric(name) < value:
            assert time.time() < deadline, f"{name} stayed at {self.metric(name)}, short of {value}"
            time.sleep(0.02)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=WAIT)


def _engine(tiny) -> AsyncEngine:
    config, weights = tiny
    runner = ModelRunner(config, weights, "cpu", dtype=torch.float32, num_gpu_blocks=64, block_size=16,
                         attention="torch")
    replica = build_live_replica(ReplicaConfig(64, 16, max_num_seqs=4), runner, [config.eos_token_id], seed=0)
    return AsyncEngine(replica)


@pytest.fixture(scope="module")
def tiny():
    model = load_model("tiny-llama", seed=0)
    return model.config, model.weights


@pytest.fixture
def serve(tiny):
    made: list[Served] = []

    def start(**kw) -> Served:
        made.append(Served(tiny, **kw))
        return made[-1]

    yield start
    for s in made:  # a failed test still stops its server
        if s.thread.is_alive():
            s.server.handle_exit(signal.SIGINT, None)
            s.server.handle_exit(signal.SIGINT, None)
            s.thread.join(WAIT)
        s.engine.stop(drain=False, timeout=WAIT)


def _call(body: dict, path: str = "/v1/completions") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def _head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


def _read_to_close(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _json_body(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def _stream(prompt: list[int], max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        chunk = sock.recv(65536)
        assert chunk, f"closed before {marker!r}: {got[-300:]!r}"
        got += chunk
    return got


def test_slow_or_missing_headers_get_408_and_the_connection_closes(serve):
    s = serve(header_timeout=0.5)
    partial, silent = s.connect(), s.connect()
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\n")  # and never the rest
    t0 = time.perf_counter()
    answers = [_read_to_close(partial), _read_to_close(silent)]
    waited = time.perf_counter() - t0
    for a in answers:
        assert a.startswith(b"HTTP/1.1 408") and _json_body(a)["error"]["code"] == "request_timeout"
    assert 0.4 < waited < 5
    assert s.metric("pagesim:requests_timed_out_total") == 2
    assert s.log.text().count("request head not received") == 2
    reqs, _ = s.stop()
    assert len(reqs) == 0


def test_a_body_that_does_not_arrive_is_408(serve):
    s = serve(body_timeout=0.5)
    with s.connect() as c:
        c.sendall(_head(100) + b'{"model": ')
        t0 = time.perf_counter()
        answer = _read_to_close(c)  # connection: close, the rest of the body is never read
        assert time.perf_counter() - t0 < 5
    assert answer.startswith(b"HTTP/1.1 408") and _json_body(answer)["error"]["code"] == "request_timeout"
    assert s.metric("pagesim:requests_timed_out_total") == 1 and s.metric("pagesim:requests_refused_total") == 0
    s.stop()


def test_a_client_leaving_during_its_upload_is_a_metric_and_one_line(serve):
    s = serve()
    with s.connect() as c:
        c.sendall(_head(100) + b'{"model": ')
        time.sleep(0.2)
    s.wait_for("pagesim:uploads_abandoned_total", 1)
    reqs, _ = s.stop()
    lines = [r for r in s.log.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "left during its upload" in lines[0].getMessage() and not lines[0].exc_info
    assert "10 of 100 body bytes" in lines[0].getMessage()
    assert len(reqs) == 0


def test_a_pipelined_stream_whose_client_leaves_is_aborted(serve):
    """Two streams back to back on one connection; the client leaves after the first event. The
    HTTP layer reports the disconnect to the second (queued) request; the first learns of it from
    its failed sends, and is aborted with its blocks freed, not generated to the end."""
    s = serve()
    with s.connect() as c:
        c.sendall(_call(_stream(list(range(10, 30)), 480)) + _call(_stream(list(range(40, 60)), 480)))
        _read_until(c, b"data: ")
    s.wait_for("pagesim:requests_aborted_total", 1)
    deadline = time.time() + WAIT
    while s.engine.num_outstanding:
        assert time.time() < deadline
        time.sleep(0.02)
    assert s.metric("vllm:kv_cache_usage_perc") == 0
    reqs, _ = s.stop()
    (row,) = reqs.itertuples()  # the queued second request never reached the engine
    assert row.status == "aborted" and row.reject_reason == "aborted: client disconnected"
    assert 1 <= row.output_len < 480 and row.ttft > 0
    assert not [r for r in s.log.records if r.levelno >= logging.ERROR], s.log.text()
    s.engine.scheduler.assert_drained()


def test_a_batch_over_max_pending_is_400_and_refusals_use_no_ids(serve):
    s = serve(max_pending=2)
    with s.connect() as c:
        c.sendall(_call({"model": MODEL, "prompt": [[5, 6], [7, 8], [9, 10]], "max_tokens": 2}))
        answer = c.recv(65536)
    err = _json_body(answer)["error"]
    assert answer.startswith(b"HTTP/1.1 400") and err["param"] == "prompt" and "--max-pending 2" in err["message"]
    with s.connect() as c:
        c.sendall(_call({"model": MODEL, "prompt": [[5, 6], [7, 8]], "max_tokens": 2}))
        answer = _read_until(c, b'"usage"')
    assert answer.startswith(b"HTTP/1.1 200")
    reqs, _ = s.stop()
    assert list(reqs.request_id) == [0, 1] and set(reqs.status) == {"finished"}


def test_aborted_rows_keep_ttft_and_tables_agree_with_metrics(serve):
    """A finished request, one whose client leaves after three tokens, one refused: the table
    has a row for each engine request with what happened to it, and /metrics counts the same."""
    s = serve()
    with s.connect() as c:
        c.sendall(_call({"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 4, "ignore_eos": True}))
        assert _read_until(c, b'"usage"').startswith(b"HTTP/1.1 200")
    with s.connect() as c:
        c.sendall(_call(_stream(list(range(20, 40)), 480)))
        got = b""
        while got.count(b"data: ") < 3:
            got += c.recv(65536)
    with s.connect() as c:
        c.sendall(_call({"model": "other", "prompt": [1], "max_tokens": 1}))
        assert c.recv(65536).startswith(b"HTTP/1.1 400")
    s.wait_for("pagesim:requests_aborted_total", 1)
    reqs, its = s.stop()
    assert list(reqs.status) == ["finished", "aborted"]
    aborted = reqs.iloc[1]
    assert aborted.output_len >= 3 and aborted.ttft > 0 and math.isnan(aborted.e2e_latency)
    assert s.metric("vllm:request_success_total") == (reqs.status == "finished").sum()
    assert s.metric("pagesim:requests_aborted_total") == (reqs.status == "aborted").sum()
    assert s.metric("pagesim:requests_rejected_total") == (reqs.status == "rejected").sum() == 0
    assert s.metric("vllm:time_to_first_token_seconds_count") == reqs.ttft.notna().sum() == 2
    summary = summarize(reqs, its)
    assert summary["num_finished"] + summary["num_rejected"] + (reqs.status == "aborted").sum() == len(reqs)
    assert summary["num_rejected"] == 0


def test_shutdown_deadline_cuts_a_stalled_body_off(serve):
    """SIGTERM with a client stalled halfway through its body: the drain stops waiting after the
    shutdown timeout, the client gets 503, and the server returns."""
    s = serve(shutdown_timeout=1.0)
    with s.connect() as c:
        c.sendall(_head(100) + b'{"model": ')
        time.sleep(0.2)
        t0 = time.perf_counter()
        s.signal()
        answer = _read_to_close(c)
        s.thread.join(WAIT)
        stopped = time.perf_counter() - t0
    assert not s.thread.is_alive() and 1.0 <= stopped < 1.0 + 4
    assert answer.startswith(b"HTTP/1.1 503") and _json_body(answer)["error"]["code"] == "shutting_down"
    s.stop()


def test_second_signal_stops_at_once_and_aborted_streams_end_with_abort(serve):
    """--on-shutdown abort with a long shutdown timeout: the first signal aborts the stream (a
    choice with finish_reason "abort", then [DONE]) while a stalled body keeps the server
    waiting; a second signal ends it at once."""
    s = serve(drain=False, shutdown_timeout=60.0)
    stalled, streaming = s.connect(), s.connect()
    stalled.sendall(_head(100) + b'{"model": ')
    streaming.sendall(_call(_stream(list(range(20, 40)), 480)))
    _read_until(streaming, b"data: ")
    s.signal()
    tail = _read_until(streaming, b"data: [DONE]").decode()
    events = [json.loads(e) for e in re.findall(r"data: (\{[^\n]*\})\n\n", tail)]  # one event per chunk
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    time.sleep(1.0)
    assert s.thread.is_alive()  # still waiting for the stalled body
    t0 = time.perf_counter()
    s.signal()
    s.thread.join(WAIT)
    assert not s.thread.is_alive() and time.perf_counter() - t0 < 3
    answer = _read_to_close(stalled)  # a 503 if it was sent before the connection closed
    assert answer == b"" or answer.startswith(b"HTTP/1.1 503")
    stalled.close()
    streaming.close()
    reqs, _ = s.stop()
    assert list(reqs.status) == ["aborted"] and reqs.reject_reason[0] == "aborted: server shutdown"


def test_tables_are_written_when_the_http_server_fails(tiny, tmp_path, monkeypatch):
    """`pagesim serve` whose port is taken: uvicorn exits at startup, and the run's tables are
    still written (the engine and tables are the tiny model's, the rest is the command's own)."""
    import pagesim.serve as serve_cmd
    from pagesim.cli import build_parser

    engine = _engine(tiny)
    monkeypatch.setattr(serve_cmd, "_build_engine", lambda args: (engine, ByteTokenizer(), 512))
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # leave this process's handlers alone
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = build_parser().parse_args(["serve", "--model", "smollm2-135m", "--port", str(port), "--out",
                                          str(tmp_path / "run")])
        with pytest.raises(SystemExit):
            serve_cmd.cmd_serve(args)
    assert not engine.alive
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["num_requests"] == 0 and summary["pool_whole"]
    assert (tmp_path / "run" / "requests.csv").is_file() and (tmp_path / "run" / "iterations.parquet").is_file()
