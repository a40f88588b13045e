"""Per-request runs in the llmservingsim layout (analysis/request_runs.py) and vLLM layer-wise kernel
profiles (analysis/kernel_profiles.py): read, replayed exactly, compared; bad input named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.kernel_profiles import fit_profiles, profile_inputs
from analysis.measurement_files import load_measurements
from analysis.request_runs import (
    MeasuredRun,
    over_time_comparison,
    per_request_comparison,
    request_run_report,
    simulated_gauges,
)
from pagesim.cli import main
from sim.specs import get_hardware

LLMSERVINGSIM = Path(__file__).resolve().parents[2] / "shared" / "calibration" / "llmservingsim"
RUN = LLMSERVINGSIM / "bench" / "examples" / "RTXPRO6000" / "Llama-3.1-8B" / "vllm"
PROFILES = LLMSERVINGSIM / "profiler" / "perf"


def write_run(root: Path, n: int = 6, **meta_changes) -> Path:
    """A small run: requests every 0.2 s, prompts of 20 + i tokens sharing a 16-token prefix,
    outputs of 4 tokens; the engine's clock 1000 s ahead of the wall clock."""
    folder = root / "bench" / "GPU" / "model" / "vllm"
    folder.mkdir(parents=True)
    (root / "workloads").mkdir()
    reqs, work = [], []
    for i in range(n):
        arrival = 0.2 * i
        ids = list(range(16)) + [100 + i] * (4 + i)
        work.append({"input_toks": len(ids), "output_toks": 4, "arrival_time_ns": int(arrival * 1e9),
                     "input_tok_ids": ids})
        t = 1000.0 + arrival
        reqs.append({"request_id": f"bench-{i}", "input_toks": len(ids), "output_toks": 4, "arrival_time": 5e8 + arrival,
                     "queued_ts": t + 0.001, "scheduled_ts": t + 0.002, "first_token_ts": t + 0.05,
                     "last_token_ts": t + 0.08})
    meta = {"model": "tiny-llama", "engine_kwargs": {"model": "tiny-llama", "tensor_parallel_size": 1,
                                                     "max_num_seqs": 8, "max_num_batched_tokens": 64},
            "dataset_path": "workloads/w.jsonl", "num_requests": n, "tick_seconds": 0.5, **meta_changes}
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    (root / "workloads" / "w.jsonl").write_text("".join(json.dumps(w) + "\n" for w in work))
    pd.DataFrame({"t": [0.5, 1.0, 1.5], "prompt_throughput": 0.0, "gen_throughput": 0.0, "running": [1, 1, 0],
                  "waiting": [0, 0, 0], "kv_cache_pct": 0.0}).to_csv(folder / "timeseries.csv", index=False)
    return folder


def test_a_run_is_replayed_exactly_with_the_engines_settings(tmp_path: Path) -> None:
    (exp,) = load_measurements(write_run(tmp_path), [])
    stage = exp.stages[0]
    trace = stage.requests
    np.testing.assert_allclose(trace.arrival, 0.2 * np.arange(6), atol=1e-6)
    assert trace.prompt_token_ids[2] == list(range(16)) + [102] * 6 and trace.output_len.tolist() == [4] * 6
    assert (exp.tp, exp.max_num_seqs, exp.max_num_batched_tokens, exp.prefix_caching, exp.chunked_prefill) == (
        1, 8, 64, True, True)
    measured = stage.measured_run.requests
    # the clocks aligned on the first request: each request queued 1 ms after it arrived
    np.testing.assert_allclose(measured.ttft, 0.049, atol=1e-6)
    np.testing.assert_allclose(measured.e2e_latency, 0.079, atol=1e-6)
    np.testing.assert_allclose(measured.tpot, 0.01, atol=1e-6)
    assert stage.ttft.mean == pytest.approx(0.049, abs=1e-6) and stage.measured_run.tick_s == 0.5


@pytest.mark.parametrize(("edit", "message"), [
    (lambda f: _edit_line(f / "requests.jsonl", 2, first_token_ts=None),
     r"requests.jsonl: line 2: first_token_ts: expected a finite number >= 0, got None"),
    (lambda f: _edit_line(f / "requests.jsonl", 3, queued_ts=1.0),
     r"requests.jsonl: line 3: queued_ts: .* the clocks cannot be aligned"),
    (lambda f: _edit_line(f / "requests.jsonl", 4, last_token_ts=0.5),
     r"requests.jsonl: line 4: last_token_ts: .*precedes"),
    (lambda f: _edit_line(f.parents[3] / "workloads" / "w.jsonl", 5, output_toks=9),
     r"w.jsonl: line 5: output_toks: 9, but requests.jsonl has 4"),
    (lambda f: _edit_line(f.parents[3] / "workloads" / "w.jsonl", 1, input_tok_ids=[1, 2]),
     r"w.jsonl: line 1: input_tok_ids: expected 20 token ids"),
    (lambda f: (f.parents[3] / "workloads" / "w.jsonl").write_text(
        "\n".join((f.parents[3] / "workloads" / "w.jsonl").read_text().splitlines()[:5]) + "\n"),
     r"w.jsonl: 5 requests, but requests.jsonl holds 6"),
    (lambda f: (f / "timeseries.csv").write_text("t,running,queue,kv_cache_pct\n1,2,3,0\n"),
     r"timeseries.csv: missing columns waiting"),
    (lambda f: (f / "timeseries.csv").write_text("t,running,waiting,kv_cache_pct\n1,2,x,0\n"),
     r"timeseries.csv: line 2: waiting: expected a number >= 0, got 'x'"),
    (lambda f: (f / "requests.jsonl").write_text("{\"input_toks\": 3\n"),
     r"requests.jsonl: line 1: unreadable JSON"),
])
def test_bad_input_is_one_line_naming_file_line_and_field(tmp_path: Path, edit, message) -> None:
    folder = write_run(tmp_path)
    edit(folder)
    with pytest.raises(ValueError, match=message):
        load_measurements(folder, [])


def test_a_missing_workload_and_a_count_that_disagrees_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"meta.json: dataset_path: 'workloads/none.jsonl' not found"):
        load_measurements(write_run(tmp_path / "a", dataset_path="workloads/none.jsonl"), [])
    with pytest.raises(ValueError, match=r"meta.json: num_requests: 7, but .*requests.jsonl holds 6"):
        load_measurements(write_run(tmp_path / "b", num_requests=7), [])


def _edit_line(path: Path, line: int, **fields) -> None:
    lines = path.read_text().splitlines()
    obj = json.loads(lines[line - 1])
    obj.update(fields)
    lines[line - 1] = json.dumps(obj)
    path.write_text("\n".join(lines) + "\n")


def test_gauges_are_read_from_the_last_iteration_started_and_zero_when_idle() -> None:
    its = pd.DataFrame({"start": [0.0, 1.0, 2.0, 5.0], "duration": [1.0, 1.0, 0.5, 1.0], "running": [3, 4, 2, 1],
                        "waiting": [1, 0, 0, 0], "kv_token_states": [10, 20, 5, 5], "kv_reserved": 0,
                        "kv_internal_frag": 0, "kv_external_frag": 0, "kv_free": [90, 80, 95, 95]})
    g = simulated_gauges(its, np.array([-1.0, 0.5, 1.0, 2.2, 3.0, 5.5, 7.0]))
    assert g.running.tolist() == [0, 3, 4, 2, 0, 1, 0]  # idle from 2.5 to 5 and after 6
    assert g.waiting.tolist() == [0, 1, 0, 0, 0, 0, 0]
    assert g.kv_usage.tolist() == pytest.approx([0, 0.1, 0.2, 0.05, 0, 0.05, 0])
    measured = pd.DataFrame({"t": [0.5, 1.0], "running": [3.0, 2.0], "waiting": [1.0, 1.0], "kv_usage": [0.0, 0.0]})
    table, errors = over_time_comparison(measured, its)
    assert errors["running"]["relative_mae_pct"] == pytest.approx(100 * (0 + 2) / 2 / 2.5)
    assert errors["waiting"]["mae"] == pytest.approx(0.5) and errors["kv_usage"] is None
    assert table.running_predicted.tolist() == [3, 4]


def test_per_request_statistics_are_over_the_same_requests() -> None:
    measured = pd.DataFrame({"request_id": [0, 1, 2, 3], "ttft": [1.0, 2.0, 3.0, 4.0], "tpot": [0.1] * 4,
                             "e2e_latency": [2.0, 3.0, 4.0, 5.0]})
    predicted = pd.DataFrame({"request_id": [0, 1, 2, 3], "ttft": [1.1, 2.2, 3.3, 4.4], "tpot": [0.1] * 4,
                              "e2e_latency": [2.0, 3.0, 4.0, 5.0]})
    both, stats = per_request_comparison(measured, predicted)
    row = stats[(stats.metric == "ttft") & (stats.statistic == "mean")].iloc[0]
    assert (row.measured, row.predicted, row.error_pct) == pytest.approx((2.5, 2.75, 10.0))
    p90 = stats[(stats.metric == "ttft") & (stats.statistic == "p90")].iloc[0]
    assert p90.error_pct == pytest.approx(10.0) and len(both) == 4


def test_a_replay_that_reproduces_the_run_has_no_error(tmp_path: Path) -> None:
    """Measurements made from a simulated replay of the run itself: every error is zero."""
    from analysis.measurements import simulate_stage, stage_config
    (exp,) = load_measurements(write_run(tmp_path), [])
    res = simulate_stage(exp, exp.stages[0], stage_config(exp, exp.stages[0], "a100-40gb"))
    r = res.requests
    truth = pd.DataFrame({"request_id": r.request_id, "ttft": r.ttft, "tpot": r.tpot, "e2e_latency": r.e2e_latency})
    its = res.iterations
    ticks = np.linspace(0.0, float(its.start.max()), 7)
    gauges = simulated_gauges(its, ticks)
    run = MeasuredRun(truth, gauges, 0.1, "made up")
    report = request_run_report("self", run, r, its)
    assert np.abs(report.statistics.error_pct).max() == 0
    assert all(e is None or e["mae"] == 0 for e in report.over_time_errors.values())


@pytest.mark.skipif(not RUN.is_dir(), reason="needs ../shared/calibration/llmservingsim")
def test_fidelity_on_the_shared_per_request_run(tmp_path: Path, capsys) -> None:
    out = tmp_path / "fid"
    assert main(["fidelity", "--measurements", str(RUN), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per request (300 requests)" in printed and "running" in printed and "not logged" in printed
    stats = pd.read_csv(out / "request_runs" / "0" / "per_request_stats.csv")
    assert len(stats) == 12 and stats.measured.notna().all()
    ttft = stats[(stats.metric == "ttft") & (stats.statistic == "mean")].measured.iloc[0]
    assert ttft == pytest.approx(7.119, abs=0.01)  # the run's own mean TTFT, clocks aligned on the first request
    over = pd.read_csv(out / "request_runs" / "0" / "over_time.csv")
    assert len(over) == 67 and over.running_measured.max() == 128
    saved = json.loads((out / "request_runs.json").read_text())
    assert saved[0]["over_time"]["kv_usage"] is None and (out / "request_runs" / "0" / "request_run.png").is_file()


@pytest.mark.skipif(not PROFILES.is_dir(), reason="needs ../shared/calibration/llmservingsim")
def test_kernel_profiles_fit_the_operator_curves() -> None:
    params, report = fit_profiles(PROFILES / "RTX4090", get_hardware("rtx-4090"))
    assert report["gemm_median_abs_error"] < 0.05 and report["gemm_points"] == 4 * 152 + 40
    assert report["prefill_attn_eff_median_abs_error"] < 0.1 and report["attn_mem_eff_median_abs_error"] < 0.1
    assert 0.5 < params["weight_mem_eff"] <= 1 and 0 < params["attn_mem_eff"] <= 1
    assert params["elementwise_floor_s"] == report["elementwise_floor_s"] and "attn_mem_eff_floor_s" not in params
    _, _, files, skipped = profile_inputs(PROFILES / "RTXPRO6000")
    assert any("Qwen3-30B" in f for f in files) and all("Qwen3-32B" in k for k in skipped)


def test_a_profile_csv_with_unknown_columns_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "GPU" / "meta-llama" / "Llama-3.1-8B" / "bf16" / "tp1"
    folder.mkdir(parents=True)
    (folder / "dense.csv").write_text("layer,tokens,time_us,stddev\nqkv_proj,1,3.0,0.1\n")
    with pytest.raises(ValueError, match=r"dense.csv: columns .*unknown \['stddev'\]"):
        fit_profiles(tmp_path / "GPU", get_hardware("rtx-4090"), models_dirs=[])


def test_a_transferred_calibration_records_where_each_term_came_from() -> None:
    from analysis.transfer import transfer_calibration
    from sim.calibrated import load_calibration
    base = load_calibration("vllm-v1-h100")
    cal = transfer_calibration(base, {"gemm_eff_max": 0.5, "attn_mem_eff": 0.7}, "profiles/X", "rtx-4090", "moved")
    p, where = cal.params, cal.meta["provenance"]
    assert (p.gemm_eff_max, p.attn_mem_eff, cal.hardware) == (0.5, 0.7, "rtx-4090")
    assert where["gemm_eff_max"] == "kernel profiles of rtx-4090: profiles/X"
    assert p.iteration_overhead_s == base.params.iteration_overhead_s and "carried from calibration vllm-v1-h100" in \
        where["iteration_overhead_s"] and "carried" in where["client_ttft_s"]
    assert p.allreduce_latency_s == get_hardware("rtx-4090").interconnect_latency_s and "hardware file" in \
        where["allreduce_latency_s"]
    with pytest.raises(ValueError, match=r"operator terms: unknown \['per_seq_s'\]"):
        transfer_calibration(base, {"per_seq_s": 1.0}, "x", "rtx-4090", "bad")


@pytest.mark.skipif(not PROFILES.is_dir(), reason="needs ../shared/calibration/llmservingsim")
def test_calibrate_engine_from_writes_a_calibration_with_its_sources(tmp_path: Path, capsys) -> None:
    from sim.calibrated import load_calibration
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--engine-from", "vllm-v1-h100", "--operators", str(PROFILES / "RTX4090"),
                 "--hardware", "rtx-4090", "--out", str(out)]) == 0
    cal = load_calibration(out)
    assert cal.hardware == "rtx-4090" and cal.meta["errors"]["end_to_end"] is None
    assert {s["path"].split("/")[-1] for s in cal.meta["sources"]} >= {"vllm-v1-h100.json", "dense.csv", "attention.csv"}
    assert all(len(s["sha256"]) == 64 for s in cal.meta["sources"])
    assert "kernel profiles of rtx-4090" in capsys.readouterr().out
    assert main(["calibrate", "--hardware", "rtx-4090", "--out", str(tmp_path / "x.json")]) == 2
    assert "--measurements: required (or --engine-from" in capsys.readouterr().err


def test_a_calibration_used_on_another_engine_version_is_warned_of(tmp_path: Path) -> None:
    from analysis.fidelity import engine_warnings
    from sim.calibrated import Calibration, CalibrationParams, save_calibration
    path = save_calibration(Calibration(CalibrationParams(), "h100-sxm", "v19", {"engine": {"vllm_version": ["0.19.0"]}}),
                            tmp_path / "v19.json")
    (old,) = load_measurements(write_run(tmp_path / "a", vllm_version="0.8.5"), [])
    (same,) = load_measurements(write_run(tmp_path / "b", vllm_version="0.19.0"), [])
    (unsaid,) = load_measurements(write_run(tmp_path / "c"), [])
    lines = engine_warnings([old, same, unsaid], str(path))
    assert lines == [f"warning: calibration v19 was fitted on vLLM 0.19.0; {old.name} ran vLLM 0.8.5: its engine "
                     "terms may not hold there"]
    assert engine_warnings([old], None) == []


@pytest.mark.slow  # the operator fit of the default kernel profiles, then a few short replays
def test_calibrate_fits_a_per_request_run_and_records_its_files(tmp_path: Path, capsys) -> None:
    from sim.calibrated import load_calibration
    run = write_run(tmp_path / "run", n=12)
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--measurements", str(run), "--hardware", "a100-40gb", "--operators", str(tmp_path / "none"),
                 "--out", str(out), "--no-leave-one-out", "--max-evals", "1", "--jobs", "1"]) == 2  # no such folder
    capsys.readouterr()
    assert main(["calibrate", "--measurements", str(run), "--hardware", "a100-40gb", "--out", str(out),
                 "--no-leave-one-out", "--max-evals", "1", "--jobs", "1", "--eval-duration", "0"]) == 0
    printed = capsys.readouterr().out
    assert "1 stages to fit, 0 overloaded" in printed and "per request (12 requests)" in printed
    names = [Path(s["path"]).name for s in load_calibration(out).meta["sources"]]
    assert names[:4] == ["meta.json", "requests.jsonl", "timeseries.csv", "w.jsonl"]
