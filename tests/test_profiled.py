"""The profiled cost model: fitting, pricing, profile files and their errors, simulation with it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from policies.plan import StepComposition
from sim.cost_registry import make_cost_model
from sim.profiled import (
    FEATURES,
    ProfiledCostModel,
    composition_of,
    fit_measurements,
    load_profile,
    make_profile,
    save_profile,
    shipped_profiles,
)
from sim.run import SimConfig, run_simulation
from traces import resolve_trace

TRUE = {"base": 0.04, "tokens": 1.5e-3, "sampled": 1e-3, "prefill_attn_pairs": 3e-7, "prefill_context_tokens": 2e-5,
        "decode_context_tokens": 4e-6, "swap_blocks": 5e-4, "copy_blocks": 1e-4}


def _grid() -> list[StepComposition]:
    """Compositions varied enough to identify every coefficient (as the profiler's grid does)."""
    out = []
    for b in (1, 4, 16, 32):
        for ctx in (64, 256, 1024):
            out.append(StepComposition(num_decode_seqs=b, decode_context_tokens=b * ctx))
    for b in (1, 4):
        for n in (16, 128, 512):
            for p in (0, 256):
                out.append(StepComposition(num_prefill_seqs=b, prefill_tokens=b * n,
                                           prefill_attn_pairs=b * (n * p + n * (n + 1) // 2),
                                           prefill_context_tokens=b * p))
    for k in (8, 64):
        out.append(StepComposition(num_decode_seqs=8, decode_context_tokens=2048, swap_in_blocks=k, swap_out_blocks=k))
        out.append(StepComposition(num_decode_seqs=8, decode_context_tokens=2048, copy_blocks=k))
    return out


def _measurements(model: ProfiledCostModel, noise: float = 0.0, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    ms = []
    for c in _grid():
        d = c.counts()
        d["time_s"] = model.step_time(c) * float(np.exp(noise * rng.standard_normal()))
        ms.append(d)
    return ms


def _profile(tmp_path, noise: float = 0.02, model_name: str = "smollm2-135m"):
    ms = _measurements(ProfiledCostModel(TRUE), noise)
    p = make_profile(ms, 16, {"model": {"name": model_name}, "device": {"type": "cpu", "name": "test"}})
    return save_profile(p, tmp_path / "p.json")


def test_fit_recovers_the_coefficients_of_noise_free_measurements():
    fit = fit_measurements(_measurements(ProfiledCostModel(TRUE)))
    for k in FEATURES:
        assert fit["coef"][k] == pytest.approx(TRUE.get(k, 0.0), rel=1e-6), k  # grid only: no loop terms
    assert fit["mape"] < 1e-9 and fit["cv_mape"] < 1e-6 and fit["num_points"] == len(_grid())


def test_fit_separates_the_serving_loop_from_the_executor():
    """Served iterations pay a loop cost the grid points do not; the fit finds it, and a simulated
    iteration (a loop iteration) pays it."""
    from sim.profiled import features

    coef = {**TRUE, "loop": 0.006, "loop_seqs": 2e-4}
    vec = np.array([coef.get(k, 0.0) for k in FEATURES])
    grid = _measurements(ProfiledCostModel(TRUE))
    served = [{**m, "time_s": float(np.dot(features(c), vec)), "source": "served", "label": "served"}
              for m, c in zip(grid, _grid())]
    fit = fit_measurements(grid + served)
    for k in FEATURES:
        assert fit["coef"][k] == pytest.approx(coef.get(k, 0.0), rel=1e-6), k
    assert fit["served_mape"] < 1e-9
    model = ProfiledCostModel(fit["coef"])
    c = StepComposition(num_decode_seqs=8, decode_context_tokens=800)
    assert model.step_time(c) == pytest.approx(float(np.dot(features(c, in_loop=True), vec)))
    assert model.step_time(c) > ProfiledCostModel(TRUE).step_time(c)


def test_fit_error_reports_noise_and_held_out_error_is_larger():
    fit = fit_measurements(_measurements(ProfiledCostModel(TRUE), noise=0.05))
    assert 0.01 < fit["mape"] < 0.1
    assert fit["cv_mape"] > fit["mape"]
    assert fit["max_ape"] >= fit["mape"]
    assert all(v >= 0 for v in fit["coef"].values())


def test_fit_leaves_uninformed_coefficients_at_zero():
    ms = [m for m in _measurements(ProfiledCostModel(TRUE)) if not m["swap_in_blocks"] and not m["copy_blocks"]]
    fit = fit_measurements(ms)
    assert fit["coef"]["swap_blocks"] == 0 and fit["coef"]["copy_blocks"] == 0
    assert fit["coef"]["tokens"] == pytest.approx(TRUE["tokens"], rel=1e-6)


def test_pure_decode_prices_agree_bit_for_bit():
    m = ProfiledCostModel(TRUE)
    seqs = np.array([1, 3, 17, 256])
    ctx = np.array([5, 1000, 4321, 99_999])
    vec = m.decode_step_times(seqs, ctx)
    for i in range(len(seqs)):
        c = StepComposition(num_decode_seqs=int(seqs[i]), decode_context_tokens=int(ctx[i]))
        assert m.step_time(c) == vec[i] == m.decode_step_time(int(seqs[i]), int(ctx[i]))
    assert m.step_time(StepComposition()) == 0.0 and m.decode_step_times(np.array([0]), np.array([0]))[0] == 0.0


def _decodes_at(model: ProfiledCostModel, block_sizes: tuple[int, ...]) -> list[dict]:
    """The grid, plus its decode points again at each of `block_sizes` (as --block-sizes times them)."""
    ms = _measurements(model)
    for bs in block_sizes:
        for c in _grid():
            if c.num_decode_seqs and not c.num_prefill_seqs and not c.swap_in_blocks and not c.copy_blocks:
                c = StepComposition(num_decode_seqs=c.num_decode_seqs, decode_context_tokens=c.decode_context_tokens,
                                    block_size=bs)
                ms.append({**c.counts(), "block_size": bs, "time_s": model.step_time(c)})
    return ms


def test_block_term_is_fitted_from_decodes_at_several_block_sizes():
    true = {**TRUE, "decode_blocks": 2e-5}
    fit = fit_measurements(_decodes_at(ProfiledCostModel(true), (4, 64)))
    for k in FEATURES:
        assert fit["coef"][k] == pytest.approx(true.get(k, 0.0), rel=1e-6), k
    m = ProfiledCostModel(fit["coef"], block_size=16, sim_block_size=4)
    # smaller blocks: more of them per context token, each paying the block term
    assert m.decode_step_time(8, 8000) - ProfiledCostModel(fit["coef"]).decode_step_time(8, 8000) == \
        pytest.approx(8000 * 2e-5 * (1 / 4 - 1 / 16))


def test_block_term_stays_zero_at_one_block_size():
    # at one block size blocks and tokens are the same regressor up to scale: the fit must not split
    # them (that would price other block sizes by chance), so the token term takes it all
    true = {**TRUE, "decode_blocks": 2e-5}
    fit = fit_measurements(_measurements(ProfiledCostModel(true)))
    assert fit["coef"]["decode_blocks"] == 0.0
    assert fit["coef"]["decode_context_tokens"] == pytest.approx(TRUE["decode_context_tokens"] + 2e-5 / 16, rel=1e-6)


def test_decode_prices_at_the_simulated_block_size_agree_bit_for_bit():
    m = ProfiledCostModel({**TRUE, "decode_blocks": 3e-5}, block_size=16, sim_block_size=4)
    for seqs, ctx in ((1, 5), (17, 4321), (256, 99_999)):
        c = StepComposition(num_decode_seqs=seqs, decode_context_tokens=ctx, block_size=4)
        assert m.step_time(c) == m.decode_step_time(seqs, ctx) == m.decode_step_times(np.array([seqs]), np.array([ctx]))[0]


def test_transfers_scale_with_block_bytes():
    m = ProfiledCostModel(TRUE, block_size=16)
    assert m.swap_time(10, 16) == pytest.approx(10 * TRUE["swap_blocks"])
    assert m.swap_time(10, 32) == pytest.approx(20 * TRUE["swap_blocks"])
    base = StepComposition(num_decode_seqs=2, decode_context_tokens=100, block_size=32)
    with_swap = StepComposition(num_decode_seqs=2, decode_context_tokens=100, swap_in_blocks=3, block_size=32)
    assert m.step_time(with_swap) - m.step_time(base) == pytest.approx(3 * 2 * TRUE["swap_blocks"])


def test_scaled_model_scales_every_step_and_simulates_that_much_slower():
    m = ProfiledCostModel({**TRUE, "decode_blocks": 3e-5}, block_size=16, sim_block_size=4)
    slow = m.scaled(1.25)
    for c in _grid():
        assert slow.step_time(c) == pytest.approx(1.25 * m.step_time(c), rel=1e-12)
    assert slow.swap_time(8, 32) == pytest.approx(1.25 * m.swap_time(8, 32))
    assert slow.sim_block_size == 4 and "x1.250" in slow.source
    with pytest.raises(ValueError, match="factor"):
        m.scaled(0.0)
    # a decode-only workload that never queues: every request's latency scales with its steps
    trace = resolve_trace("alpaca-like", num_requests=4, rate=0.01, seed=0)
    cfg = SimConfig(model="opt-13b", num_gpu_blocks=512)
    base, scaled = run_simulation(cfg, trace, cost_model=m), run_simulation(cfg, trace, cost_model=slow)
    assert np.allclose(scaled.requests.e2e_latency, 1.25 * base.requests.e2e_latency)


def test_bad_coefficients_are_rejected():
    with pytest.raises(ValueError, match="unknown coefficients"):
        ProfiledCostModel({"warp": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        ProfiledCostModel({"base": -1.0})


def test_profile_file_round_trip_and_registry(tmp_path):
    path = _profile(tmp_path)
    p = load_profile(path)
    assert p["fit"]["num_points"] == len(p["measurements"]) and p["source"] == str(path)
    m = make_cost_model("profiled", profile=str(path))
    assert isinstance(m, ProfiledCostModel)
    c = StepComposition(num_decode_seqs=4, decode_context_tokens=400)
    assert m.step_time(c) == pytest.approx(ProfiledCostModel(TRUE).step_time(c), rel=0.05)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.update(format="other"), "not a pagesim profile"),
    (lambda p: p.update(version=99), "version 99"),
    (lambda p: p.pop("fit"), "missing field 'fit'"),
    (lambda p: p["fit"]["coef"].update(base=-2.0), "fit.coef"),
])
def test_malformed_profile_files_name_the_problem(tmp_path, edit, message):
    p = json.loads(_profile(tmp_path).read_text())
    edit(p)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(p))
    with pytest.raises(ValueError, match=message) as e:
        load_profile(bad)
    assert str(bad) in str(e.value)


def test_not_json_and_unknown_names(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        load_profile(bad)
    with pytest.raises(FileNotFoundError, match="shipped profiles"):
        load_profile("no-such-profile")


def test_bad_measurement_names_its_index_and_field():
    ms = _measurements(ProfiledCostModel(TRUE))
    ms[3]["prefill_tokens"] = -4
    with pytest.raises(ValueError, match=r"measurements\[3\]\.prefill_tokens"):
        fit_measurements(ms)
    ms = _measurements(ProfiledCostModel(TRUE))
    ms[5]["time_s"] = 0
    with pytest.raises(ValueError, match=r"measurements\[5\]\.time_s"):
        fit_measurements(ms)
    with pytest.raises(ValueError, match="empty composition"):
        composition_of({"time_s": 1.0})
    with pytest.raises(ValueError, match="at least"):
        fit_measurements(ms[:3])


def test_simulation_with_a_profiled_model(tmp_path):
    path = _profile(tmp_path)
    trace = resolve_trace("sharegpt-like", num_requests=40, rate=2.0, seed=0)
    cfg = SimConfig(model="smollm2-135m", cost_model="profiled", profile=str(path), num_gpu_blocks=256,
                    num_cpu_blocks=64)
    res = run_simulation(cfg, trace)
    assert res.summary["num_finished"] + res.summary["num_rejected"] == 40
    assert res.summary["num_cpu_blocks"] == 64
    it = res.iterations
    model = ProfiledCostModel.from_profile(str(path))
    row = it[(it.prefill_tokens == 0) & (it.num_seqs > 0)].iloc[0]
    assert row.duration == model.decode_step_time(int(row.decode_tokens), int(row.context_tokens))


def test_profiled_simulation_refuses_another_model_or_tp(tmp_path):
    path = _profile(tmp_path)
    trace = resolve_trace("fixed", num_requests=2, rate=1.0, seed=0)
    with pytest.raises(ValueError, match="measured on model 'smollm2-135m', not 'opt-13b'"):
        run_simulation(SimConfig(model="opt-13b", cost_model="profiled", profile=str(path)), trace)
    with pytest.raises(ValueError, match="tp"):
        run_simulation(SimConfig(model="smollm2-135m", tp=2, cost_model="profiled", profile=str(path)), trace)
    with pytest.raises(ValueError, match="needs a profile"):
        run_simulation(SimConfig(model="smollm2-135m", cost_model="profiled"), trace)
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        run_simulation(SimConfig(model="smollm2-135m", cost_model="profiled", profile=str(path)), trace)


@pytest.mark.parametrize("name", shipped_profiles())
def test_shipped_profiles_load_and_their_fit_is_reproducible(name):
    p = load_profile(name)
    refit = fit_measurements(p["measurements"])
    for k in FEATURES:
        assert refit["coef"][k] == pytest.approx(p["fit"]["coef"].get(k, 0.0), rel=1e-6, abs=1e-15), k
    assert refit["cv_mape"] == pytest.approx(p["fit"]["cv_mape"], rel=1e-6)
