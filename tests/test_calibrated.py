"""The calibrated roofline (sim/calibrated.py), MoE pricing (sim/moe.py), the operator fits
(analysis/operator_fit.py) and calibration files."""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from analysis.operator_fit import OperatorPoints, fit_allreduce, fit_gemm, gemm_time
from policies.plan import StepComposition
from sim.calibrated import (
    CalibratedCostModel,
    Calibration,
    CalibrationParams,
    load_calibration,
    save_calibration,
)
from sim.cost_model import RooflineCostModel
from sim.moe import LayerShapes, distinct_experts_table, expected_distinct_experts
from sim.run import SimConfig, build_cost_model
from sim.specs import ModelSpec, get_hardware, get_model

H100 = get_hardware("h100-sxm")
LLAMA = get_model("llama-7b")
# the data beside the repository (../shared from its root); a test whose file is absent skips
SHARED = Path(__file__).resolve().parents[2] / "shared"
MIXTRAL = SHARED / "models" / "mixtral-8x7b-v0.1.json"
MEASUREMENTS = SHARED / "calibration" / "vllm-h100" / "measurements.json"


# a small Mixtral-like MoE: 8 experts, top-2
MOE = ModelSpec("tiny-moe", "llama", 8, 1024, 16, 4, 64, 1024, 32000, 4096, num_experts=8, experts_per_token=2,
                moe_intermediate_size=1024)


# --- MoE maths ------------------------------------------------------------------------------------

def test_expected_distinct_experts_limits() -> None:
    assert expected_distinct_experts(1, 64, 6) == pytest.approx(6)
    assert expected_distinct_experts(0, 64, 6) == 0
    assert expected_distinct_experts(10_000, 64, 6) == pytest.approx(64)
    assert 6 < expected_distinct_experts(4, 64, 6) < 24  # fewer than 4 x 6: picks collide
    table = distinct_experts_table(8, 2)
    assert table[1] == pytest.approx(2) and table[-1] == 8


def test_moe_shapes_and_roofline_reads_only_touched_experts() -> None:
    s = LayerShapes.of(MOE)
    assert s.is_moe and s.moe_layers == 8 and s.top_k == 2
    assert not LayerShapes.of(LLAMA).is_moe
    roof = RooflineCostModel(MOE, H100)
    one, many = roof.breakdown(StepComposition(num_decode_seqs=1, decode_context_tokens=100)), \
        roof.breakdown(StepComposition(num_decode_seqs=256, decode_context_tokens=25600))
    assert many["linear"] > 2 * one["linear"]  # 2 experts read at one token, all 8 at 256
    cal = CalibratedCostModel(MOE, H100)
    assert cal.decode_step_time(256, 25600) > cal.decode_step_time(1, 100)
    ep = CalibratedCostModel(MOE, H100, tp=2, ep=2)
    assert ep.decode_step_time(64, 6400) > 0


@pytest.mark.skipif(not MIXTRAL.is_file(), reason="../shared/models/mixtral-8x7b-v0.1.json not present")
def test_mixtral_decode_reads_a_fraction_of_its_experts() -> None:
    mixtral = get_model(str(MIXTRAL))
    assert mixtral.is_moe and mixtral.experts_per_token == 2
    cal = CalibratedCostModel(mixtral, H100, tp=2)
    weights_s = mixtral.weight_bytes / 2 / (H100.mem_bandwidth * cal.params.weight_mem_eff)
    one = cal.breakdown(StepComposition(num_decode_seqs=1, decode_context_tokens=100))["linear"]
    assert 0.2 * weights_s < one < 0.5 * weights_s  # 2 of 8 experts + attention, not all 47B weights


# --- the calibrated model ------------------------------------------------------------------------

@pytest.mark.parametrize("model, tp", [(LLAMA, 1), (LLAMA, 2), (MOE, 1), (MOE, 2)])
def test_pure_decode_bit_identical(model: ModelSpec, tp: int) -> None:
    m = CalibratedCostModel(model, H100, tp=tp)
    seqs = np.array([0, 1, 3, 17, 128, 255])
    ctx = np.array([0, 10, 900, 17 * 513, 128 * 2000, 255 * 77])
    got = m.decode_step_times(seqs, ctx)
    for n, k, t in zip(seqs, ctx, got, strict=True):
        c = StepComposition(num_decode_seqs=int(n), decode_context_tokens=int(k))
        assert m.step_time(c) == t  # bit for bit: skip-ahead lands on the times stepping computes
        if n:
            assert sum(m.breakdown(c).values()) == pytest.approx(t, rel=1e-12)


def test_tp_prices_allreduce_and_cheaper_linears() -> None:
    c = StepComposition(num_prefill_seqs=1, prefill_tokens=512, prefill_attn_pairs=512 * 513 // 2)
    one, two = CalibratedCostModel(LLAMA, H100).breakdown(c), CalibratedCostModel(LLAMA, H100, tp=2).breakdown(c)
    assert one["allreduce"] == 0 and two["allreduce"] > 0
    assert two["linear"] < one["linear"]


def test_small_m_gemms_are_inefficient() -> None:
    m = CalibratedCostModel(LLAMA, H100)
    per_token = [m._linears(float(t)) / t for t in (1, 8, 64, 512, 2048)]
    assert all(a > b for a, b in itertools.pairwise(per_token))


def test_params_are_checked() -> None:
    with pytest.raises(ValueError, match="gemm_eff_max"):
        CalibrationParams(gemm_eff_max=1.5)
    with pytest.raises(ValueError, match="per_seq_s"):
        CalibrationParams(per_seq_s=-1)
    with pytest.raises(ValueError, match="unknown parameters"):
        CalibrationParams.from_dict({"nope": 1})


# --- operator fits recover what made the data -----------------------------------------------------

def test_gemm_fit_recovers_synthetic_parameters() -> None:
    rng = np.random.default_rng(0)
    tokens = np.tile(np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096], float), 4)
    params = np.repeat([16e6, 45e6, 90e6, 200e6], 13)
    io = np.repeat([8192.0, 15000.0, 26000.0, 30000.0], 13)
    t = (4e-6 + gemm_time(tokens, params, io, H100, 0.72, 40.0, 0.83)) * np.exp(rng.normal(0, 0.01, tokens.size))
    pts = OperatorPoints(np.full(tokens.size, "gemm"), tokens, params, io, 0 * tokens, t, np.full(tokens.size, "x"))
    fit = fit_gemm(pts, H100)
    assert fit["gemm_eff_max"] == pytest.approx(0.72, rel=0.05)
    assert fit["gemm_m_half"] == pytest.approx(40.0, rel=0.15)
    assert fit["weight_mem_eff"] == pytest.approx(0.83, rel=0.05)
    assert fit["gemm_latency_s"] == pytest.approx(4e-6, rel=0.25)


def test_allreduce_fit_recovers_synthetic_parameters() -> None:
    import pandas as pd
    size = np.tile(np.geomspace(2048, 64e6, 40), 3)
    n = np.repeat([2, 4, 8], 40)
    t = 12e-6 + size * 2 * (n - 1) / n / (H100.interconnect_bandwidth * 0.7)
    fit = fit_allreduce(pd.DataFrame({"size": size, "num_workers": n, "time_s": t}), H100)
    assert fit["allreduce_latency_s"] == pytest.approx(12e-6, rel=0.02)
    assert fit["allreduce_bus_eff"] == pytest.approx(0.7, rel=0.02)


# --- calibration files ----------------------------------------------------------------------------

def test_save_load_round_trip_and_simconfig(tmp_path) -> None:
    cal = Calibration(CalibrationParams(iteration_overhead_s=1e-3), "h100-sxm", "test", {"fit": {"x": 1}})
    path = save_calibration(cal, tmp_path / "c.json")
    back = load_calibration(path)
    assert back.params == cal.params and back.hardware == "h100-sxm" and back.meta["fit"] == {"x": 1}
    model = build_cost_model(SimConfig(model="llama-7b", hardware="h100-sxm", calibration=str(path)))
    assert isinstance(model, CalibratedCostModel) and model.params.iteration_overhead_s == 1e-3


def test_hardware_mismatch_warns(tmp_path) -> None:
    path = save_calibration(Calibration(CalibrationParams(), "h100-sxm", "test"), tmp_path / "c.json")
    with pytest.warns(UserWarning, match="fitted on h100-sxm.*a100-80gb"):
        build_cost_model(SimConfig(model="llama-7b", hardware="a100-80gb", calibration=str(path)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_cost_model(SimConfig(model="llama-7b", hardware="h100", calibration=str(path)))


def test_bad_calibration_file_names_the_field(tmp_path) -> None:
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"format": "pagesim-calibration", "version": 1, "hardware": "h100-sxm",
                             "params": {"gemm_eff_max": 2}}))
    with pytest.raises(ValueError, match=r"bad\.json.*gemm_eff_max"):
        load_calibration(p)
    with pytest.raises(FileNotFoundError, match="no calibration file"):
        load_calibration(tmp_path / "missing.json")


# --- calibration by simulation in the loop ----------------------------------------------------------

@pytest.mark.slow  # a few seconds: ~100 requests simulated 5 times
@pytest.mark.skipif(not MEASUREMENTS.is_file(), reason="../shared/calibration/vllm-h100/measurements.json not present")
def test_tiny_calibrate_fits_the_client_term_on_a_truncated_stage() -> None:
    from analysis.calibrate import error_table, fit_engine, simulate_all, split_stages
    from analysis.measurement_files import load_measurements

    fit, over = split_stages(load_measurements(MEASUREMENTS))
    assert over and all(r.stage.ttft.mean > 1 or r.exp.overloaded_by_source for r in over)
    ref = [r for r in fit if "llama-2-7b" in r.label][:1]
    start = CalibrationParams(client_ttft_s=1e-4, allreduce_latency_s=3e-5)  # 3e-5: as the NCCL profile gives
    said: list[str] = []
    params = fit_engine(ref, start, "h100-sxm", ["client_ttft_s"], max_duration_s=3.0, max_evals=4, log=said.append)
    # a fit with no stage at tp > 1 takes the engine's all-reduce latency from the link, not the NCCL profile
    assert params.allreduce_latency_s == get_hardware("h100-sxm").interconnect_latency_s != start.allreduce_latency_s
    assert any("the link's on h100-sxm" in line for line in said)
    before = error_table(simulate_all(ref, start, "h100-sxm", 0, 3.0, None))["median_abs_error"]["ttft_mean"]
    after = error_table(simulate_all(ref, params, "h100-sxm", 0, 3.0, None))["median_abs_error"]["ttft_mean"]
    assert params.client_ttft_s > start.client_ttft_s and after < before


@pytest.mark.slow  # one short simulation, then client terms fitted over it without simulating again
@pytest.mark.skipif(not MEASUREMENTS.is_file(), reason="../shared/calibration/vllm-h100/measurements.json not present")
def test_client_terms_are_fitted_over_kept_runs_and_recovered() -> None:
    """Measurements made up from one simulated run seen by a client 6 ms late whose tokens arrive
    1.3 iterations after they are made: fit_client finds both again from other starting values."""
    import dataclasses

    from analysis.calibrate import fit_client, log_errors, simulate_all, split_stages
    from analysis.measurement_files import load_measurements
    from policies.client_latency import ClientTerms

    fit, _ = split_stages(load_measurements(MEASUREMENTS))
    ref = [r for r in fit if "llama-2-7b" in r.label][:1]
    run, = simulate_all(ref, CalibrationParams(), "h100-sxm", 0, 3.0, None)
    truth = run.with_client(ClientTerms(ttft_s=6e-3, output_lag_steps=1.3)).predicted
    made_up = dataclasses.replace(run, measured={k: v for k, v in truth.items() if k in run.measured})
    start = CalibrationParams(client_ttft_s=1e-3, client_output_lag_steps=0.5)
    params, resid = fit_client([made_up], start, ["client_ttft_s", "client_output_lag_steps"])
    assert params.client_ttft_s == pytest.approx(6e-3, rel=0.05)
    assert params.client_output_lag_steps == pytest.approx(1.3, rel=0.05)
    assert np.abs(resid).max() < 0.01 < np.abs(log_errors([made_up.with_client(ClientTerms(1e-3, 0, 0.5))])).max()


def test_shipped_calibration_loads_by_name_and_prices_other_models() -> None:
    cal = load_calibration("vllm-v1-h100")
    assert cal.hardware == "h100-sxm" and cal.meta["fit"]["in_sample"]["median_abs_error"]["tpot"] is not None
    model = build_cost_model(SimConfig(model="llama-3-8b", hardware="h100-sxm", tp=2, calibration="vllm-v1-h100"))
    assert isinstance(model, CalibratedCostModel)
    assert 0 < model.decode_step_time(8, 8000) < 0.1
