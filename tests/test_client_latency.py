"""Client-side latencies in every run (policies/client_latency.py): a cost model's client terms are
applied once where the request table is made; SLOs, goodput and studies judge by them."""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
import pytest

from analysis.report import summary_table
from analysis.sweep import headline
from pagesim.cli_args import study_title
from policies.client_latency import CLIENT_COLUMNS, ClientTerms, lagged_times
from policies.metrics import latency_basis
from sim.cost_model import ConstantCostModel
from sim.run import SimConfig, run_simulation
from traces import resolve_trace

TERMS = ClientTerms(ttft_s=0.02, per_output_token_s=0.001, output_lag_steps=1.0)


class _Measured(ConstantCostModel):
    """A hand-set model whose client sees TERMS."""

    def client_terms(self) -> ClientTerms:
        return TERMS


def _cost(with_client: bool) -> ConstantCostModel:
    cls = _Measured if with_client else ConstantCostModel
    return cls(prefill_per_token=2e-5, decode_per_seq=1e-4, base=5e-3)


def _trace(n: int = 60):
    return resolve_trace("sharegpt-like", num_requests=n, rate=6.0, seed=3)


def test_a_model_without_client_terms_leaves_the_tables_as_they_were() -> None:
    res = run_simulation(SimConfig(model="llama-3-8b", hardware="a100-80gb", slo_ttft=0.05), _trace(), _cost(False))
    assert not set(CLIENT_COLUMNS) & set(res.requests.columns)
    assert "client_ttft" not in res.summary and "latency_basis" not in res.summary and latency_basis(res.summary) == "server"


def test_client_columns_are_the_server_times_lagged_and_added_to() -> None:
    cfg = SimConfig(model="llama-3-8b", hardware="a100-80gb")
    plain = run_simulation(cfg, _trace(), _cost(False))
    res = run_simulation(cfg, _trace(), _cost(True))
    r, its = res.requests, res.iterations
    pd.testing.assert_frame_equal(r[plain.requests.columns], plain.requests)  # the server's side is untouched
    first = lagged_times(r.first_token_time.to_numpy(), its, 1.0)
    last = lagged_times(r.finish_time.to_numpy(), its, 1.0)
    out = r.output_len.to_numpy()
    np.testing.assert_allclose(r.client_ttft, first - r.arrival + 0.02, rtol=0, atol=1e-12)
    np.testing.assert_allclose(r.client_e2e_latency, last - r.arrival + 0.02 + 0.001 * (out - 1), rtol=0, atol=1e-12)
    assert (r.client_ttft > r.ttft + 0.02 - 1e-12).all()  # a step's lag at least, while the engine is busy
    many = out > 1
    np.testing.assert_allclose(r.client_tpot[many], ((r.client_e2e_latency - r.client_ttft) / (out - 1))[many],
                               rtol=1e-12)
    for name in ("ttft", "tpot", "e2e_latency", "normalized_latency"):
        assert res.summary[f"client_{name}"]["mean"] == pytest.approx(r[f"client_{name}"].mean())
        assert res.summary[name]["mean"] == pytest.approx(r[name].mean())


def test_slo_attainment_and_goodput_judge_the_clients_latencies() -> None:
    probe = run_simulation(SimConfig(model="llama-3-8b", hardware="a100-80gb"), _trace(), _cost(True)).requests
    # an SLO between the server's and the client's median TTFT: met by the server, missed by the client
    slo = float((probe.ttft.median() + probe.client_ttft.median()) / 2)
    cfg = SimConfig(model="llama-3-8b", hardware="a100-80gb", slo_ttft=slo)
    server = run_simulation(cfg, _trace(), _cost(False)).summary
    client = run_simulation(cfg, _trace(), _cost(True)).summary
    expected = float((probe.client_ttft <= slo).mean())
    assert client["slo_attainment"] == pytest.approx(expected) and client["slo_attainment"] < server["slo_attainment"]
    assert latency_basis(client) == "client" and "client" in client["latency_basis"]
    row = headline(client)  # what a sweep keeps: the client's figures
    assert row["ttft_mean"] == client["client_ttft"]["mean"] != client["ttft"]["mean"]
    assert row["mean_normalized_latency"] == client["client_mean_normalized_latency"]


def test_each_replica_lags_over_its_own_iterations() -> None:
    cfg = SimConfig(model="llama-3-8b", hardware="a100-80gb", replicas=2)
    res = run_simulation(cfg, _trace(80), _cost(True))
    r, its = res.requests, res.iterations
    for k in (0, 1):
        mine = r[r.replica == k]
        sent = lagged_times(mine.first_token_time.to_numpy(), its[its.replica == k], 1.0)
        np.testing.assert_allclose(mine.client_ttft, sent - mine.arrival + 0.02, rtol=0, atol=1e-12)


def test_disaggregated_runs_report_the_client_too() -> None:
    cfg = SimConfig(model="llama-3-8b", hardware="a100-80gb", disaggregate=(1, 1))
    plain = run_simulation(cfg, _trace(), _cost(False))
    res = run_simulation(cfg, _trace(), _cost(True))
    r = res.requests
    pd.testing.assert_frame_equal(r[plain.requests.columns], plain.requests)
    done = r[r.status == "finished"]
    assert (done.client_ttft >= done.ttft + 0.02 - 1e-12).all()
    assert (done.client_e2e_latency >= done.e2e_latency + 0.02 - 1e-12).all()
    assert res.summary["client_e2e_latency"]["mean"] > res.summary["e2e_latency"]["mean"]


def test_a_calibration_run_reports_both_and_the_report_says_which() -> None:
    cfg = SimConfig(model="llama-3.1-8b", hardware="h100-sxm", calibration="vllm-v1-h100", cost_model="calibrated")
    s = run_simulation(cfg, _trace(40)).summary
    assert s["client_ttft"]["mean"] > s["ttft"]["mean"]
    table = summary_table({"run": s})
    assert "client TTFT mean / p90" in table and "goodput, client latencies" in table
    assert "client" not in summary_table({"run": run_simulation(SimConfig(model="llama-3.1-8b", hardware="h100-sxm"),
                                                                 _trace(40)).summary})
    args = argparse.Namespace(model="llama-3.1-8b", hardware="h100-sxm", profile=None, calibration="vllm-v1-h100")
    assert "client-side latencies" in study_title(args)


def test_client_terms_refuse_negative_values() -> None:
    with pytest.raises(ValueError, match="output_lag_steps"):
        ClientTerms(output_lag_steps=-1.0)


def test_an_aborted_row_gets_the_client_ttft_of_its_first_token_and_nothing_else() -> None:
    """A row aborted after its first token has a client TTFT (its first token lagged and added to, as a
    finished row's); one aborted before any token, and a rejected one, have no client latency at all."""
    from policies.client_latency import with_client_latencies
    nan = float("nan")
    requests = pd.DataFrame({"arrival": [0.0, 0.0, 0.0, 0.0], "output_len": [3, 2, 0, 0],
                             "first_token_time": [0.10, 0.10, nan, nan], "finish_time": [0.30, 0.25, 0.2, nan],
                             "status": ["finished", "aborted", "aborted", "rejected"]})
    iterations = pd.DataFrame({"start": [0.0, 0.1, 0.2], "duration": [0.1, 0.1, 0.1]})
    r = with_client_latencies(requests, iterations, TERMS)
    # the first token came out of the iteration ending at 0.1: one step's lag sends it at 0.2
    assert r.client_ttft.iloc[0] == pytest.approx(0.2 + 0.02) and r.client_ttft.iloc[1] == pytest.approx(0.2 + 0.02)
    for name in ("client_tpot", "client_e2e_latency", "client_normalized_latency"):
        assert np.isnan(r[name].iloc[1:]).all() and not np.isnan(r[name].iloc[0]), name
    assert np.isnan(r.client_ttft.iloc[2:]).all()


def test_per_client_reads_a_trace_without_clients_without_a_warning() -> None:
    """A request table whose client column reads back as all-NaN floats (no trace classes): one
    client named "", and no pandas warning about filling a float column with a string."""
    import warnings

    from policies.metrics import per_client
    requests = pd.DataFrame({"arrival": [0.0, 1.0], "prompt_len": [4, 4], "output_len": [2, 2],
                             "ttft": [0.1, 0.1], "tpot": [0.01, 0.01], "e2e_latency": [0.2, 0.2],
                             "normalized_latency": [0.1, 0.1], "finish_time": [0.2, 1.2],
                             "first_scheduled": [0.0, 1.0], "status": ["finished", "finished"],
                             "client": [float("nan"), float("nan")]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table, _ = per_client(requests, None, None)
    assert list(table.client) == [""] and int(table.requests.iloc[0]) == 2
