"""sim.engine.Replica's `on_finish` hook (disaggregated serving hands a prefill replica's finished
groups on with it) sees every group the replica finishes, once, at the time it finishes, whether
its last iteration was stepped or applied in a skip-ahead window or decode step."""

from __future__ import annotations

import simpy

from policies.trace_requests import requests_from_trace
from sim.cluster import run_replicas, sim_replica
from sim.engine import ArrivalFeed, Replica
from sim.run import SimConfig, build_cost_model
from traces import resolve_trace


def _run(policy: str, fast_forward: bool) -> tuple[Replica, list[tuple[int, float, float]]]:
    cfg = SimConfig(policy=policy, num_gpu_blocks=300, max_num_seqs=24)
    trace = resolve_trace("multi-client", num_requests=150, rate=12.0, seed=4)
    env = simpy.Environment()
    config = cfg.replica()
    seen: list[tuple[int, float, float]] = []  # (group id, its finish time, the clock at the call)

    def on_finish(groups: list) -> None:
        seen.extend((g.group_id, g.finish_time, env.now) for g in groups)

    feed = ArrivalFeed(requests_from_trace(trace, config.max_model_len, cfg.n, cfg.beam_width))
    replica = sim_replica(env, config, build_cost_model(cfg), cfg.seed, fast_forward=fast_forward,
                          on_finish=on_finish)
    run_replicas(env, feed, [replica], None)
    return replica, seen


def test_on_finish_sees_the_finishes_of_windows_and_decode_steps_as_stepping_does() -> None:
    for policy in ("vllm", "vtc"):
        skipping, seen = _run(policy, fast_forward=True)
        stepped, want = _run(policy, fast_forward=False)
        assert skipping.windows > 0 and skipping.stepped < stepped.stepped  # windows ran
        served = sorted(g.group_id for g in skipping.scheduler.done if g.rejected is None)
        assert served and sorted(gid for gid, _, _ in seen) == served  # each finished group, once
        assert all(finish == now for _, finish, now in seen)  # told at its finish, not before
        assert sorted(seen) == sorted(want)
