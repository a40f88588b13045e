"""vLLM data parallelism with expert parallelism (sim/dp.py, --dp N --ep): per-rank KV caches, lockstep
iterations of an MoE model's ranks, the all-to-all priced from the interconnect, vLLM's DP balancer."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from policies.dp_router import VllmDPRouter
from sim.calibrated import load_calibration
from sim.cost_model import RooflineCostModel
from sim.run import SimConfig, build_cost_model, run_simulation
from sim.specs import get_hardware, get_model, kv_capacity_blocks
from traces import resolve_trace

MOE = Path(__file__).resolve().parents[2] / "shared" / "models" / "qwen3-30b-a3b.json"
needs_moe = pytest.mark.skipif(not MOE.is_file(), reason="the MoE config.json in ../shared/models is not here")


def _trace(n: int = 80, rate: float = 8.0):
    return resolve_trace("sharegpt-like", num_requests=n, rate=rate, seed=1)


def test_a_dense_model_refuses_expert_parallelism() -> None:
    with pytest.raises(ValueError, match=r"ep \(--ep\): .* dense model"):
        SimConfig(model="llama-3-8b", hardware="h100-sxm", ep=True)


@pytest.mark.parametrize("kw, flag", [({"dp": 0}, "--dp"), ({"dp": 2, "replicas": 2}, "--replicas"),
                                      ({"dp": 2, "disaggregate": (1, 1)}, "--disaggregate"),
                                      ({"ep": "yes"}, "--ep")])
def test_bad_combinations_are_one_line_errors_naming_the_flag(kw: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag) as e:
        SimConfig(model="llama-3-8b", hardware="h100-sxm", **kw)
    assert "\n" not in str(e.value)


def test_the_balancer_picks_the_fewest_waiting_times_four_plus_running() -> None:
    """vLLM's DPLBAsyncMPClient: score waiting * 4 + running, ties to the lowest rank."""
    def rank(waiting: int, running: int) -> SimpleNamespace:  # what the router reads of a scheduler
        return SimpleNamespace(waiting=[object()] * waiting, running=[object()] * running, swapped=[])
    router = VllmDPRouter()
    assert router.route(None, [rank(1, 0), rank(0, 3)]) == 1   # 4 against 3
    assert router.route(None, [rank(1, 0), rank(0, 5)]) == 0   # 4 against 5
    assert router.route(None, [rank(0, 2), rank(0, 2)]) == 0   # a tie: the lowest rank


@needs_moe
def test_dp2_ep_gives_each_rank_its_own_cache_and_steps_the_ranks_in_lockstep() -> None:
    model, hw = get_model(str(MOE)), get_hardware("h100-sxm")
    one = run_simulation(SimConfig(model=str(MOE), hardware="h100-sxm"), _trace())
    res = run_simulation(SimConfig(model=str(MOE), hardware="h100-sxm", dp=2, ep=True), _trace())
    # each rank holds all of attention but half of the experts: a larger cache than one whole copy's
    assert res.summary["num_gpu_blocks"] == kv_capacity_blocks(model, hw, 16, 1, 0.9, expert_shards=2)
    assert res.summary["num_gpu_blocks"] > one.summary["num_gpu_blocks"]
    assert [r["num_gpu_blocks"] for r in res.summary["router"]["replicas"]] == [res.summary["num_gpu_blocks"]] * 2
    assert set(res.requests.replica) == {0, 1} and res.summary["router"]["name"] == "vllm-dp"
    assert res.summary["dp"]["ranks"] == 2 and res.summary["dp"]["expert_parallel_size"] == 2
    group = res.extra["dp_group"]
    # lockstep: one duration per iteration for all ranks, at least each rank's own part plus the MoE layers
    assert (group.groupby("iteration").duration.nunique() == 1).all()
    assert (group.duration >= group.own_s + group.moe_s).all() and (group.moe_s > 0).all()
    assert (group.groupby("iteration").duration.first()
            == group.groupby("iteration").own_s.max() + group.groupby("iteration").moe_s.first()).all()
    assert group.dummy.any()  # an idle rank runs a dummy batch while the other works
    cost = build_cost_model(SimConfig(model=str(MOE), hardware="h100-sxm", dp=2, ep=True))
    assert (group.own_s[group.dummy] == cost.decode_step_time(1, 1)).all()
    # the ranks' own iteration logs carry the lockstep duration, starting at the group's instants
    its = res.iterations
    merged = its.merge(group[~group.dummy], left_on=["replica", "start"], right_on=["rank", "start"])
    assert len(merged) == len(its) and (merged.duration_x == merged.duration_y).all()
    assert (res.requests.status == "finished").all()


@needs_moe
@pytest.mark.parametrize("calibrated", [False, True])
def test_the_all_to_all_is_priced_from_the_interconnect(calibrated: bool) -> None:
    """moe_group_time = experts + dispatch and combine; a slower link makes it dearer, one rank has none."""
    model, hw = get_model(str(MOE)), get_hardware("h100-sxm")
    slow = dataclasses.replace(hw, interconnect_bandwidth=hw.interconnect_bandwidth / 4)

    def make(h, dp):
        if calibrated:
            return load_calibration("vllm-v1-h100").cost_model(model, h, tp=1, ep=dp, dp=dp)
        return RooflineCostModel(model, h, tp=1, ep=dp, dp=dp)

    fast, dear = make(hw, 2).moe_group_time(256), make(slow, 2).moe_group_time(256)
    assert dear > fast > 0
    assert make(hw, 1).moe_group_time(256) is None  # no group: step_time prices the experts itself


@needs_moe
def test_dp1_prices_and_runs_as_before() -> None:
    """dp 1 without --ep: the cost model built as before (tp only) and the run's tables unchanged."""
    cfg = SimConfig(model=str(MOE), hardware="h100-sxm")
    before = RooflineCostModel(get_model(str(MOE)), get_hardware("h100-sxm"), tp=1)
    a, b = run_simulation(cfg, _trace(40)), run_simulation(cfg, _trace(40), before)
    pd.testing.assert_frame_equal(a.requests, b.requests)
    pd.testing.assert_frame_equal(a.iterations, b.iterations)
    assert "dp" not in a.summary and not a.extra
    # the config echoed in summary.json names dp and ep only when set: a single server's reads as before
    assert not {"dp", "ep"} & set(a.summary["config"])
    assert SimConfig(model=str(MOE), hardware="h100-sxm", dp=2, ep=True).to_dict()["dp"] == 2


def test_a_dense_models_dp_ranks_are_independent_replicas() -> None:
    res = run_simulation(SimConfig(model="llama-3-8b", hardware="h100-sxm", dp=2), _trace(60))
    assert res.summary["dp"]["lockstep"] is False and "dp_group" not in res.extra
    assert res.summary["router"]["name"] == "vllm-dp" and set(res.requests.replica) == {0, 1}
