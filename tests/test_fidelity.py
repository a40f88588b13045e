"""`pagesim fidelity`: measured stages simulated, errors tabulated (analysis/fidelity.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest

from analysis.fidelity import fidelity_summary, fidelity_table, format_table
from analysis.measurement_files import load_measurements
from analysis.measurements import LATENCY_METRICS, stage_workload
from pagesim.cli import main
from tests.test_measurements import SHARED, experiment_dict, write_measurements


def two_experiments(tmp_path: Path) -> Path:
    second = experiment_dict(name="second", tp=2)
    second["stages"].append({**second["stages"][0], "index": 1, "rate": 3.0})
    return write_measurements(tmp_path, experiment_dict(), second)


def test_fidelity_cli_writes_table_and_figure(tmp_path, capsys):
    path = two_experiments(tmp_path)
    out = tmp_path / "out"
    assert main(["fidelity", "--measurements", str(path), "--max-duration", "5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "note: 2 experiments do not say their hardware (tiny, second): simulated on h100-sxm" in printed
    table = pd.read_csv(out / "fidelity.csv")
    assert len(table) == 3 * len(LATENCY_METRICS)  # 3 stages x 6 metrics
    assert set(table.metric) == set(LATENCY_METRICS)
    row = table[(table.experiment == "tiny") & (table.metric == "ttft_mean")].iloc[0]
    assert row.measured == 0.03 and row.error_pct == pytest.approx(100 * (row.predicted - 0.03) / 0.03)
    assert (out / "fidelity.png").stat().st_size > 0
    summary = json.loads((out / "fidelity.json").read_text())
    assert summary["all"]["overall"]["n"] == 18 and summary["max_duration_s"] == 5
    assert "time per output token" in printed and "median" in printed and "18 comparisons" in printed


def test_fidelity_cli_bad_input(tmp_path, capsys):
    e = experiment_dict()
    del e["stages"][0]["e2e_s"]
    path = write_measurements(tmp_path, e, name="broken.json")
    assert main(["fidelity", "--measurements", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "broken.json: experiments[0].stages[0].e2e_s: missing" in err and "Traceback" not in err
    e = experiment_dict(model_id="acme/Unknown-3B")
    path = write_measurements(tmp_path, e, name="unknown.json")
    assert main(["fidelity", "--measurements", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "unknown.json: experiments[0].model_id: unknown model 'acme/Unknown-3B'" in capsys.readouterr().err


def test_fidelity_reports_an_experiment_that_cannot_fit_and_goes_on(tmp_path, capsys):
    big = experiment_dict(name="big", model_id="meta-llama/Meta-Llama-3-70B", tp=1)  # 140 GB on one 80 GB GPU
    path = write_measurements(tmp_path, experiment_dict(), big)
    out = tmp_path / "out"
    assert main(["fidelity", "--measurements", str(path), "--max-duration", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "not simulated: big: llama-3-70b does not fit on 1 x h100-sxm" in printed
    assert set(pd.read_csv(out / "fidelity.csv").experiment) == {"tiny"}
    assert "does not fit" in json.loads((out / "fidelity.json").read_text())["not_simulated"]["big"]
    only_big = write_measurements(tmp_path, big, name="big.json")
    assert main(["fidelity", "--measurements", str(only_big), "--out", str(out)]) == 2
    assert "no experiment can be simulated" in capsys.readouterr().err


def test_fidelity_parallel_is_serial(tmp_path):
    exps = load_measurements(two_experiments(tmp_path))
    kw = {"hardware": "h100-sxm", "max_duration_s": 4}
    one = fidelity_table(exps, jobs=1, **kw).drop(columns="wall_s")
    two = fidelity_table(exps, jobs=2, **kw).drop(columns="wall_s")
    pd.testing.assert_frame_equal(one, two)
    assert "tiny" in format_table(one)


def test_fidelity_with_a_calibration_file_applies_its_client_terms(tmp_path):
    from sim.calibrated import Calibration, CalibrationParams, save_calibration

    exps = load_measurements(write_measurements(tmp_path, experiment_dict()))
    preds = []
    for ttft_add in (0.0, 0.5):
        params = CalibrationParams(client_ttft_s=ttft_add, client_per_output_token_s=0.001 * bool(ttft_add))
        path = save_calibration(Calibration(params, "h100-sxm", name="t"), tmp_path / f"cal{ttft_add}.json")
        t = fidelity_table(exps, str(path), max_duration_s=4, hardware="h100-sxm").set_index("metric")
        preds.append(t.predicted)
    assert preds[1]["ttft_mean"] - preds[0]["ttft_mean"] == pytest.approx(0.5)
    assert preds[1]["e2e_mean"] - preds[0]["e2e_mean"] == pytest.approx(0.5 + 0.001 * 19)
    assert preds[1]["tpot"] - preds[0]["tpot"] == pytest.approx(0.001)


def test_fidelity_summary_statistics():
    rows = []
    for stage, (errs, over_m, over_p) in enumerate([([10, -20], False, False), ([30, 40], False, True),
                                                    ([-90, 500], True, True)]):
        for metric, err in zip(("ttft_mean", "tpot"), errs):
            rows.append({"experiment": "e", "stage": stage, "metric": metric, "error_pct": err,
                         "measured_overloaded": over_m, "predicted_overloaded": over_p})
    s = fidelity_summary(pd.DataFrame(rows))
    assert s["all"]["ttft_mean"] == {"n": 3, "median_abs_pct": 30.0, "mean_abs_pct": pytest.approx(130 / 3)}
    assert s["all"]["overall"]["median_abs_pct"] == 35.0  # |10|, |-20|, 30, 40, |-90|, 500
    assert s["carried"]["overall"] == {"n": 4, "median_abs_pct": 25.0, "mean_abs_pct": 25.0}
    assert s["overload"]["stages"] == 3 and s["overload"]["agree"] == 2 and s["overload"]["disagree"] == ["e stage 1"]


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/calibration not present")
def test_fidelity_on_the_shared_measurements_truncated(tmp_path):
    exps = load_measurements(SHARED)[:1]  # Llama-2-7B codegen, two stages, 20 s of each
    table = fidelity_table(exps, max_duration_s=20)
    assert len(table) == 2 * len(LATENCY_METRICS) and table.predicted.notna().all()
    assert not table.predicted_overloaded.any()  # 5 and 10 req/s of ~600-token prompts: far from saturation


def test_the_cost_in_headers_and_figure_titles_names_a_calibration_file_not_its_path():
    from analysis.fidelity import FidelityStudy
    assert FidelityStudy(["m.json"], calibration="/some/where/my-cal.json").cost == "calibration my-cal"
    assert FidelityStudy(["m.json"], calibration="vllm-v1-h100").cost == "calibration vllm-v1-h100"
    assert FidelityStudy(["m.json"]).cost == "the roofline cost model"


# --- one warm-up rule for fidelity, calibrate and --max-duration windows (analysis.measurements.stage_window) ---

def test_stage_window_warms_a_window_up_and_simulates_a_whole_stage_as_measured(tmp_path):
    from analysis.measurements import StageWindow, prompt_cycle, stage_window

    exp = load_measurements(write_measurements(tmp_path, experiment_dict()))[0]  # 2 groups x 3 prompts, 2 req/s, 10 s
    s = exp.stages[0]
    assert prompt_cycle(exp, s) == 6  # one cycle: 3 s of arrivals
    assert stage_window(exp, s, 4.0) == StageWindow(7.0, 6)  # the cycle, then 4 s counted
    assert stage_window(exp, s, None) == StageWindow(None, 0)  # the whole stage, as measured
    assert stage_window(exp, s, 8.0) == StageWindow(8.0, 0)  # the cycle and 8 s would reach the end: as measured
    replayed = dataclasses.replace(s, requests=stage_workload(exp, s, 0, 4.0))  # its own requests: no cycle
    assert prompt_cycle(exp, replayed) == 0 and stage_window(exp, replayed, 4.0) == StageWindow(4.0, 0)


def test_simulate_stage_counts_a_window_after_the_warm_up_cycle(tmp_path):
    from analysis.measurements import simulate_stage, stage_config

    exp = load_measurements(write_measurements(tmp_path, experiment_dict()))[0]
    s = exp.stages[0]
    res = simulate_stage(exp, s, stage_config(exp, s, "h100-sxm"), max_duration_s=4.0)
    assert res.warm_up == 6 and res.num_requests == 14  # 7 s of arrivals at 2 req/s
    assert sorted(res.requests.request_id) == list(range(6, 14))
    whole = simulate_stage(exp, s, stage_config(exp, s, "h100-sxm"))
    assert whole.warm_up == 0 and whole.num_requests == len(whole.requests) == 20


@pytest.mark.slow  # the operator fit of the default kernel profiles, then one short fit of a made-up stage
def test_fidelity_predicts_a_stage_as_calibrate_did_in_sample(tmp_path, capsys):
    """The calibration's recorded in-sample prediction of each stage (`fit.in_sample`) is what `pagesim
    fidelity` predicts with that calibration over the same window: truncated, and over whole stages."""
    from sim.calibrated import load_calibration

    path = two_experiments(tmp_path)
    for eval_s, fid_args in (("4", ["--max-duration", "4"]), ("0", [])):
        cal = tmp_path / f"cal{eval_s}.json"
        assert main(["calibrate", "--measurements", str(path), "--hardware", "h100-sxm", "--out", str(cal),
                     "--no-leave-one-out", "--jobs", "1", "--starts", "1", "--max-evals", "1",
                     "--max-duration", "3", "--eval-duration", eval_s]) == 0
        fit = load_calibration(cal).meta["fit"]
        recorded = {(row["stage"], m): v["predicted"] for row in fit["in_sample"]["stages"]
                    for m, v in row.items() if isinstance(v, dict)}
        recorded |= {(c["stage"], "ttft_mean"): c["predicted_ttft_mean"] for c in fit["overloaded_checks"]}
        out = tmp_path / f"fid{eval_s}"
        assert main(["fidelity", "--measurements", str(path), "--calibration", str(cal), "--hardware", "h100-sxm",
                     "--out", str(out), *fid_args]) == 0
        table = pd.read_csv(out / "fidelity.csv")
        assert len(table) == 3 * len(LATENCY_METRICS) and set(table.warm_up_requests) == {6 if fid_args else 0}
        predicted = {(f"{r.experiment}#{r.stage}", r.metric): r.predicted for r in table.itertuples()}
        assert len(recorded) == 2 * 5 + 1  # two fitted stages x FIT_METRICS, the overloaded stage's TTFT
        for key, value in recorded.items():
            assert predicted[key] == pytest.approx(value, rel=1e-12), key
    capsys.readouterr()
