"""Measured runs in (analysis/measurements.py, analysis/measurement_formats.py), stages simulated."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.measurement_files import load_measurements
from analysis.measurements import (
    engine_defaults,
    predicted_metrics,
    simulate_stage,
    stage_config,
    stage_workload,
)
from pagesim.report_writer import write_run
from policies.client_latency import ClientTerms, lagged_times
from sim.cost_model import ConstantCostModel
from sim.run import SimConfig, run_simulation
from specs import get_model
from specs.catalogue import _variant_config_once
from traces import apply_arrivals, make_synthetic

SHARED = Path(__file__).resolve().parents[2] / "shared" / "calibration" / "vllm-h100" / "measurements.json"
BENCH = Path(__file__).parent / "data" / "vllm_bench_serve_result.json"


def experiment_dict(**changes) -> dict:
    """A small experiment in the vllm-h100 measurements.json schema (made-up figures)."""
    e = {"name": "tiny", "model_id": "meta-llama/Meta-Llama-3-8B", "tp": 1, "max_model_len": 4096,
         "max_num_batched_tokens": 2048, "max_num_seqs": 128, "workload": "general", "load_type": "constant",
         "ignore_eos": True, "overload_excluded_by_source": False,
         "shared_prefix": {"num_groups": 2, "num_prompts_per_group": 3, "system_prompt_len": 40, "question_len": 70,
                           "output_len": 20},
         "stages": [{"index": 0, "rate": 2.0, "duration_s": 10, "successes": 20, "failures": 0,
                     "ttft_s": {"mean": 0.03, "p90": 0.04, "p99": 0.05},
                     "e2e_s": {"mean": 0.41, "p90": 0.45, "p99": 0.5},
                     "prompt_len": {"mean": 120.0}, "throughput": {"requests_per_sec": 1.99}}]}
    e.update(changes)
    return e


def write_measurements(tmp_path: Path, *experiments: dict, name: str = "m.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"source": {}, "experiments": list(experiments)}))
    return path


def tiny(tmp_path: Path, **changes):
    return load_measurements(write_measurements(tmp_path, experiment_dict(**changes)))[0]


# --- loading -------------------------------------------------------------------------------------

@pytest.mark.skipif(not SHARED.exists(), reason="../shared/calibration not present")
def test_shared_measurements_load():
    exps = load_measurements(SHARED)
    assert len(exps) == 8 and sum(len(e.stages) for e in exps) == 12
    first = exps[0]
    assert first.model_id == "meta-llama/Llama-2-7b-hf" and first.tp == 1 and first.max_num_seqs == 128
    s = first.stages[0]
    assert s.rate == 5.0 and s.duration_s == 600 and s.load_type == "constant" and s.output_len == 247
    # time per output token derived from the means, not the client's own (chunk-counting) figure
    assert s.tpot == pytest.approx((s.e2e.mean - s.ttft.mean) / 246)
    assert s.tpot == pytest.approx(0.007257, abs=1e-6)
    overloaded = {e.workload_name for e in exps for st in e.stages if e.overloaded_by_source or st.overloaded}
    assert overloaded == {"reasoning"}  # both reasoning runs; every other stage was carried
    assert {e.tp for e in exps if "codellama" in e.model_id.lower()} == {2}
    assert {e.hardware for e in exps} == {"h100-sxm"}  # from the file's source.hardware text


def test_tpot_and_stage_fields(tmp_path):
    exp = tiny(tmp_path)
    s = exp.stages[0]
    assert s.tpot == pytest.approx((0.41 - 0.03) / 19)
    assert s.metrics()["e2e_p99"] == 0.5 and not s.overloaded
    assert exp.chunked_prefill and exp.prefix_caching and exp.block_size == 16  # vLLM V1 defaults
    assert exp.workload.system_prompt_len == 40 and exp.source.endswith("m.json")


@pytest.mark.parametrize("mutate, message", [
    (lambda e: e["stages"][0].pop("ttft_s"), r"m\.json: experiments\[0\]\.stages\[0\]\.ttft_s: missing"),
    (lambda e: e["stages"][0]["e2e_s"].update(mean="slow"), r"experiments\[0\]\.stages\[0\]\.e2e_s\.mean: expected a "
                                                           r"number"),
    (lambda e: e.update(tp=0), r"experiments\[0\]\.tp: expected a number >= 1"),
    (lambda e: e.update(model_id="acme/NoSuchModel-9B"), r"experiments\[0\]\.model_id: unknown model"),
    (lambda e: e["shared_prefix"].pop("question_len"), r"experiments\[0\]\.shared_prefix\.question_len: missing"),
    (lambda e: e.update(stages=[]), r"experiments\[0\]\.stages: expected a non-empty list"),
    (lambda e: e["stages"][0].update(rate=-1), r"stages\[0\]\.rate: expected a number > 0"),
    (lambda e: e.update(load_type="ramp"), r"experiments\[0\]\.load_type: 'ramp'"),
])
def test_malformed_measurements_name_file_and_field(tmp_path, mutate, message):
    e = experiment_dict()
    mutate(e)
    path = write_measurements(tmp_path, experiment_dict(), e)
    with pytest.raises(ValueError, match=message.replace("experiments\\[0\\]", "experiments\\[1\\]")):
        load_measurements(path)


def test_model_ids_found_in_models_dirs(tmp_path):
    configs = tmp_path / "models"
    configs.mkdir()
    (configs / "tiny-1b.json").write_text(json.dumps(get_model("smollm2-135m").to_hf_config()))
    path = write_measurements(tmp_path, experiment_dict(model_id="acme/Tiny-1B"))
    exp, = load_measurements(path, models_dirs=[configs])
    assert exp.model == str(configs / "tiny-1b.json") and exp.model_id == "acme/Tiny-1B"
    assert get_model(exp.model).num_layers == 30  # what SimConfig.model resolves
    with pytest.raises(ValueError, match=r"m\.json: experiments\[0\]\.model_id: unknown model 'acme/Tiny-1B'"):
        load_measurements(path, models_dirs=[])
    # a fine-tuned variant's id finds its base model's config (same shapes), and says so
    variant = write_measurements(tmp_path, experiment_dict(model_id="acme/Tiny-1B-Instruct"))
    _variant_config_once.cache_clear()  # the warning comes once per name in a process
    with pytest.warns(UserWarning, match="tiny-1b.json") as said:
        exp, = load_measurements(variant, models_dirs=[configs])
    assert str(tmp_path) not in str(said[0].message)  # the file relative to the working folder, not absolute
    assert exp.model == str(configs / "tiny-1b.json")


def test_unreadable_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"experiments": [')
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON"):
        load_measurements(bad)
    other = tmp_path / "other.json"
    other.write_text('{"rows": []}')
    with pytest.raises(ValueError, match=r"other\.json: not a measurements file"):
        load_measurements(other)
    with pytest.raises(ValueError, match="no such file"):
        load_measurements(tmp_path / "missing.json")


def test_vllm_bench_result():
    exp, = load_measurements(BENCH)
    s = exp.stages[0]
    assert exp.model_id == "meta-llama/Meta-Llama-3-8B" and exp.tp == 1 and exp.hardware == "h100-sxm"
    assert exp.max_num_seqs == 256 and exp.max_num_batched_tokens is None  # metadata given / vLLM's default
    assert s.rate == 2.0 and s.load_type == "poisson" and s.duration_s == pytest.approx(3.0)
    assert s.ttft.mean == pytest.approx(0.0322) and s.ttft.p90 is None and s.e2e.p99 == pytest.approx(1.0968)
    assert s.output_len == 64 and s.prompt_len_mean == 120 and (s.successes, s.failures) == (5, 1)
    assert s.requests.prompt_len.tolist() == [120, 80, 200, 150, 90, 110]
    assert s.requests.output_len.tolist() == [64] * 6  # the failed request's 0 -> the completed median
    cfg = stage_config(exp, s)
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (engine_defaults("h100-sxm")[0], 256)
    res = simulate_stage(exp, s, cfg)
    assert res.num_requests == 6 and res.measured["ttft_p90"] is None and np.isfinite(res.predicted["ttft_p90"])


@pytest.mark.parametrize("changes, message", [
    ({"max_concurrency": 8}, "max_concurrency: a client-side concurrency limit"),
    ({"request_rate": "inf"}, "request_rate: 'inf'"),
    ({"completed": 0}, "completed: no request completed"),
    ({"output_lens": [1, 2]}, r"output_lens: expected 6 integers"),
    ({"burstiness": 4.0}, None),
])
def test_vllm_bench_bad_fields(tmp_path, changes, message):
    d = json.loads(BENCH.read_text())
    d.update(changes)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(d))
    if message is None:  # vLLM's burstiness is the Gamma shape: CV 1/sqrt(4)
        s = load_measurements(path)[0].stages[0]
        assert (s.load_type, s.burstiness) == ("gamma", 0.5)
        return
    with pytest.raises(ValueError, match=rf"bench\.json: {message}"):
        load_measurements(path)


def test_vllm_bench_appended_results(tmp_path):
    text = BENCH.read_text()
    path = tmp_path / "appended.json"
    path.write_text(text + text.replace('"request_rate": 2.0', '"request_rate": 3.0'))
    exps = load_measurements(path)
    assert [e.stages[0].rate for e in exps] == [2.0, 3.0] and exps[1].name == "appended#1"


def test_pagesim_run_folder_round_trip(tmp_path):
    """A simulated run written and read back is a measured stage the simulator predicts exactly:
    same requests, same arrivals, prefix hashes regenerated from the recorded workload."""
    trace = apply_arrivals(make_synthetic("grouped-prefix", 30, seed=3), rate=3.0, burstiness=0)
    cfg = SimConfig(model="llama-3-8b", hardware="h100-sxm", chunked_prefill=True, prefix_caching=True,
                    max_num_batched_tokens=512, max_num_seqs=16, seed=3)
    res = run_simulation(cfg, trace)
    write_run(tmp_path / "run", res.requests, res.iterations, res.summary)
    exp, = load_measurements(tmp_path / "run")
    s = exp.stages[0]
    assert exp.model == "llama-3-8b" and exp.hardware == "h100-sxm" and exp.max_num_batched_tokens == 512
    assert s.requests.prefix_hashes == trace.prefix_hashes  # the sharing is back
    assert s.ttft.mean == pytest.approx(res.summary["ttft"]["mean"])
    assert s.e2e.p90 == pytest.approx(res.summary["e2e_latency"]["p90"])
    assert s.rate == pytest.approx(3.0)
    again = simulate_stage(exp, s, stage_config(exp, s), seed=3)
    for metric, measured in again.measured.items():
        assert again.predicted[metric] == pytest.approx(measured, rel=1e-9), metric
    assert load_measurements(tmp_path / "run" / "summary.json")[0].name == "run"


def test_pagesim_run_folder_errors(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text('{"config": {"model": "llama-3-8b"}}')
    with pytest.raises(ValueError, match=r"requests\.csv: missing"):
        load_measurements(tmp_path / "run")
    (tmp_path / "run" / "requests.csv").write_text("arrival,prompt_len\n0.1,5\n")
    with pytest.raises(ValueError, match=r"requests\.csv: missing columns output_len, ttft"):
        load_measurements(tmp_path / "run")


# --- a stage rebuilt and simulated ----------------------------------------------------------------

def test_stage_workload_rebuilds_the_measured_load(tmp_path):
    exp = tiny(tmp_path)
    s = exp.stages[0]
    trace = stage_workload(exp, s, seed=1)
    assert len(trace) == 20 and trace.arrival.tolist() == pytest.approx([(i + 1) / 2.0 for i in range(20)])
    assert set(trace.prompt_len.tolist()) == {120}  # question scaled: 40 + 80 = the measured mean 120
    assert set(trace.output_len.tolist()) == {20} and trace.hash_block_size == 16
    assert trace.prefix_hashes[6] == trace.prefix_hashes[0]  # 2 x 3 prompts recur every 6 requests
    assert len(stage_workload(exp, s, seed=1, max_duration_s=4)) == 8
    poisson = tiny(tmp_path, load_type="poisson")
    gaps = np.diff(stage_workload(poisson, poisson.stages[0], seed=1).arrival)
    assert gaps.std() > 0.1  # not evenly spaced


def test_stage_config_is_vllm_v1(tmp_path):
    exp = tiny(tmp_path, tp=2)
    cfg = stage_config(exp, exp.stages[0], "h100-sxm")
    assert (cfg.policy, cfg.chunked_prefill, cfg.prefix_caching, cfg.block_size) == ("vllm", True, True, 16)
    assert (cfg.tp, cfg.max_num_batched_tokens, cfg.max_num_seqs) == (2, 2048, 128)
    assert cfg.cost_model == "roofline" and cfg.num_gpu_blocks is None  # sized from gpu_memory_utilization
    assert stage_config(exp, exp.stages[0], "h100-sxm", max_num_seqs=7).max_num_seqs == 7
    cal = stage_config(exp, exp.stages[0], "h100-sxm", calibration="some-calibration")
    assert (cal.cost_model, cal.calibration) == ("calibrated", "some-calibration")
    with pytest.raises(ValueError, match="hardware"):
        stage_config(exp, exp.stages[0])  # the file does not say, and none was given


def test_simulate_stage_client_terms_and_determinism(tmp_path):
    exp = tiny(tmp_path)
    s = exp.stages[0]
    cfg = stage_config(exp, s, "h100-sxm")
    base = simulate_stage(exp, s, cfg, seed=2)
    assert base.num_requests == 20 and not base.predicted_overloaded and not base.measured_overloaded
    assert simulate_stage(exp, s, cfg, seed=2).predicted == base.predicted
    client = simulate_stage(exp, s, cfg, seed=2, client={"ttft_s": 0.01, "per_output_token_s": 0.002})
    p, q = base.predicted, client.predicted
    assert q["ttft_mean"] - p["ttft_mean"] == pytest.approx(0.01)
    assert q["e2e_p99"] - p["e2e_p99"] == pytest.approx(0.01 + 0.002 * 19)
    assert q["tpot"] - p["tpot"] == pytest.approx(0.002)
    same = simulate_stage(exp, s, cfg, seed=2, client=ClientTerms(0.01, 0.002))
    assert same.predicted == client.predicted


def test_lagged_times_follow_the_next_iterations_and_flush_when_idle():
    """Iterations [0,1) [1,2) [2,3), idle, [5,6) [6,7): a token made at the end of one is sent at the
    end of the next one (lag 1), halfway through it (lag 0.5); with no next iteration back to back,
    at once."""
    its = pd.DataFrame({"start": [0.0, 1.0, 2.0, 5.0, 6.0], "duration": [1.0] * 5})
    made = np.array([1.0, 2.0, 3.0, 6.0, 7.0])
    assert lagged_times(made, its, 1.0).tolist() == [2.0, 3.0, 3.0, 7.0, 7.0]
    assert lagged_times(made, its, 0.5).tolist() == [1.5, 2.5, 3.0, 6.5, 7.0]
    assert lagged_times(made, its, 2.0).tolist() == [3.0, 3.0, 3.0, 7.0, 7.0]
    assert lagged_times(made, its, 0.0).tolist() == made.tolist()


def test_output_lag_delays_first_and_last_tokens_by_the_runs_own_steps(tmp_path):
    exp = tiny(tmp_path)
    s = exp.stages[0]
    cfg = stage_config(exp, s, "h100-sxm")
    res = run_simulation(dataclasses.replace(cfg, seed=2), stage_workload(exp, s, 2))
    base = predicted_metrics(res.requests, ClientTerms(), res.iterations)
    lag = predicted_metrics(res.requests, ClientTerms(output_lag_steps=1.0), res.iterations)
    longest = float(res.iterations.duration.max())
    assert 0 < lag["ttft_mean"] - base["ttft_mean"] <= longest
    assert 0 <= lag["e2e_mean"] - base["e2e_mean"] <= longest
    with pytest.raises(ValueError, match="iteration table"):
        predicted_metrics(res.requests, ClientTerms(output_lag_steps=1.0))


@pytest.mark.parametrize("terms", [ClientTerms(), ClientTerms(0.004, 0.0, 1.28), ClientTerms(0.01, 0.001, 0.5),
                                   ClientTerms(0.0, 0.0, 3.0)])
def test_predicted_metrics_are_the_client_columns_statistics_bit_for_bit(tmp_path, terms):
    """predicted_metrics (the arrays a calibration's inner fit re-applies client terms to, without
    pandas) gives exactly the statistics of the client columns every run's request table carries."""
    from analysis.measurements import FinishedRequests
    from policies.client_latency import with_client_latencies

    exp = _with_rate(tiny(tmp_path), 6.0)  # a queue: iterations back to back, so the lag has steps to count
    s = exp.stages[0]
    res = run_simulation(dataclasses.replace(stage_config(exp, s, "h100-sxm"), seed=2), stage_workload(exp, s, 2))
    table = with_client_latencies(res.requests[res.requests.status == "finished"], res.iterations, terms)
    ttft, e2e = table.client_ttft.to_numpy(np.float64), table.client_e2e_latency.to_numpy(np.float64)
    tpot = table.client_tpot.dropna().to_numpy(np.float64)
    got = predicted_metrics(FinishedRequests.of(res.requests), terms, res.iterations)
    assert got == predicted_metrics(res.requests, terms, res.iterations)
    assert (got["ttft_mean"], got["e2e_mean"]) == (float(ttft.mean()), float(e2e.mean()))
    assert [got[k] for k in ("ttft_p10", "ttft_p50", "ttft_p90")] == np.percentile(ttft, [10, 50, 90]).tolist()
    assert [got["e2e_p90"], got["e2e_p99"]] == np.percentile(e2e, [90, 99]).tolist()
    assert [got["tpot_p50"], got["tpot_p90"]] == np.percentile(tpot, [50, 90]).tolist()


def test_simulated_overload(tmp_path):
    """4 sequences at a time, each 20 decode steps of 50 ms: about 4 requests/s at most."""
    slow = ConstantCostModel(prefill_per_token=1e-5, decode_per_seq=0.0, base=0.05)
    heavy = _with_rate(tiny(tmp_path, max_num_seqs=4), 20.0)
    light = _with_rate(heavy, 1.0)
    assert simulate_stage(heavy, heavy.stages[0], stage_config(heavy, heavy.stages[0], "h100-sxm"), slow,
                          max_duration_s=6).predicted_overloaded
    assert not simulate_stage(light, light.stages[0], stage_config(light, light.stages[0], "h100-sxm"), slow,
                              max_duration_s=6).predicted_overloaded


def _with_rate(exp, rate):
    return dataclasses.replace(exp, stages=(dataclasses.replace(exp.stages[0], rate=rate),))
