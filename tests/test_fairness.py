"""Fairness across clients (policies.metrics.per_client): Jain's index over the service clients
receive while they compete (both backlogged), so that it tells policies apart where totals cannot."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from policies.metrics import backlog_in_windows, per_client, service_in_windows
from sim.run import SimConfig, run_simulation
from traces.arrivals import rescale
from traces.clients import multi_client


def _rows(*reqs: tuple) -> pd.DataFrame:
    """(client, arrival, first_scheduled, first_token, finish, prompt, output) per request, finished."""
    cols = ["client", "arrival", "first_scheduled", "first_token_time", "finish_time", "prompt_len", "output_len"]
    df = pd.DataFrame(list(reqs), columns=cols)
    return df.assign(status="finished", ttft=df.first_token_time - df.arrival, tpot=np.nan,
                     e2e_latency=df.finish_time - df.arrival, slo_ttft=np.nan, slo_tpot=np.nan)


def test_service_lands_where_it_was_given() -> None:
    done = _rows(("a", 0.0, 0.0, 0.0, 10.0, 4, 10), ("b", 0.0, 5.0, 5.0, 5.0, 2, 1))
    got = service_in_windows(done, np.array([0.0, 5.0, 10.0]))
    # a: prompt 4 at t=0, output 2*10 spread over [0, 10); b: prompt 2 and output 2 at t=5
    assert got.loc[0, "a"] == pytest.approx(4 + 10) and got.loc[1, "a"] == pytest.approx(10)
    assert got.loc[0, "b"] == 0 and got.loc[1, "b"] == pytest.approx(2 + 2)
    waits = backlog_in_windows(done, np.array([0.0, 5.0, 10.0]))
    assert not waits.loc[0, "a"] and waits.loc[0, "b"] and not waits.loc[1, "b"]


def test_jain_over_competing_clients() -> None:
    # both clients wait through [0, 10) (their second requests start late); a gets 3x b's service there
    table = _rows(("a", 0.0, 0.0, 0.0, 10.0, 0, 15), ("a", 0.0, 10.0, 10.0, 20.0, 0, 1),
                  ("b", 0.0, 0.0, 0.0, 10.0, 0, 5), ("b", 0.0, 10.0, 10.0, 20.0, 0, 1))
    _, fairness = per_client(table, windows=2)
    assert fairness["jain_service"] == pytest.approx((30 + 10) ** 2 / (2 * (30 ** 2 + 10 ** 2)))  # 0.8
    assert fairness["max_service_gap"] == pytest.approx(20)
    _, alone = per_client(table[table.client == "a"].assign(client="a"), windows=2)
    assert np.isnan(alone["jain_service"])  # one client: nothing to be fair between


def test_fair_share_policy_is_fairer_than_fcfs_under_overload() -> None:
    trace = multi_client(300, seed=0)
    trace = trace.with_arrivals(rescale(trace.arrival, 6.0))  # well past what the cache holds
    jain = {p: per_client(run_simulation(SimConfig(policy=p), trace).requests)[1]["jain_service"]
            for p in ("vllm", "vtc")}
    assert jain["vtc"] > jain["vllm"] + 0.05, jain  # 0.79 against 0.69
