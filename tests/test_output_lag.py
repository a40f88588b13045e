"""The emulated engine's output lag (backend/async_engine.py, `output_lag_steps` = n + f): a step's
outputs go out at end(i + n) + f * duration(i + n + 1), the times policies.client_latency.lagged_times
gives `pagesim simulate`'s client latencies, never before, and at once when the engine goes idle.
Exact times come from a clock that moves only when the engine waits (whatever the machine's load);
one test runs the real PacedClock."""

from __future__ import annotations

import argparse
import math
import threading

import numpy as np
import pytest

from policies.client_latency import lagged_times
from policies.replica_config import build_replica
from policies.request import Request, SamplingParams
from policies.trace_requests import requests_from_trace
from sim.emulated import EmulatedExecutor, PacedClock
from sim.run import SimConfig, build_cost_model, run_simulation
from sim.specs import get_model
from tests.test_emulate import _trace

pytest.importorskip("starlette")
CFG = SimConfig(model="llama-7b", hardware="h100-sxm", calibration="vllm-v1-h100", max_num_seqs=8,
                max_num_batched_tokens=512, num_gpu_blocks=40, prefix_caching=True)
CALIBRATED_LAG = build_cost_model(CFG).client_terms().output_lag_steps  # 1.28 steps


class VirtualClock(PacedClock):
    """Engine time that moves only when the engine waits for it (or the test moves it while the
    engine is idle): release times are exact, whatever the machine's load."""

    def __init__(self) -> None:
        super().__init__(time_scale=1.0)
        self.t = 0.0

    def start(self) -> None:
        super().start()
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def until(self, t: float) -> float:
        self.t = max(self.t, t)
        return 0.0


class Served:
    """An emulated engine and every output it delivered, with the engine time of its delivery."""

    def __init__(self, clock: PacedClock, lag: float) -> None:
        from backend.async_engine import AsyncEngine

        executor = EmulatedExecutor(build_cost_model(CFG), list(range(500, 600)), seed=CFG.seed)
        self.clock = clock
        self.engine = AsyncEngine(build_replica(CFG.replica(), executor), clock=clock, output_lag_steps=lag)
        self.seen: dict[int, list[tuple[float, object]]] = {}  # request id -> [(delivered at, RequestOutput)]
        self.on_output = None  # called on the engine thread with each output, after it is recorded
        self._ended = 0
        self._expected = 0
        self._all_ended = threading.Event()

    def submit(self, requests: list[Request]) -> None:
        from backend.async_engine import EngineRequest

        self._all_ended.clear()
        self._expected += len(requests)
        for r in requests:
            self.engine.submit(EngineRequest(r, self._sink))

    def _sink(self, out) -> None:
        self.seen.setdefault(out.request_id, []).append((self.clock.now(), out))
        if self.on_output is not None:
            self.on_output(out)
        if out.finished:
            self._ended += 1
            if self._ended == self._expected:
                self._all_ended.set()

    def wait_all_ended(self) -> None:
        """Every request submitted so far got its last output while the engine kept running: none
        was left held once the engine went idle."""
        assert self._all_ended.wait(60), "outputs still held with the engine idle"

    def delivered(self, request_ids) -> tuple[np.ndarray, np.ndarray]:
        """(first token, last output) delivery times of these requests."""
        first = [next(t for t, o in self.seen[i] if o.new_tokens) for i in request_ids]
        last = [self.seen[i][-1][0] for i in request_ids]
        return np.array(first), np.array(last)


def _wave(start_id: int, n: int, arrival: float, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(100, 30000, 48).tolist()  # a common prefix: prefix caching has hits to find
    out = []
    for i in range(start_id, start_id + n):
        ids = shared + rng.integers(100, 30000, int(rng.integers(20, 200))).tolist()
        sp = SamplingParams(max_tokens=int(rng.integers(5, 50)), ignore_eos=True)
        out.append(Request(i, arrival, len(ids), sp, prompt_token_ids=ids))
    return out


@pytest.mark.parametrize("lag", [0.0, 0.5, CALIBRATED_LAG, 2.0])
def test_outputs_go_out_at_their_lagged_times_and_nothing_is_held_once_idle(lag):
    """Two waves with the engine idle between them: every request's first token and last output are
    delivered exactly at lagged_times over the engine's own iterations (lag 0: when produced), the
    first wave's all before the second arrives."""
    served = Served(VirtualClock(), lag)
    served.submit(_wave(0, 10, 0.0, seed=1))
    served.engine.start()
    served.wait_all_ended()
    idle_from = served.clock.t
    served.clock.t += 0.5  # half a second idle
    served.submit(_wave(10, 10, served.clock.t, seed=2))
    served.wait_all_ended()
    served.engine.stop(drain=True, timeout=60)
    assert served.engine.error is None
    req, its = served.engine.tables()
    first, last = served.delivered(req.request_id)
    produced_first, produced_last = req.first_token_time.to_numpy(), req.finish_time.to_numpy()
    np.testing.assert_allclose(first, lagged_times(produced_first, its, lag), rtol=0, atol=1e-9)
    np.testing.assert_allclose(last, lagged_times(produced_last, its, lag), rtol=0, atol=1e-9)
    ends = (its.start + its.duration).to_numpy()
    if lag == 0:
        np.testing.assert_array_equal(first, produced_first)
        np.testing.assert_array_equal(last, produced_last)
    else:
        assert (first > produced_first).any() and (last > produced_last).any()
    if lag % 1:  # the fraction: delivered part-way through a step, not at a step's end
        assert not np.isin(first, ends).all()
    wave1 = (req.request_id < 10).to_numpy()
    assert last[wave1].max() == ends[its.start < idle_from].max() == idle_from  # at the last step's end


def test_an_aborted_request_gets_its_held_outputs_first_and_the_others_keep_their_lag():
    served = Served(VirtualClock(), 1.5)
    aborted = []

    def abort_one(out) -> None:  # request 0's first delivery aborts request 3 (on the engine thread)
        if out.request_id == 0 and not aborted:
            aborted.append(3)
            served.engine.abort(3)

    served.on_output = abort_one
    served.submit(_wave(0, 8, 0.0, seed=4))
    served.engine.start()
    served.wait_all_ended()
    served.engine.stop(drain=True, timeout=60)
    outs = [o for _, o in served.seen[3]]
    assert outs[-1].aborted and outs[-1].finished and not any(o.finished for o in outs[:-1])
    req, its = served.engine.tables()
    kept = req[req.status == "finished"]
    assert 3 not in set(kept.request_id) and len(kept) == 7
    first, last = served.delivered(kept.request_id)
    np.testing.assert_allclose(first, lagged_times(kept.first_token_time.to_numpy(), its, 1.5), atol=1e-9)
    np.testing.assert_allclose(last, lagged_times(kept.finish_time.to_numpy(), its, 1.5), atol=1e-9)


def test_real_time_releases_are_never_early_and_hold_the_fraction():
    """The real PacedClock: no first token or last output goes out before its lagged time, and the
    median one within a quarter of a step of it (a hold rounded up to 2 steps would be half a step
    late on every one). At a quarter of real time a ~6 ms step lasts ~25 ms of wall time, so this
    machine's wake-up jitter under a parallel test run (1-2 ms wall) stays well inside that."""
    clock = PacedClock(time_scale=0.25)
    served = Served(clock, 1.5)
    served.submit(_wave(0, 10, 0.0, seed=5))
    served.engine.start()
    served.wait_all_ended()
    served.engine.stop(drain=True, timeout=60)
    req, its = served.engine.tables()
    first, last = served.delivered(req.request_id)
    planned = np.concatenate([lagged_times(req.first_token_time.to_numpy(), its, 1.5),
                              lagged_times(req.finish_time.to_numpy(), its, 1.5)])
    late = np.concatenate([first, last]) - planned
    assert late.min() >= -1e-9
    assert np.median(late) < 0.25 * its.duration.median()


def test_emulated_client_latencies_are_simulates():
    """The calibration's client terms through the emulated engine (the frontend delay before a call
    reaches the engine, the output lag of 1.28 steps unrounded, as `pagesim serve --emulate` takes
    them by default) give `pagesim simulate`'s client TTFT and E2E, request by request."""
    from pagesim.emulate import _client_terms

    cost = build_cost_model(CFG)
    terms = cost.client_terms()
    frontend, lag = _client_terms(argparse.Namespace(frontend_delay=None, output_lag_steps=None), cost)
    assert (frontend, lag) == (terms.ttft_s, terms.output_lag_steps) and lag % 1 > 0.2
    # the requests on which the emulated engine's iterations are the simulator's (tests/test_emulate.py; on
    # some others a recompute's prefix hits differ by a block: the emulator's token ids are not the simulator's)
    trace = _trace()
    served = Served(VirtualClock(), lag)
    served.submit(requests_from_trace(trace, get_model(CFG.model).max_position))
    served.engine.start()
    served.wait_all_ended()
    served.engine.stop(drain=True, timeout=60)
    sim = run_simulation(CFG, trace).requests.set_index("request_id").sort_index()
    first, last = served.delivered(sim.index)
    arrival = sim.arrival.to_numpy()
    np.testing.assert_allclose(first - arrival + frontend, sim.client_ttft, rtol=1e-9)
    np.testing.assert_allclose(last - arrival + frontend, sim.client_e2e_latency, rtol=1e-9)
    assert terms.per_output_token_s == 0  # (the emulator adds none per token)


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "one"])
def test_bad_output_lag_is_one_line_naming_the_flag(capsys, value):
    from pagesim.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--emulate", "--model", "llama-7b", "--hardware", "h100-sxm", "--calibration", "vllm-v1-h100",
              "--output-lag-steps", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--output-lag-steps" in err[-1]


@pytest.mark.parametrize("value", [-0.5, math.inf, math.nan])
def test_engine_refuses_a_bad_output_lag(value):
    from backend.async_engine import AsyncEngine

    executor = EmulatedExecutor(build_cost_model(CFG), [1, 2, 3])
    with pytest.raises(ValueError, match="--output-lag-steps"):
        AsyncEngine(build_replica(CFG.replica(), executor), output_lag_steps=value)
