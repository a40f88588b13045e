"""Tests of the traces package: Trace, loaders (real public files and small hand-made ones),
arrival processes, synthetic generators, resolve_trace and the trace CLI."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from pagesim.commands.trace import add_trace_parser
from traces import (
    KNOWN_FORMATS,
    SYNTHETIC,
    Trace,
    TraceFormatError,
    apply_arrivals,
    load_trace,
    make_synthetic,
    resolve_trace,
)
from traces.arrivals import gamma, poisson, rescale
from traces.loaders import detect_format
from traces.synthetic import LengthModel, fit_mu, grouped_prefix, shared_prefix
from traces.trace import prefix_reuse

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def shared_file(rel: str) -> Path:
    path = SHARED / rel
    if not path.is_file():
        pytest.skip(f"public trace {path} not present (see shared/traces/README.md for where to get it)")
    return path


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def small_trace(**kw) -> Trace:
    args = {"arrival": [0.0, 1.0, 2.0, 3.0], "prompt_len": [10, 20, 30, 40], "output_len": [1, 2, 3, 4]}
    args["name"] = "small"
    args.update(kw)
    return Trace(**args)


# ---------------------------------------------------------------- real public traces


@pytest.mark.parametrize(
    "rel, fmt, rows, prompt_mean, output_mean",
    [
        ("azure_2023/AzureLLMInferenceTrace_code.csv", "azure", 8819, 2048, 28),
        ("azure_2023/AzureLLMInferenceTrace_conv.csv", "azure", 19366, 1155, 211),
        ("etalon/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "length-csv", 30731, 2340, 439),
        ("etalon/bwb_stats_llama2_tokenizer_filtered_v2.csv", "length-csv", 33768, 1067, 1613),
        ("vidur/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", "length-csv", 28257, 2588, 291),
        ("mooncake/synthetic_trace.jsonl", "mooncake", 3993, None, None),
    ],
)
def test_public_trace_matches_readme(rel, fmt, rows, prompt_mean, output_mean):
    path = shared_file(rel)
    assert detect_format(path) == fmt
    trace = load_trace(path)
    assert len(trace) == rows
    assert trace.has_timestamps == (fmt != "length-csv")
    if prompt_mean is not None:
        assert trace.prompt_len.mean() == pytest.approx(prompt_mean, rel=0.01)
        assert trace.output_len.mean() == pytest.approx(output_mean, rel=0.01)
    assert trace.prompt_len.min() >= 1 and trace.output_len.min() >= 1
    assert np.all(np.diff(trace.arrival) >= 0)


def test_azure_timing():
    code = load_trace(shared_file("azure_2023/AzureLLMInferenceTrace_code.csv"), format="azure")
    conv = load_trace(shared_file("azure_2023/AzureLLMInferenceTrace_conv.csv"), format="azure")
    assert code.arrival[0] == 0.0 and conv.arrival[0] == 0.0
    # 7-digit fractional timestamps kept to sub-millisecond precision (first gap is 52 ms exactly).
    assert code.arrival[1] == pytest.approx(0.052, abs=1e-6)
    assert 3000 < code.arrival[-1] < 3600 and 3000 < conv.arrival[-1] < 3600
    assert code.info()["interarrival_cv"] == pytest.approx(13, rel=0.1)  # very bursty
    info = conv.info()
    assert info["mean_rate"] == pytest.approx(5.5, rel=0.05)
    assert info["interarrival_cv"] == pytest.approx(1.0, abs=0.2)  # near-Poisson
    assert info["prompt_max"] == 14050


def test_mooncake_hashes():
    trace = load_trace(shared_file("mooncake/synthetic_trace.jsonl"))
    assert trace.hash_block_size == 512
    assert all(len(h) == math.ceil(p / 512) for h, p in zip(trace.prefix_hashes, trace.prompt_len))
    assert trace.arrival[-1] == pytest.approx(1022.025)  # milliseconds converted to seconds
    assert trace.prompt_len.max() == 191378
    assert 0.3 < trace.info()["prefix_reuse"] < 0.9


def test_public_head_and_apply_rate():
    trace = load_trace(shared_file("etalon/sharegpt_8k_filtered_stats_llama2_tokenizer.csv")).head(500)
    with pytest.raises(ValueError, match="--rate"):
        apply_arrivals(trace)
    replay = apply_arrivals(trace, rate=4.0, seed=1)
    assert replay.has_timestamps and len(replay) == 500
    np.testing.assert_array_equal(replay.prompt_len, trace.prompt_len)


# ---------------------------------------------------------------- small files of other formats

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,Conversation log
120,ChatGPT,0,0,0,Conversation log
130,ChatGPT,1360,95,1455,API log
"""


def test_burstgpt_keeps_failed_requests_as_rejected_rows(tmp_path):
    path = write(tmp_path / "BurstGPT_1.csv", BURSTGPT)
    with pytest.warns(UserWarning, match="2 failed requests .* kept as rejected rows"):
        trace = load_trace(path)
    assert len(trace) == 5 and trace.num_rejected == 2 and trace.info()["rejected"] == 2
    assert list(trace.prompt_len) == [472, 1087, 417, 0, 1360]
    assert list(trace.output_len) == [18, 0, 276, 0, 95]
    assert list(trace.arrival) == [5.0, 45.0, 118.0, 120.0, 130.0]
    assert trace.reject_reason == ["", "zero response tokens in the trace (BurstGPT_1.csv line 3)", "",
                                   "zero request and response tokens in the trace (BurstGPT_1.csv line 5)", ""]
    assert trace.info()["prompt_max"] == 1360 and trace.info()["output_mean"] == (18 + 276 + 95) / 3  # served rows


def test_burstgpt_error_line_numbers_survive_dropping(tmp_path):
    text = BURSTGPT + "140,ChatGPT,-3,5,2,API log\n"
    path = write(tmp_path / "b.csv", text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TraceFormatError, match=r"line 7: column 'Request tokens': negative"):
            load_trace(path, format="burstgpt")


@pytest.mark.parametrize(
    "header",
    ["arrived_at,num_prefill_tokens,num_decode_tokens", "arrival_timestamp,prompt_size,token_size"],
)
def test_splitwise(tmp_path, header):
    path = write(tmp_path / "sw.csv", f"{header}\n0.0,100,10\n0.5,200,20\n1.25,300,30\n")
    assert detect_format(path) == "splitwise"
    trace = load_trace(path)
    assert list(trace.arrival) == [0.0, 0.5, 1.25]
    assert list(trace.prompt_len) == [100, 200, 300] and list(trace.output_len) == [10, 20, 30]


def test_unsorted_timestamps_sorted_with_warning(tmp_path):
    path = write(tmp_path / "unsorted.jsonl", "\n".join(json.dumps(r) for r in [
        {"timestamp": 2000, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 1000, "input_length": 100, "output_length": 1, "hash_ids": [9]},
    ]))
    with pytest.warns(UserWarning, match="unsorted.jsonl.*not sorted"):
        trace = load_trace(path)
    assert list(trace.arrival) == [1.0, 2.0]
    assert list(trace.prompt_len) == [100, 600]
    assert trace.prefix_hashes == [(9,), (7, 8)]  # attached data moves with its request


# ---------------------------------------------------------------- own format round trip


def rich_trace() -> Trace:
    return Trace(
        arrival=[0.5, 0.5, 2.25],
        prompt_len=[3, 40, 1],
        output_len=[5, 1, 7],
        n=[1, 4, 1],
        beam_width=[1, 1, 2],
        prefix_hashes=[(11,), (11, 12, 13), ()],
        hash_block_size=16,
        prompt_token_ids=[[1, 2, 3], list(range(40)), [99]],
        name="rich",
    )


def assert_same(a: Trace, b: Trace) -> None:
    for field in ("arrival", "prompt_len", "output_len", "n", "beam_width"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert a.prefix_hashes == b.prefix_hashes
    assert a.hash_block_size == b.hash_block_size
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.has_timestamps == b.has_timestamps


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_round_trip(tmp_path, suffix):
    trace = rich_trace()
    path = trace.save(tmp_path / f"t{suffix}")
    assert detect_format(path) == "pagesim"
    assert_same(load_trace(path), trace)
    bare = Trace(arrival=np.zeros(3), prompt_len=[1, 2, 3], output_len=[4, 5, 6], has_timestamps=False)
    loaded = load_trace(bare.save(tmp_path / f"bare{suffix}"))
    assert_same(loaded, bare)
    assert loaded.prefix_hashes is None and not loaded.has_timestamps


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_round_trip_single_big_hashes(tmp_path, suffix):
    # One hash per row (and an empty row) must not be read back as (lossy) numbers.
    trace = Trace(arrival=[0, 1], prompt_len=[5, 5], output_len=[1, 1],
                  prefix_hashes=[(2**62 + 1,), ()], hash_block_size=8)
    assert load_trace(trace.save(tmp_path / f"h{suffix}")).prefix_hashes == [(2**62 + 1,), ()]


def test_frame_round_trip():
    trace = rich_trace()
    assert_same(Trace.from_frame(trace.to_frame()), trace)


def test_save_rejects_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"\.txt"):
        rich_trace().save(tmp_path / "t.txt")


# ---------------------------------------------------------------- bad input

AZ = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZ_ROW = "2023-11-16 18:15:46.6805900,374,44\n"


@pytest.mark.parametrize(
    "name, text, fmt, pattern",
    [
        ("missing.csv", "TIMESTAMP,ContextTokens\n" + "2023-11-16 18:15:46.68,374\n", "azure",
         r"needs column\(s\) \['GeneratedTokens'\]"),
        ("neg.csv", AZ + AZ_ROW + "2023-11-16 18:15:47.0,-5,44\n", None, r"line 3: column 'ContextTokens': negative"),
        ("zero.csv", AZ + AZ_ROW * 3 + "2023-11-16 18:15:47.0,5,0\n", None,
         r"line 5: column 'GeneratedTokens': zero length"),
        ("frac.csv", "num_prefill_tokens,num_decode_tokens\n10,2\n10.5,3\n", None, r"line 3: .*non-integer"),
        ("nan.csv", "num_prefill_tokens,num_decode_tokens\n10,2\n,3\n", None, r"line 3: .*missing value \(NaN\)"),
        ("text.csv", "num_prefill_tokens,num_decode_tokens\n10,2\n11,abc\n", None, r"line 3: .*'abc' is not a number"),
        ("blank.csv", "num_prefill_tokens,num_decode_tokens\n10,2\n\n11,0\n", None, r"line 4: .*zero"),
        ("date.csv", AZ + AZ_ROW + "yesterday,3,4\n", None, r"line 3: column 'TIMESTAMP'"),
        ("ts.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n-1,1,1\n", None,
         r"line 3: column 'arrived_at': timestamp -1"),
        ("empty.csv", "", None, "file is empty"),
        ("header.csv", AZ, None, "no requests"),
        ("what.csv", "a,b\n1,2\n", None, r"cannot detect .*known formats|pass a format, one of: azure"),
        ("unknown.csv", AZ + AZ_ROW, "opt", r"unknown trace format 'opt'; known formats: azure, length-csv"),
        ("bad.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,\n', "mooncake",
         r"line 2: unreadable JSON"),
        ("field.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": 5}\n',
         None, r"line 2: missing field 'output_length'"),
        ("nots.jsonl", '{"input_length": 5, "output_length": 1}\n', "mooncake", r"line 1: missing field 'timestamp'"),
        ("neg.jsonl", '{"timestamp": 0, "input_length": -5, "output_length": 1}\n', None,
         r"line 1: field 'input_length' is negative"),
        ("frac.jsonl", '{"timestamp": 0, "input_length": 5.5, "output_length": 1}\n', None,
         r"line 1: field 'input_length' = 5.5, expected an integer"),
        ("hash.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}\n', None,
         r"line 1: field 'hash_ids' has 2 ids"),
        ("own.csv", "arrival,prompt_len,output_len\n0,1,1\n,2,2\n", None, r"line 3: column 'arrival': missing value"),
        ("ownhash.csv", "prompt_len,output_len,prefix_hashes,hash_block_size\n5,1,1 x,16\n", None,
         r"line 2: column 'prefix_hashes'"),
    ],
)
def test_bad_input(tmp_path, name, text, fmt, pattern):
    path = write(tmp_path / name, text)
    with pytest.raises(TraceFormatError, match=pattern) as err:
        load_trace(path, format=fmt)
    assert str(path) in str(err.value)


def test_bad_parquet_row_named(tmp_path):
    trace = Trace(arrival=[0, 1, 2], prompt_len=[1, 2, 3], output_len=[1, 1, 1])
    frame = trace.to_frame()
    frame.loc[2, "output_len"] = 0
    path = tmp_path / "bad.parquet"
    frame.to_parquet(path)
    with pytest.raises(TraceFormatError, match=r"bad.parquet: row 3: column 'output_len': zero"):
        load_trace(path)


def test_error_types(tmp_path):
    assert issubclass(TraceFormatError, ValueError)
    assert "mooncake" in KNOWN_FORMATS and "pagesim" in KNOWN_FORMATS
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_trace(tmp_path / "nope.csv")


# ---------------------------------------------------------------- Trace type


def test_trace_invariants():
    with pytest.raises(ValueError, match="sorted"):
        small_trace(arrival=[0, 2, 1, 3])
    with pytest.raises(ValueError, match="prompt_len"):
        small_trace(prompt_len=[10, 0, 30, 40])
    with pytest.raises(ValueError, match="entries"):
        small_trace(output_len=[1, 2, 3])
    with pytest.raises(ValueError, match="prefix hashes"):
        small_trace(prefix_hashes=[(1, 2), (), (), ()], hash_block_size=16)  # 10 tokens: one block
    trace = small_trace()
    assert trace.prompt_len.dtype == np.int64 and trace.arrival.dtype == np.float64
    assert list(trace.n) == [1, 1, 1, 1] and list(trace.beam_width) == [1, 1, 1, 1]


def test_head_and_with_arrivals():
    trace = small_trace(prefix_hashes=[(1,), (1,), (2,), (1, 3)], hash_block_size=16)
    head = trace.head(2)
    assert len(head) == 2 and head.prefix_hashes == [(1,), (1,)] and list(head.n) == [1, 1]
    moved = trace.with_arrivals(np.array([1.0, 1.0, 5.0, 9.0]))
    assert list(moved.arrival) == [1, 1, 5, 9] and len(trace.arrival) == 4


def test_info_fields():
    trace = small_trace(prefix_hashes=[(1,), (1,), (2,), (1, 3)], hash_block_size=16)
    info = trace.info()
    assert info["num_requests"] == 4
    assert info["duration_s"] == 3.0 and info["mean_rate"] == 1.0 and info["interarrival_cv"] == 0.0
    assert info["prompt_mean"] == 25.0 and info["prompt_p50"] == 25.0 and info["prompt_max"] == 40
    assert info["output_p99"] == pytest.approx(3.97)
    assert info["prefix_reuse"] == pytest.approx(2 / 5)  # blocks: 1, [1], 2, [1] 3
    assert prefix_reuse([(5, 5)]) == 0.0  # repeats inside a request are not reuse
    bare = Trace(arrival=np.zeros(2), prompt_len=[1, 2], output_len=[1, 1], has_timestamps=False)
    assert bare.info()["mean_rate"] is None and "prefix_reuse" not in bare.info()


# ---------------------------------------------------------------- arrival processes


def gaps_cv(ts: np.ndarray) -> float:
    gaps = np.diff(ts)
    return float(gaps.std() / gaps.mean())


def test_arrivals_seeded():
    np.testing.assert_array_equal(poisson(100, 2.0, seed=3), poisson(100, 2.0, seed=3))
    assert not np.array_equal(poisson(100, 2.0, seed=3), poisson(100, 2.0, seed=4))
    np.testing.assert_array_equal(gamma(100, 2.0, 4.0, seed=3), gamma(100, 2.0, 4.0, seed=3))
    assert poisson(10, 1.0).dtype == np.float64 and np.all(np.diff(gamma(1000, 1.0, 5.0)) >= 0)


def test_poisson_rate_and_cv():
    ts = poisson(200_000, 5.0, seed=0)
    assert len(ts) / ts[-1] == pytest.approx(5.0, rel=0.01)
    assert gaps_cv(ts) == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_cv(cv):
    ts = gamma(200_000, 2.0, cv, seed=1)
    assert len(ts) / ts[-1] == pytest.approx(2.0, rel=0.03)
    assert gaps_cv(ts) == pytest.approx(cv, rel=0.05)


def test_rescale_keeps_shape():
    ts = gamma(10_000, 1.0, 4.0, seed=2)
    out = rescale(ts, 10.0)
    assert out[0] == 0.0 and (len(out) - 1) / out[-1] == pytest.approx(10.0)
    assert gaps_cv(out) == pytest.approx(gaps_cv(ts))
    with pytest.raises(ValueError, match="two distinct"):
        rescale(np.zeros(5), 1.0)


@pytest.mark.parametrize("kw, name", [({"rate": 0}, "rate"), ({"rate": -1}, "rate"), ({"rate": 1, "cv": 0}, "cv")])
def test_arrival_validation(kw, name):
    with pytest.raises(ValueError, match=name):
        gamma(10, kw["rate"], kw.get("cv", 1.0))


def test_apply_arrivals_rules():
    timed = small_trace()
    assert apply_arrivals(timed) is timed  # own timestamps kept
    assert apply_arrivals(timed, rate=2.0).info()["mean_rate"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="burstiness"):
        apply_arrivals(timed, rate=2.0, burstiness=2.0)
    with pytest.raises(ValueError, match="rate"):
        apply_arrivals(timed, rate=float("nan"))
    bare = make_synthetic("fixed", 20_000)
    with pytest.raises(ValueError, match="give --rate"):
        apply_arrivals(bare)
    with pytest.raises(ValueError, match="burstiness"):
        apply_arrivals(bare, rate=1.0, burstiness=-1)
    steady = apply_arrivals(bare, rate=4.0, burstiness=0)  # constant: evenly spaced at 1/rate
    assert steady.arrival[:3] == pytest.approx([0.25, 0.5, 0.75])
    assert np.diff(steady.arrival) == pytest.approx(np.full(len(bare) - 1, 0.25))
    bursty = apply_arrivals(bare, rate=3.0, burstiness=4.0, seed=5)
    assert bursty.info()["interarrival_cv"] == pytest.approx(4.0, rel=0.15)
    assert apply_arrivals(bare, rate=3.0).info()["interarrival_cv"] == pytest.approx(1.0, rel=0.05)


# ---------------------------------------------------------------- synthetic workloads


@pytest.mark.parametrize("name, prompt_mean, output_mean", [("sharegpt-like", 161, 338), ("alpaca-like", 19, 58)])
def test_paper_workload_means_and_caps(name, prompt_mean, output_mean):
    trace = make_synthetic(name, 100_000, seed=0)
    assert trace.prompt_len.mean() == pytest.approx(prompt_mean, rel=0.02)
    assert trace.output_len.mean() == pytest.approx(output_mean, rel=0.02)
    assert trace.prompt_len.min() >= 1 and trace.output_len.min() >= 1
    assert trace.prompt_len.max() <= 1024 and (trace.prompt_len + trace.output_len).max() <= 2048
    assert not trace.has_timestamps
    assert trace.output_len.std() > 0.5 * output_mean  # a real spread, not a constant


def test_fit_solves_for_any_sigma():
    # A heavier tail than the shipped models: the clipped mean still lands on target because mu
    # comes from the solver, not from the unclipped formula exp(mu + sigma^2 / 2).
    model = LengthModel("heavy", prompt_mean=200, output_mean=400, prompt_sigma=1.6, output_sigma=1.6)
    mu_p, _ = fit_mu(model)
    assert mu_p > math.log(200) - 1.6**2 / 2  # clipping removes the tail, so mu must rise
    prompt = np.clip(np.rint(np.random.default_rng(0).lognormal(mu_p, 1.6, 200_000)), 1, 1024)
    assert prompt.mean() == pytest.approx(200, rel=0.02)


def test_synthetic_seeded_and_registry():
    a, b = make_synthetic("sharegpt-like", 1000, seed=7), make_synthetic("sharegpt-like", 1000, seed=7)
    np.testing.assert_array_equal(a.prompt_len, b.prompt_len)
    assert not np.array_equal(a.prompt_len, make_synthetic("sharegpt-like", 1000, seed=8).prompt_len)
    fixed = make_synthetic("fixed", 5, prompt_len=7, output_len=9)
    assert list(fixed.prompt_len) == [7] * 5 and list(fixed.output_len) == [9] * 5
    assert {"sharegpt-like", "alpaca-like", "fixed", "shared-prefix"} <= set(SYNTHETIC)
    with pytest.raises(ValueError, match="known: sharegpt-like, alpaca-like"):
        make_synthetic("lmsys", 10)


def test_shared_prefix_structure():
    trace = shared_prefix(400, seed=1, num_prefixes=3, prefix_len=100, suffix_len=20, output_len=5,
                          hash_block_size=16)
    shared_blocks = 100 // 16  # 6 full blocks lie inside the prefix; block 6 mixes in the suffix
    hashes = trace.prefix_hashes
    assert all(len(h) == math.ceil(120 / 16) for h in hashes)
    heads = {h[:shared_blocks] for h in hashes}
    assert len(heads) == 3  # exactly the distinct prefixes
    assert len({h[shared_blocks] for h in hashes}) == 400  # first suffix-touching block is private
    first = {}
    for h in hashes:
        first.setdefault(h[0], h[:shared_blocks])
        assert first[h[0]] == h[:shared_blocks]  # same first block -> same whole prefix chain
    expected = (400 - 3) * shared_blocks / (400 * len(hashes[0]))
    assert trace.info()["prefix_reuse"] == pytest.approx(expected)
    again = shared_prefix(400, seed=1, num_prefixes=3, prefix_len=100, suffix_len=20, output_len=5)
    assert again.prefix_hashes == hashes


def test_grouped_prefix_recurrence_and_sharing():
    g, p, cycle = 3, 4, 12
    trace = grouped_prefix(50, seed=2, num_groups=g, prompts_per_group=p, system_prompt_len=40, question_len=30,
                           output_len=7, hash_block_size=16)
    hashes = trace.prefix_hashes
    assert list(trace.prompt_len) == [70] * 50 and list(trace.output_len) == [7] * 50
    assert all(len(h) == math.ceil(70 / 16) for h in hashes)  # the partial last block is named too
    assert len(set(hashes[:cycle])) == cycle  # one cycle holds each prompt once
    assert all(hashes[i] == hashes[i - cycle] for i in range(cycle, 50))  # then it recurs exactly
    shared = 40 // 16  # 2 full blocks lie in the system prompt; block 2 holds question tokens
    groups = {h[:shared] for h in hashes[:cycle]}
    assert len(groups) == g
    for head in groups:  # each group's system prompt is shared by its p prompts, whose questions differ
        members = {h for h in hashes[:cycle] if h[:shared] == head}
        assert len(members) == p and len({h[shared] for h in members}) == p


def test_grouped_prefix_seeded_order():
    a = grouped_prefix(30, seed=5, num_groups=2, prompts_per_group=5, system_prompt_len=32, question_len=16)
    assert grouped_prefix(30, seed=5, num_groups=2, prompts_per_group=5, system_prompt_len=32,
                          question_len=16).prefix_hashes == a.prefix_hashes
    b = grouped_prefix(30, seed=6, num_groups=2, prompts_per_group=5, system_prompt_len=32, question_len=16)
    assert b.prefix_hashes != a.prefix_hashes  # another shuffle ...
    assert set(b.prefix_hashes) == set(a.prefix_hashes)  # ... of the same prompts
    assert make_synthetic("grouped-prefix", 3).prompt_len.tolist() == [547] * 3
    with pytest.raises(ValueError, match="num_groups"):
        grouped_prefix(5, num_groups=0)


# ---------------------------------------------------------------- resolve_trace and CLI


def test_resolve_trace(tmp_path):
    trace = resolve_trace("alpaca-like", num_requests=50, rate=2.0, seed=1)
    assert len(trace) == 50 and trace.has_timestamps
    path = small_trace().save(tmp_path / "s.csv")
    assert len(resolve_trace(str(path), num_requests=2)) == 2
    with pytest.raises(ValueError, match=r"sharegpt-like.*does not exist"):
        resolve_trace(str(tmp_path / "missing.csv"))
    lengths = make_synthetic("sharegpt-like", 5).save(tmp_path / "lengths.csv")  # no timestamps
    with pytest.raises(ValueError, match="--rate"):
        resolve_trace(str(lengths))
    # was ignored: `--trace fixed --trace-format mooncake` ran the synthetic kind
    with pytest.raises(ValueError, match="--trace-format mooncake: applies to trace files, not the synthetic"):
        resolve_trace("fixed", num_requests=5, rate=1.0, format="mooncake")


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagesim")
    add_trace_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_generate_and_info(tmp_path, capsys):
    out = tmp_path / "sp.parquet"
    argv = ["trace", "generate", "--kind", "shared-prefix", "--num-requests", "30", "--seed", "2",
            "--rate", "4", "--prefix-len", "64", "--out", str(out)]
    assert run_cli(argv) == 0
    trace = load_trace(out)
    assert len(trace) == 30 and trace.has_timestamps and trace.hash_block_size == 16
    capsys.readouterr()
    assert run_cli(["trace", "info", str(out)]) == 0
    table = capsys.readouterr().out
    assert "prefix reuse" in table and "mean rate" in table and "p99" in table
    assert run_cli(["trace", "info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_requests"] == 30
    bad = ["trace", "generate", "--kind", "alpaca-like", "--num-requests", "3", "--prefix-len", "8", "--out", str(out)]
    assert run_cli(bad) == 2
    assert run_cli(["trace", "info", str(tmp_path / "none.csv")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_cli_generate_grouped_prefix(tmp_path):
    out = tmp_path / "gp.csv"
    argv = ["trace", "generate", "--kind", "grouped-prefix", "--num-requests", "12", "--rate", "2", "--burstiness",
            "0", "--num-groups", "2", "--prompts-per-group", "3", "--system-prompt-len", "32", "--question-len", "8",
            "--output-len", "5", "--out", str(out)]
    assert run_cli(argv) == 0
    trace = load_trace(out)
    assert trace.prompt_len.tolist() == [40] * 12 and trace.output_len.tolist() == [5] * 12
    assert trace.prefix_hashes[6:] == trace.prefix_hashes[:6]  # 2 x 3 prompts, cycled
    assert np.diff(trace.arrival) == pytest.approx(np.full(11, 0.5))  # constant arrivals


def test_cli_info_of_a_trace_with_nothing_to_serve_is_valid_json(tmp_path, capsys):
    # every row rejected: the length statistics were NaN, printed as JSON's invalid `NaN`
    path = tmp_path / "BurstGPT_0.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n0,ChatGPT,0,0,0,x\n")
    with pytest.warns(UserWarning, match="failed requests"):
        assert run_cli(["trace", "info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert info["rejected"] == 1 and info["prompt_mean"] is None


def test_cli_generate_multi_client_without_rate(tmp_path, capsys):
    # multi-client draws its own timestamps: was a TypeError formatting --rate None after writing
    out = tmp_path / "mc.csv"
    assert run_cli(["trace", "generate", "--kind", "multi-client", "--num-requests", "5", "--out", str(out)]) == 0
    assert "with its own timestamps" in capsys.readouterr().out
    assert load_trace(out).has_timestamps


def test_package_imports_nothing_else():
    code = (
        "import sys, traces, traces.clients, traces.loaders, traces.workloads; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'simpy', 'triton', 'policies', 'sim', 'backend', 'analysis', 'pagesim', 'scipy'}))"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_synthetic_workload_without_a_rate_runs_at_the_default_and_says_so() -> None:
    from traces import DEFAULT_SYNTHETIC_RATE, resolve_trace
    with pytest.warns(UserWarning, match=r"no --rate given: sharegpt-like arrives at 1 req/s \(Poisson\)"):
        trace = resolve_trace("sharegpt-like", num_requests=50, seed=3)
    assert trace.has_timestamps and len(trace) == 50
    assert np.array_equal(trace.arrival, resolve_trace("sharegpt-like", 50, rate=DEFAULT_SYNTHETIC_RATE, seed=3).arrival)
