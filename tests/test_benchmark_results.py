"""guidellm result files as measured experiments (analysis/benchmark_results.py), on a small file in
guidellm's shape (the fields the loader reads; tests/test_serve.py loads a real one)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from analysis.benchmark_results import is_guidellm, load_guidellm


def _request(start: float, ttft_ms: float, latency: float, prompt: int = 20, out: int = 6) -> dict:
    return {"request_start_time": start, "time_to_first_token_ms": ttft_ms, "request_latency": latency,
            "prompt_tokens": prompt, "output_tokens": out}


def _report(successful: list[dict], errored: int = 0) -> dict:
    return {"metadata": {"guidellm_version": "0.8.1"},
            "config": {"spec": {"backend": {"kind": "openai_http", "model": "smollm2-135m"}}},
            "benchmarks": [{"type_": "generative_benchmark", "duration": 4.0,
                            "config": {"strategy": {"type_": "concurrent", "streams": 2}},
                            "requests": {"successful": successful, "errored": [{}] * errored, "incomplete": []}}]}


def test_requests_replay_at_their_send_times(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps(_report([_request(102.0, 300, 1.5, prompt=30), _request(100.0, 100, 1.0),
                                        _request(101.0, 200, 2.0, out=9)], errored=1)))
    assert is_guidellm(json.loads(path.read_text()))
    (exp,) = load_guidellm(path)
    st = exp.stages[0]
    assert exp.model == "smollm2-135m" and st.successes == 3 and st.failures == 1
    assert list(st.requests.arrival) == [0.0, 1.0, 2.0] and list(st.requests.prompt_len) == [20, 20, 30]
    assert list(st.requests.output_len) == [6, 9, 6] and st.requests.has_timestamps
    assert st.ttft.mean == pytest.approx(0.2) and st.e2e.mean == pytest.approx(1.5)
    assert st.throughput_rps == pytest.approx(3 / 4.0) and st.output_len == pytest.approx(7.0)


@pytest.mark.parametrize("mutate, where", [
    (lambda r: r["benchmarks"][0]["requests"].update(successful=[]), "requests.successful"),
    (lambda r: r["benchmarks"][0]["requests"]["successful"][0].pop("prompt_tokens"), "prompt_tokens"),
    (lambda r: r["config"]["spec"]["backend"].update(model="no-such-model-xyz"), "backend.model"),
])
def test_bad_files_name_the_field(tmp_path, mutate, where):
    report = _report([_request(0.0, 100, 1.0)])
    mutate(report)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(report))
    with pytest.raises(ValueError, match=where):
        load_guidellm(path)


def test_other_files_are_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"request_rate": 1.0}))
    with pytest.raises(ValueError, match="not a guidellm report"):
        load_guidellm(path)


def test_guidellm_requests_table_and_validate(tmp_path):
    """The file as a trace and a client-measured requests table, and `pagesim validate --live-run`
    simulating exactly those requests against it."""
    from analysis.benchmark_results import guidellm_requests
    from pagesim.cli import main

    path = tmp_path / "result.json"
    path.write_text(json.dumps(_report([_request(10.0 + 0.5 * i, 150 + 10 * i, 1.2 + 0.1 * i, prompt=20 + i)
                                        for i in range(8)])))
    trace, table = guidellm_requests(path)
    assert list(table.request_id) == list(range(8)) and list(trace.prompt_len) == list(range(20, 28))
    assert table.ttft.iloc[3] == pytest.approx(0.18) and table.tpot.iloc[0] == pytest.approx((1.2 - 0.15) / 5)
    with pytest.raises(ValueError, match=r"benchmarks\[1\]"):
        guidellm_requests(path, benchmark=1)
    out = tmp_path / "val"
    assert main(["validate", "--model", "smollm2-135m", "--profile", "smollm2-135m-cpu", "--live-run", str(path),
                 "--out", str(out), "--quiet"]) == 0
    rows = json.loads((out / "validation.json").read_text())
    assert rows["num_requests"] == 8
    sim = pd.read_csv(out / "sim" / "requests.csv")
    assert list(sim.prompt_len) == list(range(20, 28)) and list(sim.arrival) == pytest.approx(list(trace.arrival))


def test_measurement_loaders_take_a_guidellm_result(tmp_path):
    """pagesim fidelity / calibrate read measurements through load_measurements: a guidellm result
    file goes in as it is."""
    from analysis.measurement_files import load_measurements

    path = tmp_path / "result.json"
    path.write_text(json.dumps(_report([_request(100.0, 100, 1.0), _request(101.0, 200, 2.0)])))
    (exp,) = load_measurements([path])
    assert exp.stages[0].successes == 2 and exp.model == "smollm2-135m"
