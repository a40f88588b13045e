"""`pagesim serve --emulate` in process: the emulated executor and paced clock behind AsyncEngine
reproduce the simulator's timeline; the output vocabulary, lengths and tokenizer; bad input is one
line naming the flag before anything starts."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from policies.plan import StepResult
from policies.replica_config import build_replica
from policies.request import Request, SamplingParams
from policies.trace_requests import requests_from_trace
from sim.emulated import EmulatedExecutor, OutputLengthModel, PacedClock
from sim.run import SimConfig, build_cost_model, run_simulation
from sim.specs import get_model
from traces.trace import Trace

pytest.importorskip("starlette")
CFG = SimConfig(model="llama-7b", hardware="h100-sxm", calibration="vllm-v1-h100", max_num_seqs=8,
                max_num_batched_tokens=512, num_gpu_blocks=40, prefix_caching=True)


def _trace(n: int = 12, seed: int = 3) -> Trace:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(20, 200, n)
    shared = rng.integers(100, 30000, 64).tolist()  # a common prefix: prefix caching has hits to find
    ids = [shared + rng.integers(100, 30000, int(p)).tolist() for p in prompts]
    return Trace(arrival=np.zeros(n), prompt_len=np.array([len(i) for i in ids]), output_len=rng.integers(5, 60, n),
                 prompt_token_ids=ids, name="emulate-test")


def _emulated_tables(trace: Trace, time_scale: float, output_lag_steps: int = 0):
    from backend.async_engine import AsyncEngine, EngineRequest

    model = get_model(CFG.model)
    executor = EmulatedExecutor(build_cost_model(CFG), list(range(500, 600)), seed=CFG.seed)
    engine = AsyncEngine(build_replica(CFG.replica(), executor), clock=PacedClock(time_scale),
                         output_lag_steps=output_lag_steps)
    outs: dict[int, list[int]] = {}
    for r in requests_from_trace(trace, model.max_position):  # all arrive at 0, read in before the first step
        engine.submit(EngineRequest(r, lambda o: outs.setdefault(o.request_id, []).extend(
            t for toks in o.new_tokens.values() for t in toks)))
    engine.start()
    engine.stop(drain=True, timeout=60)
    assert engine.error is None
    return engine, outs


@pytest.mark.parametrize("lag", [0, 2])
def test_emulated_engine_reproduces_the_simulated_timeline(lag):
    """The same requests through AsyncEngine + EmulatedExecutor + PacedClock (in real time, 20x)
    and through `pagesim simulate`: the same iterations, priced the same, and the same per-request
    times (outputs held `lag` steps change when they are sent, not the plan); every request got
    exactly its tokens, all from the output vocabulary."""
    trace = _trace()
    engine, outs = _emulated_tables(trace, time_scale=20.0, output_lag_steps=lag)
    req, its = engine.tables()
    sim = run_simulation(CFG, trace)
    assert len(its) == len(sim.iterations) and its.num_seqs.tolist() == sim.iterations.num_seqs.tolist()
    np.testing.assert_allclose(its.duration, sim.iterations.duration, rtol=1e-12)
    s = sim.requests.set_index("request_id").loc[req.request_id]
    for col in ("first_token_time", "finish_time", "prefix_hit_tokens", "num_preemptions"):
        np.testing.assert_allclose(req[col].to_numpy(float), s[col].to_numpy(float), rtol=1e-9, atol=1e-9)
    assert req.prefix_hit_tokens.sum() > 0 and req.num_preemptions.sum() > 0  # the cache was exercised
    assert {i: len(t) for i, t in outs.items()} == dict(enumerate(trace.output_len.tolist()))
    assert all(500 <= t < 600 for toks in outs.values() for t in toks)
    stats = engine.timing.stats.to_dict()
    assert stats["releases"] == len(its)


def test_paced_clock_plans_back_to_back_and_measures_lag():
    clock = PacedClock(time_scale=10.0)
    clock.start()
    assert clock.begin(clock.now(), newest_arrival=0.0) == 0.0  # the first iteration starts at the arrival
    end = clock.end(0.0, StepResult(duration=0.05))
    assert end == 0.05
    lag = clock.wait(end, 0.05)  # 5 ms of wall time at 10x
    assert 0 <= lag < 1.0 and clock.now() >= 0.05  # (a loaded machine may wake the sleeper late)
    time.sleep(0.002)
    assert clock.begin(clock.now(), newest_arrival=0.01) == 0.05  # back to back: the previous planned end
    assert clock.begin(clock.now(), newest_arrival=0.055) == 0.055  # a request read in after it: its arrival
    clock.idle()
    now = clock.now()
    assert clock.begin(now, newest_arrival=0.0) == now
    late = clock.wait(clock.now() - 1.0, 0.01)  # a release already 100 ms (wall) late
    assert late >= 0.1 and clock.stats.lags[-1] == late and clock.stats.behind >= 1


@pytest.mark.parametrize("scale", [0, -1, float("inf"), float("nan")])
def test_time_scale_must_be_positive_finite(scale):
    with pytest.raises(ValueError, match="--time-scale"):
        PacedClock(scale)


def test_output_lengths_seeded_capped_and_ignore_eos():
    model = OutputLengthModel(mean=50)
    a = [model.draw(np.random.default_rng([7, i]), 10_000) for i in range(2000)]
    b = [model.draw(np.random.default_rng([7, i]), 10_000) for i in range(2000)]
    assert a == b and min(a) >= 1 and 45 < np.mean(a) < 55  # geometric with mean 50
    assert max(model.draw(np.random.default_rng(i), 8) for i in range(200)) == 8
    with pytest.raises(ValueError, match="--output-len-mean"):
        OutputLengthModel(0.5)
    ex = EmulatedExecutor(build_cost_model(CFG), [1, 2, 3], seed=0, lengths=model)
    exact = Request(0, 0.0, 4, SamplingParams(max_tokens=33, ignore_eos=True), prompt_token_ids=[1, 2, 3, 4])
    ex.register(exact, None)
    assert exact.output_len is None and exact.max_output == 33
    seeded = [Request(i, 0.0, 4, SamplingParams(max_tokens=500), prompt_token_ids=[1, 2, 3, 4]) for i in (1, 2)]
    for r in seeded:
        ex.register(r, seed=11)  # the same request seed: the same length
    assert seeded[0].output_len == seeded[1].output_len <= 500


def test_approximate_tokenizer_round_trips_its_output_words():
    from backend.text_tokens import BYTES_PER_TOKEN, ByteChunkTokenizer, output_vocabulary

    tok = ByteChunkTokenizer(32000)
    vocab = output_vocabulary(tok)
    assert len(vocab) > 50
    ids = [vocab[(7 * i) % len(vocab)] for i in range(40)]
    text = tok.decode(ids)
    assert tok.encode(text) == ids  # a client counting tokens in the text counts the server's
    prompt = "The same prompt twice gives the same ids é"
    assert tok.encode(prompt) == tok.encode(prompt)
    assert len(tok.encode(prompt)) == -(-len(prompt.encode()) // BYTES_PER_TOKEN)


def test_gguf_tokenizer_output_words_round_trip():
    from backend.text_tokens import load_tokenizer, output_vocabulary
    from backend.weights import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = load_tokenizer(path)
    vocab = output_vocabulary(tok)
    ids = [vocab[(3 * i) % len(vocab)] for i in range(30)]
    assert tok.encode(tok.decode(ids), add_bos=False) == ids


def test_hf_tokenizer_folder(tmp_path):
    """--tokenizer FOLDER: a HF tokenizer folder (here SmolLM2's, saved as one) loads, and its output
    words round-trip as the GGUF's do."""
    pytest.importorskip("transformers")
    from backend.text_tokens import load_tokenizer, output_vocabulary
    from backend.tokenizer import GGUFTokenizer

    try:
        gguf = GGUFTokenizer.from_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    gguf.tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    tok = load_tokenizer(tmp_path)
    vocab = output_vocabulary(tok)
    ids = [vocab[(5 * i) % len(vocab)] for i in range(30)]
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    assert tok.encode("Hello world", add_special_tokens=False) == gguf.encode("Hello world", add_bos=False)
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokenizer(tmp_path / "tokenizer_config.json")


# ---- bad input: one line naming the flag, before the server starts ---------------------------------
def _run(capsys, *argv: str) -> str:
    from pagesim.cli import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


BASE = ("--emulate", "--model", "llama-7b", "--hardware", "h100-sxm")


def test_bad_input_names_the_flag(capsys, tmp_path):
    assert "--calibration or --profile" in _run(capsys, *BASE)
    assert "--calibration" in _run(capsys, *BASE, "--calibration", str(tmp_path / "missing.json"))
    assert "--profile" in _run(capsys, *BASE, "--profile", str(tmp_path / "missing.json"), "--num-gpu-blocks", "64")
    err = _run(capsys, "--emulate", "--model", "llama-3.1-70b", "--hardware", "h100-sxm", "--calibration",
               "vllm-v1-h100")
    assert "--model" in err and "does not fit" in err
    assert "--calibration applies with --emulate only" in _run(capsys, "--calibration", "vllm-v1-h100")
    assert "--device" in _run(capsys, *BASE, "--calibration", "vllm-v1-h100", "--device", "cuda")


@pytest.mark.parametrize("value", ["0", "-2", "inf", "nan", "fast"])
def test_bad_time_scale_is_refused_by_the_parser(capsys, value):
    from pagesim.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *BASE, "--calibration", "vllm-v1-h100", "--time-scale", value])
    assert e.value.code == 2 and "--time-scale" in capsys.readouterr().err


def test_taken_port_is_refused_before_start(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err = _run(capsys, *BASE, "--calibration", "vllm-v1-h100", "--port", str(port))
        assert "--port" in err and str(port) in err
        err = _run(capsys, *BASE, "--calibration", "vllm-v1-h100", "--replicas", "2", "--port-base", str(port - 1))
        assert "--port-base" in err and str(port) in err


def test_parallel_samples_leave_nothing_in_the_executor():
    """n > 1 requests (ignore_eos or drawn lengths) that finish, are aborted mid-way or are rejected:
    once they have ended the executor holds no output length, seed or stop check for any of them
    (a long-running server's memory does not grow with the requests it served)."""
    from backend.async_engine import AsyncEngine, EngineRequest

    executor = EmulatedExecutor(build_cost_model(CFG), list(range(500, 600)), seed=CFG.seed,
                                lengths=OutputLengthModel(mean=6))
    engine = AsyncEngine(build_replica(CFG.replica(), executor), clock=PacedClock(200.0))
    ends: dict[int, str] = {}
    forked_seen: set[int] = set()

    def sink_for(rid: int, abort_after_tokens: bool):
        def sink(out) -> None:
            if out.new_tokens and len(executor.inner.targets):
                forked_seen.add(rid)  # an entry existed while it ran: the release below is tested
            if abort_after_tokens and out.new_tokens and not out.finished:
                engine.abort(rid)
            if out.finished:
                ends[rid] = "aborted" if out.aborted else "rejected" if out.error else "done"
        return sink

    cases = [(SamplingParams(max_tokens=12, ignore_eos=True, n=3), False),   # runs to its end
             (SamplingParams(max_tokens=40, n=3), False),                    # drawn lengths, stops early
             (SamplingParams(max_tokens=100, ignore_eos=True, n=3), True),   # aborted after its first tokens
             (SamplingParams(max_tokens=10_000, ignore_eos=True, n=3), False)]  # never fits the cache: rejected
    for rid, (sp, abort) in enumerate(cases):
        engine.submit(EngineRequest(Request(rid, 0.0, 8, sp, prompt_token_ids=list(range(10 + rid, 18 + rid))),
                                    sink_for(rid, abort)))
    engine.start()
    engine.stop(drain=True, timeout=60)
    assert engine.error is None and set(ends) == {0, 1, 2, 3}
    assert ends == {0: "done", 1: "done", 2: "aborted", 3: "rejected"}
    assert forked_seen >= {0, 2}
    assert executor.inner.targets == {} and executor._forked == {} and executor._base == {}


def test_bad_kv_event_flags_name_the_flag(capsys):
    cal = (*BASE, "--calibration", "vllm-v1-h100")
    assert "--kv-events needs --prefix-caching" in _run(capsys, *cal, "--kv-events")
    assert "--kv-events applies with --emulate only" in _run(capsys, "--kv-events")
    err = _run(capsys, *cal, "--prefix-caching", "--kv-events-zmq", "localhost:5557")
    assert err.count("--kv-events-zmq: expected tcp://HOST:PORT") == 1
    assert "--kv-events-replay applies with --kv-events-zmq only" in _run(
        capsys, *cal, "--prefix-caching", "--kv-events", "--kv-events-replay", "tcp://*:5567")
    pytest.importorskip("zmq")
    with socket.socket() as taken:  # a port in use: named, before the server starts
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _run(capsys, *cal, "--prefix-caching", "--kv-events-zmq", f"tcp://127.0.0.1:{port}")
    assert "--kv-events-zmq: cannot bind" in err
