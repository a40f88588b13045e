"""Re-profiling where the user runs (issue 15): the decision, its message, and what validate records
(timing stubbed; no model needed)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from analysis.reprofile import ReprofileDecision, decide, needs_reprofile
from analysis.validate import run_validation
from pagesim.report_writer import write_run
from sim.profiled import ProfiledCostModel, load_profile, save_profile
from sim.run import SimConfig, run_simulation
from traces import resolve_trace

SHIPPED = "smollm2-135m-cpu"


def _refit(factor: float, cv_mape: float = 0.05):
    """A stand-in for the re-fit: the shipped profile's points timed `factor` times slower, every
    coefficient `factor` times larger."""
    def refit() -> dict:
        p = load_profile(SHIPPED)
        p["measurements"] = [{**m, "time_s": m["time_s"] * factor} for m in p["measurements"]]
        p["fit"] = {**p["fit"], "coef": {k: v * factor for k, v in p["fit"]["coef"].items()}, "cv_mape": cv_mape}
        return p
    return refit


def _never():
    raise AssertionError("re-profiled without cause")


@pytest.mark.parametrize("speed,threshold,expected", [
    (1.8, 0.1, True), (0.85, 0.1, True), (1.09, 0.1, False), (0.95, 0.1, False), (1.8, None, False),
    (None, 0.1, False), (1.3, 0.5, False)])
def test_the_decision_is_the_speed_against_the_threshold(speed, threshold, expected):
    assert needs_reprofile(speed, threshold) is expected


def test_a_drifted_machine_is_re_profiled_and_the_new_profile_used(tmp_path):
    given = load_profile(SHIPPED)
    out = tmp_path / "profile.json"
    d = decide(SHIPPED, given, 1.8, 0.1, _refit(1.8, cv_mape=0.05), out, save=save_profile)
    assert d.reprofiled and d.adopted and d.path == str(out) and out.is_file()
    assert d.profile["fit"]["coef"]["base"] == pytest.approx(1.8 * given["fit"]["coef"]["base"])
    msg = d.message()
    assert msg.startswith("re-profiled:") and "1.80x" in msg and "more than 10% away" in msg and str(out) in msg
    rec = d.record()
    assert rec["speed"] == 1.8 and rec["adopted"] and rec["profile"] == str(out) and rec["given_profile"] == SHIPPED
    assert rec["cv_mape"] == 0.05 and rec["given_cv_mape"] == given["fit"]["cv_mape"]
    # the given profile judged on the slower machine's timings: off by about 1 - 1/1.8
    assert rec["given_error_here"] == pytest.approx(1 - 1 / 1.8, abs=0.05)


def test_the_given_profile_is_judged_on_this_machines_timings_not_its_own(tmp_path):
    """A re-fit whose held-out error (12%) is above the given profile's own (where it was measured)
    but below the given profile's error here (1.5x slower: ~33%) is adopted."""
    given = load_profile(SHIPPED)
    assert given["fit"]["cv_mape"] < 0.12
    d = decide(SHIPPED, given, 1.5, 0.1, _refit(1.5, cv_mape=0.12), tmp_path / "p.json", save=save_profile)
    assert d.adopted and d.given_error_here == pytest.approx(1 - 1 / 1.5, abs=0.05)


def test_within_the_threshold_or_with_no_reprofile_nothing_is_re_measured(tmp_path):
    given = load_profile(SHIPPED)
    for speed, threshold in ((1.09, 0.1), (0.92, 0.1), (3.0, None)):
        d = decide(SHIPPED, given, speed, threshold, _never, tmp_path / "p.json")
        assert not d.reprofiled and not d.adopted and d.profile is given and d.message() is None
    assert not (tmp_path / "p.json").exists()


def test_a_worse_or_failed_re_fit_keeps_the_given_profile_and_says_so(tmp_path):
    given = load_profile(SHIPPED)
    worse = decide(SHIPPED, given, 1.5, 0.1, _refit(1.5, cv_mape=0.5), tmp_path / "w.json", save=save_profile)
    assert worse.reprofiled and not worse.adopted and worse.profile is given and not (tmp_path / "w.json").exists()
    assert "kept smollm2-135m-cpu" in worse.message() and "worse" in worse.message()

    def broken() -> dict:
        raise ValueError("need at least 11 measurements to fit, got 3")
    failed = decide(SHIPPED, given, 1.5, 0.1, broken, tmp_path / "f.json")
    assert not failed.adopted and "failed" in failed.reason and "11 measurements" in failed.message()


def _fake_live(tmp_path, trace, cfg, factor: float):
    """A 'live' run: the simulation at `factor` times the shipped profile's step times."""
    cost = ProfiledCostModel.from_profile(SHIPPED, sim_block_size=cfg.block_size).scaled(factor)
    r = run_simulation(cfg, trace, cost_model=cost)
    return r.requests


@pytest.fixture
def workload():
    trace = resolve_trace("sharegpt-like", num_requests=12, rate=2.0, seed=0)
    cfg = SimConfig(model="smollm2-135m", block_size=16, num_gpu_blocks=256, cost_model="profiled", profile=SHIPPED)
    return trace, cfg


def test_validate_records_the_re_profile_and_compares_both_profiles(tmp_path, workload, monkeypatch, capsys):
    """run_validation with the live side stubbed: a machine 1.8x slower, re-profiled into a profile
    1.8x slower. validation.json names the profile used and the speed; the given profile's error is
    kept beside it, larger."""
    import analysis.validate as validate

    trace, cfg = workload
    out = tmp_path / "val"
    live = _fake_live(tmp_path, trace, cfg, 1.8)

    def fake_serve(trace, cfg, live_opts, out, decision, reps, progress, config, write_run):
        d = decide(decision.given, decision.profile, 1.8, decision.threshold, _refit(1.8), out / "profile.json",
                   save=save_profile)
        print(d.message())
        write_run(out / "live", live, pd.DataFrame(), {"mode": "live", "reprofile": d.record()})  # as _serve does
        return live, {"before": 1.0, "after": 1.0}, d

    monkeypatch.setattr(validate, "_serve", fake_serve)
    v = run_validation(trace, cfg, out, live=None, reprofile_threshold=0.1, write_run=write_run)
    s = json.loads((out / "validation.json").read_text())
    assert s["profile"] == str(out / "profile.json") and s["given_profile"] == SHIPPED
    assert s["reprofile"]["speed"] == 1.8 and s["reprofile"]["adopted"] and s["reprofile"]["threshold"] == 0.1
    assert s["mape"] < 0.01 < s["given_profile_validation"]["mape"]  # the slower profile matches the slower machine
    assert (out / "validation_given_profile.csv").is_file() and v.given is not None
    assert "re-profiled:" in capsys.readouterr().out
    # reusing that live run: the profile re-fitted with it is used again, the comparison is the same
    again = run_validation(trace, cfg, tmp_path / "again", live_run=str(out / "live"), write_run=write_run)
    assert again.table.equals(v.table) and again.reprofile.path == str(out / "profile.json")
    # ... unless re-profiling is off: the given profile, as it is
    off = run_validation(trace, cfg, tmp_path / "off", live_run=str(out / "live"), reprofile_threshold=None,
                         write_run=write_run)
    assert off.reprofile.path.endswith("smollm2-135m-cpu.json") and off.table.equals(v.given)
    assert json.loads((tmp_path / "off" / "validation.json").read_text())["reprofile"]["reprofiled"] is False


def test_decision_record_without_a_speed():
    d = ReprofileDecision(SHIPPED, None, None, {"fit": {}}, "x.json")
    assert d.record()["speed"] is None and d.record()["threshold"] is None and d.message() is None
