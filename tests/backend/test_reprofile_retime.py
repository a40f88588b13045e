"""backend.profiler.retime: a profile's own grid timed again on this machine (issue 15)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # a profile of the tiny model, timed twice: ~30 s on a busy 2-core machine

from analysis.reprofile import check_and_reprofile
from backend.config import ModelConfig
from backend.model_runner import ModelRunner
from backend.profiler import ProfileGrid, environment, profile_model, retime
from backend.weights import random_weights
from sim.profiled import make_profile

TINY = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                   intermediate_size=64, vocab_size=512, max_position=512, name="tiny")


def _runner(num_gpu_blocks: int = 8) -> ModelRunner:
    return ModelRunner(TINY, random_weights(TINY, seed=0), "cpu", num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=2, attention="torch",
                       block_size=16)


@pytest.fixture(scope="module")
def profiled():
    """A quick-grid profile of the tiny model with decodes also at block size 8, its times made
    100x slower than this machine (a profile from a slower machine)."""
    grid = dataclasses.replace(ProfileGrid.quick(), block_sizes=(8,), reps=1)
    g, c = grid.blocks_needed(16)
    runner = ModelRunner(TINY, random_weights(TINY, seed=0), "cpu", num_gpu_blocks=g, num_cpu_blocks=c, block_size=16,
                         attention="torch")  # eager: no compile per shape
    ms = [{**m, "time_s": m["time_s"] * 100} for m in profile_model(runner, grid).measurements]
    return grid, make_profile(ms, 16, environment(runner, "tiny"))


def test_retime_times_the_profiles_own_points_and_carries_the_other_block_sizes(profiled):
    grid, profile = profiled
    small = _runner()  # its cache is too small for the grid: retime brings its own
    again = retime(small, profile["measurements"], 16, reps=1, grid=grid)
    own = [m for m in profile["measurements"] if m.get("source", "grid") == "grid" and m.get("block_size") == 16]
    assert again.retimed == len(own) == len(grid.points()) and again.carried == len(grid.decode_points())
    assert again.served > 0 and not again.skipped and small.num_gpu_blocks == 8
    assert 0 < again.speed < 0.5  # this machine runs the points far faster than the 100x profile
    old = {(m["label"], m.get("block_size")): m for m in profile["measurements"] if m.get("source") != "served"}
    for m in again.measurements:
        if "scaled_by" in m:  # carried over: the old time at the measured speed
            assert m["block_size"] == 8 and m["time_s"] == pytest.approx(old[m["label"], 8]["time_s"] * again.speed)
    new = make_profile(again.measurements, 16, {"model": {"name": "tiny"}})
    assert new["fit"]["coef"]["decode_blocks"] >= 0 and new["fit"]["num_points"] == len(again.measurements)


def test_check_and_reprofile_on_a_drifted_machine(profiled, tmp_path, monkeypatch):
    """The speed check finds the 100x-slow profile far off and re-fits; the decision is recorded."""
    import backend.profiler as profiler

    grid, profile = profiled
    monkeypatch.setattr(profiler, "ProfileGrid", lambda: grid)  # retime's and drift's default grid: the quick one
    real = profiler.drift
    monkeypatch.setattr(profiler, "drift", lambda runner, ms, **kw: real(runner, ms, labels=("decode b=4 ctx=48",), **kw))
    d = check_and_reprofile(_runner(64), "tiny-slow", {**profile, "source": "tiny-slow"}, 0.1, tmp_path / "p.json",
                            reps=1)
    assert d.speed is not None and d.speed < 0.5 and d.reprofiled
    if d.cv_mape is None:  # the re-fit raised: the given profile is kept, and the reason says so
        assert not d.adopted and "re-fit failed" in d.reason
    else:
        # the rule since 2026-12-01: the re-fit is judged against the given profile's error on this
        # machine's own timings (its own held-out error elsewhere says nothing about this machine)
        assert d.given_error_here is not None and d.adopted == (d.cv_mape <= d.given_error_here)
    assert (tmp_path / "p.json").is_file() == d.adopted
