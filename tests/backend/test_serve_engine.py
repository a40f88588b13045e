"""AsyncEngine (the server's engine thread) on a tiny random-weights model, and the HTTP layer's
pure parts (request parsing, incremental text with stop strings): fast, no HTTP."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from backend.async_engine import AsyncEngine, EngineRequest, RequestOutput
from backend.live_executor import build_live_replica, load_model
from backend.model_runner import ModelRunner
from policies import Request, SamplingParams
from policies.replica_config import ReplicaConfig


class Sink:
    """Collects one request's outputs; `done` is set by its final one."""

    def __init__(self) -> None:
        self.outs: list[RequestOutput] = []
        self.done = threading.Event()
        self.first = threading.Event()

    def __call__(self, out: RequestOutput) -> None:
        self.outs.append(out)
        self.first.set()
        if out.finished:
            self.done.set()

    def tokens(self, choice: int = 0) -> list[int]:
        return [t for o in self.outs for t in o.new_tokens.get(choice, [])]


@pytest.fixture(scope="module")
def tiny():
    model = load_model("tiny-llama", seed=0)
    return model.config, model.weights


def _engine(tiny, num_blocks=32, max_num_seqs=8, seed=0, policy="vllm", **options) -> AsyncEngine:
    config, weights = tiny
    runner = ModelRunner(config, weights, "cpu", dtype=torch.float32, num_gpu_blocks=num_blocks, block_size=16,
                         attention="torch")
    replica = build_live_replica(ReplicaConfig(num_blocks, 16, max_num_seqs=max_num_seqs, policy=policy,
                                               policy_options=options), runner,
                                 [config.eos_token_id], seed=seed)
    engine = AsyncEngine(replica)
    engine.start()
    return engine


def _submit(engine, prompt, max_tokens=8, seed=None, **sp) -> Sink:
    sink = Sink()
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp)
    req = Request(engine.new_request_id(), engine.clock(), len(prompt), sp, prompt_token_ids=list(prompt))
    engine.submit(EngineRequest(req, sink, seed=seed))
    return sink


def _pool_whole(engine) -> None:
    engine.scheduler.check_conservation()
    engine.scheduler.bm.assert_empty()


def test_requests_stream_every_token_once_and_land_in_the_tables(tiny):
    engine = _engine(tiny)
    sinks = [_submit(engine, range(10 + i, 30 + 3 * i), max_tokens=5 + i) for i in range(4)]
    for s in sinks:
        assert s.done.wait(60)
    engine.stop()
    for i, s in enumerate(sinks):
        assert len(s.tokens()) == 5 + i and [o.finished for o in s.outs].count(True) == 1
        assert s.outs[-1].finish_reasons == {0: "length"} and s.outs[-1].error is None
    reqs, its = engine.tables()
    assert list(reqs.status) == ["finished"] * 4 and list(reqs.output_len) == [5, 6, 7, 8]
    assert (reqs.ttft > 0).all() and len(its) >= 8
    _pool_whole(engine)


# the waiting queue a deque (vllm), a heap (sjf: a predictor that needs no output length; priority), one
# FIFO a client (vtc): an abort takes the waiting request out of each
@pytest.mark.parametrize("policy, options", [("vllm", {}), ("sjf", {"predictor": "fitted"}), ("vtc", {}),
                                             ("priority", {})])
def test_abort_running_and_waiting_frees_blocks(tiny, policy, options):
    engine = _engine(tiny, max_num_seqs=1, policy=policy, **options)  # one runs, the other waits
    running = _submit(engine, range(5, 40), max_tokens=200)
    waiting = _submit(engine, range(7, 30), max_tokens=200)
    assert running.first.wait(60)
    engine.abort(0)
    engine.abort(1)
    assert running.done.wait(60) and waiting.done.wait(60)
    assert running.outs[-1].aborted and waiting.outs[-1].error == "aborted: client disconnected"
    assert not waiting.tokens()
    engine.stop()
    reqs, _ = engine.tables()
    assert list(reqs.reject_reason) == ["aborted: client disconnected"] * 2
    assert list(reqs.status) == ["aborted"] * 2  # not "rejected": the scheduler refused neither
    assert reqs.ttft.notna().tolist() == [True, False]  # the running one's first token is kept
    _pool_whole(engine)


@pytest.mark.parametrize("drain", [True, False])
def test_shutdown_drains_or_aborts(tiny, drain):
    engine = _engine(tiny)
    sinks = [_submit(engine, range(3, 20 + i), max_tokens=60) for i in range(3)]
    assert sinks[0].first.wait(60)
    engine.stop(drain=drain, timeout=120)
    assert not engine.alive and all(s.done.is_set() for s in sinks)
    reqs, _ = engine.tables()
    assert len(reqs) == 3
    if drain:
        assert list(reqs.status) == ["finished"] * 3 and all(len(s.tokens()) == 60 for s in sinks)
    else:
        assert set(reqs.reject_reason) == {"aborted: server shutdown"} and set(reqs.status) == {"aborted"}
        assert all(s.outs[-1].aborted for s in sinks)
    _pool_whole(engine)


def test_a_requests_seed_makes_its_samples_independent_of_the_batch(tiny):
    engine = _engine(tiny)
    kw = dict(max_tokens=6, temperature=1.0, seed=11)
    alone = _submit(engine, range(40, 60), **kw)
    assert alone.done.wait(60)
    others = [_submit(engine, range(20, 50), max_tokens=6, temperature=1.0) for _ in range(3)]
    crowded = _submit(engine, range(40, 60), **kw)
    for s in [*others, crowded]:
        assert s.done.wait(60)
    engine.stop()
    assert crowded.tokens() == alone.tokens()


def test_parallel_samples_are_separate_choices(tiny):
    engine = _engine(tiny)
    s = _submit(engine, range(40, 60), max_tokens=4, n=3, temperature=1.0, seed=1)
    assert s.done.wait(60)
    engine.stop()
    assert [len(s.tokens(c)) for c in range(3)] == [4, 4, 4]
    assert s.outs[-1].finish_reasons == {0: "length", 1: "length", 2: "length"}
    _pool_whole(engine)


# ---- the HTTP layer's pure parts ------------------------------------------------------------------
class CharTokenizer:
    """One character per token id (ord), for exact text checks."""

    vocab_size = 0x110000
    chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_text_deltas_hold_back_a_possible_stop_string():
    pytest.importorskip("starlette")  # the `serve` extra (absent on the GPU machine's image)
    from backend.http_api import _Text

    t = _Text(CharTokenizer(), ("END",))
    out = [t.add([ord(c)], final=False) for c in "abcEN"]
    out.append(t.add([ord("D")], final=False))
    assert "".join(out) == "abc" and t.stopped
    t2 = _Text(CharTokenizer(), ("END",))
    assert "".join(t2.add([ord(c)], final=False) for c in "xyE") + t2.add([ord("!")], final=True) == "xyE!"


@pytest.mark.parametrize("body, param", [
    ([], None), ({"prompt": "x"}, "model"), ({"model": "m"}, "prompt"), ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"), ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"), ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "logprobs": 2}, "logprobs"), ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": "no"}}, "stream_options"),
    # a completion's logprobs 0 asks for the sampled tokens' logprobs (OpenAI, vLLM): not a neutral value
    ({"model": "m", "prompt": "x", "logprobs": 0}, "logprobs"), ({"model": "m", "prompt": "x", "logprobs": False}, "logprobs"),
])
def test_bad_completion_fields_name_the_field(body, param):
    from backend.openai_protocol import ApiError, parse_completion

    with pytest.raises(ApiError) as e:
        parse_completion(body, "m", CharTokenizer())
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("part", [{"type": "text"}, {"type": "text", "text": None}, {"type": "text", "text": 5}])
def test_chat_text_part_without_a_string_text_is_refused(part):
    """Was str()-ed into the prompt: a missing text became "", a null one the word "None"."""
    from backend.openai_protocol import ApiError, parse_chat

    with pytest.raises(ApiError) as e:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [part]}]}, "m", CharTokenizer())
    assert e.value.status == 400 and e.value.param == "messages" and "messages[0].content" in str(e.value)


def test_chat_template_and_params():
    from backend.openai_protocol import parse_chat, parse_completion

    p = parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                    "max_completion_tokens": 3, "stop": "\n", "seed": 4, "top_k": -1}, "m", CharTokenizer())
    assert CharTokenizer().decode(p.prompts[0]) == "<user>hi<assistant>"
    assert (p.params.max_tokens, p.params.stop, p.params.seed, p.params.top_k) == (3, ("\n",), 4, 0)
    batch = parse_completion({"model": "m", "prompt": ["ab", [1, 2, 3]]}, "m", CharTokenizer())
    assert batch.prompts == [[97, 98], [1, 2, 3]] and batch.params.max_tokens == 16


def test_http_refuses_past_max_pending_and_while_draining(tiny):
    """429 once --max-pending requests are in the server, 503 while draining; the engine untouched."""
    pytest.importorskip("starlette")  # the `serve` extra (absent on the GPU machine's image)
    from starlette.testclient import TestClient

    from backend.http_api import OpenAIServer, ServeOptions
    from backend.serve_metrics import ServeMetrics

    engine = _engine(tiny)
    tok = CharTokenizer()
    tok.vocab_size = tiny[0].vocab_size
    api = OpenAIServer(engine, tok, ServeMetrics("tiny"), ServeOptions("tiny", 256, max_pending=1))
    busy = _submit(engine, range(5, 30), max_tokens=200)
    assert busy.first.wait(60)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    with TestClient(api.app()) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests"
        engine.abort(0)
        assert busy.done.wait(60)
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        api.draining = True
        assert client.post("/v1/completions", json=body).status_code == 503
        assert client.get("/health").status_code == 503
    engine.stop()
    reqs, _ = engine.tables()
    assert len(reqs) == 2  # the refused requests never reached the engine
    _pool_whole(engine)
