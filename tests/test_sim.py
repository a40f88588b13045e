"""The simulator: hand-checked timestamps, skip-ahead equality, rejections, determinism, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagesim.cli import main as cli_main
from sim.cost_model import ConstantCostModel
from sim.engine import _delays
from sim.run import SimConfig, run_simulation
from traces import resolve_trace
from traces.arrivals import apply_arrivals
from traces.trace import Trace
from traces.workloads import make_synthetic

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def trace_of(arrivals, prompts, outputs, **kw) -> Trace:
    return Trace(arrival=np.array(arrivals, float), prompt_len=np.array(prompts), output_len=np.array(outputs),
                 name="handmade", **kw)


def test_three_requests_exact_timestamps():
    # step = 0.1 + 0.001 * prefill tokens + 0.01 * decoding sequences
    cost = ConstantCostModel(prefill_per_token=0.001, decode_per_seq=0.01, base=0.1)
    tr = trace_of([0.0, 0.05, 1.0], [10, 20, 5], [3, 2, 1])
    res = run_simulation(SimConfig(num_gpu_blocks=100), tr, cost_model=cost)
    r = res.requests.set_index("request_id")
    # t=0: prefill r0 (0.11) -> t=0.11: r0 decodes, r1 prefills (0.1+0.02+0.01) -> t=0.24:
    # both decode (0.12) and finish at 0.36; r2 arrives at 1.0, prefills 5 tokens (0.105).
    assert r.first_token_time.tolist() == pytest.approx([0.11, 0.24, 1.105])
    assert r.finish_time.tolist() == pytest.approx([0.36, 0.36, 1.105])
    assert r.ttft.tolist() == pytest.approx([0.11, 0.19, 0.105])
    assert r.tpot[0] == pytest.approx(0.125)
    assert r.output_len.tolist() == [3, 2, 1]
    it = res.iterations
    assert it.duration.tolist() == pytest.approx([0.11, 0.13, 0.12, 0.105])
    assert it.prefill_tokens.tolist() == [10, 20, 0, 5]
    assert it.decode_tokens.tolist() == [0, 1, 2, 0]


def _both(cfg: SimConfig, tr: Trace):
    a = run_simulation(cfg, tr)
    cfg_b = SimConfig(**{**cfg.to_dict(), "fast_forward": False})
    b = run_simulation(cfg_b, tr)
    return a, b


@pytest.mark.parametrize("kw", [
    {},
    {"chunked_prefill": True, "max_num_batched_tokens": 512},
    {"preemption": "swap"},
    {"max_num_seqs": 8},
])
@pytest.mark.parametrize("rate", [0.5, 50.0])
def test_skip_ahead_equals_stepping(kw, rate):
    tr = resolve_trace("sharegpt-like", num_requests=150, rate=rate, seed=3)
    a, b = _both(SimConfig(num_gpu_blocks=300, **kw), tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)
    if rate == 50.0 and kw.get("max_num_seqs") is None:
        assert a.summary["num_preemptions"] > 0  # the tiny cache does force preemption
        assert a.summary["engine"]["preempting_in_windows"] > 0  # and windows run through it


@pytest.mark.parametrize("block_size,seed", [(1, 0), (8, 1), (32, 2)])
def test_skip_ahead_equals_stepping_across_block_sizes(block_size, seed):
    tr = resolve_trace("sharegpt-like", num_requests=100, rate=50.0, seed=seed)
    a, b = _both(SimConfig(num_gpu_blocks=4800 // block_size, block_size=block_size), tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)
    assert a.summary["engine"]["preempting_in_windows"] > 0


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 16, 32]), tokens_in_cache=st.integers(1500, 6000),
       preemption=st.sampled_from(["recompute", "swap"]), rate=st.sampled_from([1.0, 20.0, 200.0]),
       max_num_seqs=st.sampled_from([4, 64, 256]), chunked=st.booleans(),
       width=st.sampled_from([(1, 1), (1, 1), (2, 1), (1, 3)]), seed=st.integers(0, 2**16),
       prefix=st.booleans(), budget=st.integers(-64, 160))
def test_skip_ahead_equals_stepping_property(block_size, tokens_in_cache, preemption, rate, max_num_seqs,
                                             chunked, width, seed, prefix, budget):
    """`prefix`: prefix caching on a shared-prefix workload (prompts of 96 + 32 tokens), with the
    token budget drawn around the prompt size (where a prefix hit decides whether a prompt fits)."""
    n, beam_width = width
    if prefix:
        tr = make_synthetic("shared-prefix", 30, seed=seed, num_prefixes=2, prefix_len=96, suffix_len=32,
                            output_len=40)
        tr = apply_arrivals(tr, rate=rate, seed=seed)
        max_tokens = 128 + budget
    else:
        tr = resolve_trace("sharegpt-like", num_requests=30, rate=rate, seed=seed)
        max_tokens = 512 if chunked else 4096
    cfg = SimConfig(num_gpu_blocks=tokens_in_cache // block_size, block_size=block_size, preemption=preemption,
                    max_num_seqs=max_num_seqs, chunked_prefill=chunked, prefix_caching=prefix,
                    max_num_batched_tokens=max_tokens, n=n, beam_width=beam_width, seed=seed)
    a, b = _both(cfg, tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_debug_checks_hold_after_every_window(preemption):
    # debug mode checks block conservation after every stepped iteration and every window
    tr = resolve_trace("sharegpt-like", num_requests=120, rate=50.0, seed=1)
    res = run_simulation(SimConfig(num_gpu_blocks=300, preemption=preemption, debug=True), tr)
    assert res.summary["engine"]["preempting_in_windows"] > 0
    assert res.summary["num_finished"] == 120


def test_skip_ahead_lands_on_stepping_clock_when_one_addition_cannot():
    # from 3.8095823315433313 no single float delay reaches 11.938362185022426 (round-half-even
    # skips it); the window must still end exactly where stepping's additions do
    tr = resolve_trace("sharegpt-like", num_requests=30, rate=200.0, seed=1)
    a, b = _both(SimConfig(num_gpu_blocks=2194, block_size=1, max_num_seqs=4), tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)
    env = simpy.Environment(initial_time=3.8095823315433313)
    t1, d2 = 11.912270694552973, 0.02609149046945337  # t1 + d2 == 11.938362185022426

    def advance():
        for delay in _delays(env.now, [t1, t1 + d2], [t1 - env.now, d2]):
            yield env.timeout(delay)

    env.process(advance())
    env.run()
    assert env.now == 11.938362185022426


def test_skip_ahead_equals_stepping_with_prefix_caching():
    tr = resolve_trace("shared-prefix", num_requests=120, rate=4.0, seed=1)
    a, b = _both(SimConfig(num_gpu_blocks=400, prefix_caching=True), tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)
    assert a.summary["prefix_hit_tokens"] > 0


def test_skip_ahead_equals_stepping_with_prompt_token_ids():
    # prompts given as token ids (content-hashed prefix caching) under preemption: skipped
    # iterations must leave the same token lists as stepped ones
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 1000, 64).tolist() for _ in range(3)]
    prompts = [prefixes[i % 3] + rng.integers(0, 1000, int(rng.integers(1, 40))).tolist() for i in range(120)]
    tr = trace_of(np.sort(rng.uniform(0, 5, 120)), [len(p) for p in prompts], rng.integers(5, 200, 120),
                  prompt_token_ids=prompts)
    a, b = _both(SimConfig(num_gpu_blocks=120, prefix_caching=True), tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.iterations, b.iterations, check_exact=True)
    assert a.summary["num_preemptions"] > 0 and a.summary["prefix_hit_tokens"] > 0


def test_skip_ahead_actually_skips():
    tr = resolve_trace("sharegpt-like", num_requests=200, rate=2.0, seed=0)
    a, b = _both(SimConfig(), tr)
    ea, eb = a.summary["engine"], b.summary["engine"]
    n = a.summary["num_iterations"]
    assert eb == {"stepped_iterations": n, "skip_windows": 0, "skipped_iterations": 0, "preempting_in_windows": 0}
    assert ea["stepped_iterations"] + ea["skipped_iterations"] == n
    # skipping ahead is what makes it fast: most iterations are covered by windows
    assert ea["skipped_iterations"] > 5 * ea["stepped_iterations"]


def test_request_larger_than_cache_is_rejected_and_others_finish():
    tr = trace_of([0.0, 0.1, 0.2], [30, 400, 20], [10, 10, 5])
    res = run_simulation(SimConfig(num_gpu_blocks=10, block_size=16), tr,
                         cost_model=ConstantCostModel(0.001, 0.01, 0.1))
    r = res.requests.set_index("request_id")
    assert r.status.tolist() == ["finished", "rejected", "finished"]
    assert "blocks" in r.reject_reason[1] and "cache" in r.reject_reason[1]


def test_prompt_beyond_model_context_is_rejected():
    tr = trace_of([0.0, 0.1], [3000, 100], [10, 10])
    res = run_simulation(SimConfig(model="opt-13b"), tr)
    r = res.requests.set_index("request_id")
    assert r.status.tolist() == ["rejected", "finished"]
    assert "context of 2048" in r.reject_reason[0]


@pytest.mark.parametrize("policy", ["vllm", "orca-max", "orca-pow2", "orca-oracle", "static"])
def test_every_policy_accounts_for_every_request(policy):
    tr = resolve_trace("alpaca-like", num_requests=80, rate=5.0, seed=2)
    res = run_simulation(SimConfig(policy=policy, num_gpu_blocks=64), tr)
    assert len(res.requests) == 80
    assert set(res.requests.status) <= {"finished", "rejected"}
    assert res.summary["num_finished"] + res.summary["num_rejected"] == 80


def test_paged_wastes_less_than_contiguous():
    tr = resolve_trace("sharegpt-like", num_requests=200, rate=3.0, seed=0)
    paged = run_simulation(SimConfig(policy="vllm"), tr).summary
    oracle = run_simulation(SimConfig(policy="orca-oracle"), tr).summary
    maxed = run_simulation(SimConfig(policy="orca-max"), tr).summary
    assert paged["kv_token_state_fraction"] > 0.9
    assert maxed["kv_token_state_fraction"] < oracle["kv_token_state_fraction"] < paged["kv_token_state_fraction"]
    assert paged["request_throughput"] >= oracle["request_throughput"] >= maxed["request_throughput"]


@pytest.mark.parametrize("kw", [{"n": 4}, {"beam_width": 4}])
def test_parallel_sampling_and_beam_search_run_and_share(kw):
    tr = resolve_trace("alpaca-like", num_requests=60, rate=2.0, seed=5)
    res = run_simulation(SimConfig(num_gpu_blocks=500, debug=True, **kw), tr)
    assert res.summary["num_finished"] == 60
    width = kw.get("n", kw.get("beam_width"))
    # sharing: each iteration's token states are fewer than width separate copies of each prompt
    assert res.iterations.decode_tokens.max() >= width


def test_parallel_samples_never_outgrow_the_trace_length():
    # n = 3: forked samples are no longer than the trace's output, one-token outputs included
    tr = trace_of([0.0, 0.0, 0.1], [12, 30, 7], [1, 2, 40])
    res = run_simulation(SimConfig(num_gpu_blocks=200, n=3), tr)
    assert res.requests.output_len.tolist() == [1, 2, 40]
    assert (res.requests.status == "finished").all()


def test_same_seed_same_numbers():
    tr = resolve_trace("sharegpt-like", num_requests=100, rate=4.0, seed=9)
    a = run_simulation(SimConfig(n=2, seed=4), tr)
    b = run_simulation(SimConfig(n=2, seed=4), tr)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)


def test_cli_simulate_writes_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli_main(["simulate", "--trace", "sharegpt-like", "--num-requests", "40", "--rate", "2",
                     "--model", "opt-13b", "--hardware", "a100-40gb", "--policy", "vllm", "--out", str(out),
                     "--quiet"])
    assert code == 0
    req = pd.read_csv(out / "requests.csv")
    assert len(req) == 40
    it = pd.read_parquet(out / "iterations.parquet")
    assert {"kv_token_states", "kv_free", "decode_tokens"} <= set(it.columns)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["policy"] == "vllm" and summary["wall_time_s"] > 0
    assert "request throughput" in capsys.readouterr().out


def test_cli_unknown_model_lists_known(tmp_path, capsys):
    code = cli_main(["simulate", "--model", "gpt-9", "--num-requests", "5", "--rate", "1", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "gpt-9" in err and "opt-13b" in err


def test_cli_malformed_trace_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,5\n"
                   "2023-11-16 18:15:47.0000000,-3,5\n")
    code = cli_main(["simulate", "--trace", str(bad), "--out", str(tmp_path / "o"), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert "bad.csv" in err and "line 3" in err


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/traces not present")
def test_real_mooncake_trace_with_prefix_caching():
    tr = resolve_trace(str(SHARED / "mooncake" / "synthetic_trace.jsonl"), num_requests=150)
    res = run_simulation(SimConfig(model="llama-3-8b", hardware="h100-sxm", prefix_caching=True,
                                   chunked_prefill=True), tr)
    assert res.summary["num_finished"] + res.summary["num_rejected"] == 150
    assert res.summary["prefix_hit_tokens"] > 0


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/traces not present")
def test_real_azure_conv_trace():
    tr = resolve_trace(str(SHARED / "azure_2023" / "AzureLLMInferenceTrace_conv.csv"), num_requests=200)
    res = run_simulation(SimConfig(model="llama-3-8b", hardware="a100-80gb", chunked_prefill=True), tr)
    assert res.summary["num_finished"] > 150


@pytest.mark.parametrize("extra", [
    {"chunked_prefill": True, "max_num_batched_tokens": 256},
    {"preemption": "swap", "num_gpu_blocks": 300},
    {"prefix_caching": True, "num_gpu_blocks": 400},
])
def test_iteration_table_holds_each_iterations_composition(extra):
    """Repricing every row's composition gives its duration exactly: the table is complete enough to
    check or refit a cost model against (stepped rows and skipped windows alike)."""
    from policies.iteration_log import iteration_compositions
    from sim.run import build_cost_model

    cfg = SimConfig(**extra)
    trace = resolve_trace("shared-prefix" if extra.get("prefix_caching") else "sharegpt-like", num_requests=150,
                          rate=8.0, seed=2)
    res = run_simulation(cfg, trace)
    cost = build_cost_model(cfg)
    comps = iteration_compositions(res.iterations, cfg.block_size)
    assert [cost.step_time(c) for c in comps] == res.iterations.duration.tolist()
    assert res.summary["engine"]["skipped_iterations"] > 0 or extra.get("chunked_prefill")


def test_rejected_rows_keep_what_was_asked_and_the_reasons_print_by_kind() -> None:
    from analysis.report import rejection_lines
    from traces.trace import Trace
    trace = Trace(prompt_len=np.array([100, 2040, 2045]), output_len=np.array([10, 30, 39]),
                  arrival=np.array([0.0, 0.1, 0.2]), name="t")
    r = run_simulation(SimConfig(model="llama-7b", hardware="a100-80gb"), trace).requests
    assert list(r.status) == ["finished", "rejected", "rejected"]
    assert list(r.requested_output_len) == [10, 30, 39] and list(r.output_len) == [10, 0, 0]
    lines = rejection_lines(r)
    assert lines[0] == "2 rejected:" and len(lines) == 2
    # the numbers that vary read N, the one they share (the context) is kept
    assert lines[1].startswith("  2 x prompt N + output N tokens exceeds the model's context of 2048, e.g. prompt 2040 + ")
