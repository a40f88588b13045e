"""Validation of simulated runs against live runs of the same trace."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from analysis.validate import (
    compare_runs,
    per_request_errors,
    validation_plot,
    validation_summary,
    validation_table,
)

LATENCY_ROWS = [(m, s) for m in ("ttft", "tpot", "e2e_latency", "normalized_latency") for s in ("mean", "p90")]
THROUGHPUT_ROWS = [("request_throughput", "value"), ("output_token_throughput", "value")]


def requests(arrival, ttft, e2e, output_len, status=None, ids=None) -> pd.DataFrame:
    """A requests table as request_frame writes it, from arrivals, TTFTs and end-to-end latencies;
    rejected requests get NaN latencies and times."""
    arrival, ttft, e2e = (np.asarray(x, dtype=float) for x in (arrival, ttft, e2e))
    out = np.asarray(output_len, dtype=np.int64)
    status = np.array(status if status is not None else ["finished"] * len(arrival), dtype=object)
    done = status == "finished"
    nan = float("nan")
    ttft, e2e = np.where(done, ttft, nan), np.where(done, e2e, nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(out > 1, (e2e - ttft) / (out - 1), nan)
    return pd.DataFrame({
        "request_id": np.asarray(ids if ids is not None else range(len(arrival)), dtype=np.int64),
        "arrival": arrival,
        "prompt_len": np.full(len(arrival), 100, dtype=np.int64),
        "output_len": out,
        "first_token_time": arrival + ttft,
        "finish_time": arrival + e2e,
        "ttft": ttft,
        "tpot": tpot,
        "e2e_latency": e2e,
        "normalized_latency": e2e / out,
        "num_preemptions": np.zeros(len(arrival), dtype=np.int64),
        "prefix_hit_tokens": np.zeros(len(arrival), dtype=np.int64),
        "status": status,
    })


def scaled(table: pd.DataFrame, factor: float) -> pd.DataFrame:
    """Every latency times factor, first-token and finish times moved to match."""
    t = table.copy()
    for col in ("ttft", "tpot", "e2e_latency", "normalized_latency"):
        t[col] = t[col] * factor
    t["first_token_time"] = t.arrival + t.ttft
    t["finish_time"] = t.arrival + t.e2e_latency
    return t


@pytest.fixture
def live() -> pd.DataFrame:
    return requests(arrival=[0.0, 0.5, 1.0, 2.0, 3.5, 4.0], ttft=[0.2, 0.3, 0.1, 0.8, 0.4, 0.25],
                    e2e=[2.0, 3.0, 1.5, 4.0, 2.5, 5.0], output_len=[10, 20, 5, 40, 1, 30])


def rows(table: pd.DataFrame) -> pd.DataFrame:
    return table.set_index(["metric", "statistic"])


def test_identical_runs_have_zero_error(live):
    table = compare_runs(live, live.copy())
    assert list(table.columns) == ["metric", "statistic", "live", "sim", "error", "abs_error"]
    assert list(zip(table.metric, table.statistic)) == LATENCY_ROWS + THROUGHPUT_ROWS
    assert (table.error == 0).all() and (table.abs_error == 0).all()
    t = rows(table)
    assert t.loc[("ttft", "mean"), "live"] == pytest.approx(np.mean([0.2, 0.3, 0.1, 0.8, 0.4, 0.25]))
    assert t.loc[("e2e_latency", "p90"), "live"] == pytest.approx(np.quantile([2.0, 3.0, 1.5, 4.0, 2.5, 5.0], 0.9))


def test_scaled_latencies_give_ten_percent_error(live):
    sim = scaled(live, 1.1)
    t = rows(compare_runs(live, sim))
    for key in LATENCY_ROWS:
        assert abs(t.loc[key, "error"] - 0.1) < 1e-9, key
        assert abs(t.loc[key, "abs_error"] - 0.1) < 1e-9, key
        assert abs(t.loc[key, "sim"] - 1.1 * t.loc[key, "live"]) < 1e-9, key
    # throughput follows the span from first arrival to last finish: 9.0 s live, 9.5 s simulated
    span_live, span_sim = 4.0 + 5.0, 4.0 + 5.5
    assert t.loc[("request_throughput", "value"), "live"] == pytest.approx(6 / span_live, abs=1e-12)
    assert t.loc[("request_throughput", "value"), "error"] == pytest.approx(span_live / span_sim - 1, abs=1e-12)


def test_throughput_error_on_a_hand_made_case():
    live = requests(arrival=[0, 1, 2], ttft=[1, 1, 1], e2e=[4, 4, 8], output_len=[10, 20, 30])  # span 10 s
    sim = requests(arrival=[0, 1, 2], ttft=[1, 1, 1], e2e=[4, 4, 6], output_len=[10, 20, 30])   # span 8 s
    t = rows(compare_runs(live, sim))
    req, tok = t.loc[("request_throughput", "value")], t.loc[("output_token_throughput", "value")]
    assert (req.live, req.sim) == pytest.approx((0.3, 0.375))
    assert (tok.live, tok.sim) == pytest.approx((6.0, 7.5))
    assert req.error == pytest.approx(0.25) and tok.error == pytest.approx(0.25)
    assert req.abs_error == pytest.approx(0.25)
    # the last request's e2e fell from 8 to 6 s: mean e2e 16/3 -> 14/3
    assert t.loc[("e2e_latency", "mean"), "error"] == pytest.approx(-1 / 8)
    assert t.loc[("e2e_latency", "mean"), "abs_error"] == pytest.approx(1 / 8)


def test_mismatched_request_ids_raise_naming_them(live):
    sim = live.copy()
    sim["request_id"] = [0, 1, 2, 3, 70, 71]
    with pytest.raises(ValueError, match="different requests") as err:
        compare_runs(live, sim)
    msg = str(err.value)
    assert "2 only in live [4, 5]" in msg and "2 only in sim [70, 71]" in msg
    with pytest.raises(ValueError, match="only in live"):
        per_request_errors(live, sim)


def test_many_missing_ids_are_counted_and_truncated(live):
    big = requests(arrival=range(20), ttft=[0.1] * 20, e2e=[1.0] * 20, output_len=[5] * 20)
    with pytest.raises(ValueError, match=r"14 only in sim \[6, 7, 8, 9, 10, \.\.\. \(\+9 more\)\]"):
        compare_runs(live, big)


def test_duplicate_ids_raise(live):
    sim = live.copy()
    sim.loc[5, "request_id"] = 4
    with pytest.raises(ValueError, match="sim run repeats request ids: 4"):
        compare_runs(live, sim)


def test_status_mismatch_raises_naming_the_requests(live):
    sim = live.copy()
    sim.loc[sim.request_id == 3, "status"] = "rejected"
    with pytest.raises(ValueError, match=r"1 requests differ in status.*3 \(finished live, rejected sim\)"):
        compare_runs(live, sim)


def test_rejected_requests_are_excluded_from_latency_stats():
    status = ["finished", "rejected", "finished", "finished"]
    live = requests(arrival=[0, 1, 2, 3], ttft=[0.5, 0, 1.0, 1.5], e2e=[2, 0, 3, 4], output_len=[4, 4, 4, 4],
                    status=status)
    sim = live.copy()
    # garbage in the simulated rejected row: it must not reach any statistic (nor the throughput span)
    rej = sim.status == "rejected"
    sim.loc[rej, ["ttft", "tpot", "e2e_latency", "normalized_latency"]] = 1000.0
    sim.loc[rej, ["first_token_time", "finish_time"]] = 1000.0
    table = compare_runs(live, sim)
    assert (table.error == 0).all()
    t = rows(table)
    assert t.loc[("ttft", "mean"), "live"] == pytest.approx(1.0)
    assert t.loc[("e2e_latency", "mean"), "live"] == pytest.approx(3.0)
    assert t.loc[("request_throughput", "value"), "live"] == pytest.approx(3 / 7)  # 3 finished over 0..7 s
    per = per_request_errors(live, sim)
    assert list(per.request_id) == [0, 2, 3]


def test_per_request_errors(live):
    sim = scaled(live, 1.1)
    sim.loc[sim.request_id == 2, "e2e_latency"] = 3.0  # live 1.5 s: +100%
    per = per_request_errors(live, sim.iloc[::-1])      # row order does not matter
    assert list(per.columns) == ["request_id", "ttft_live", "ttft_sim", "e2e_live", "e2e_sim", "e2e_error"]
    assert list(per.request_id) == [0, 1, 2, 3, 4, 5]
    assert per.ttft_sim.to_numpy() == pytest.approx(1.1 * per.ttft_live.to_numpy())
    expected = [0.1, 0.1, 1.0, 0.1, 0.1, 0.1]
    assert np.abs(per.e2e_error.to_numpy() - expected).max() < 1e-9


def test_zero_live_value_gives_nan_error(live):
    zero = live.assign(ttft=0.0)
    sim = live.copy()
    t = rows(compare_runs(zero, sim))
    assert math.isnan(t.loc[("ttft", "mean"), "error"]) and math.isnan(t.loc[("ttft", "p90"), "abs_error"])
    assert t.loc[("tpot", "mean"), "error"] == 0


def test_csv_round_trip(live, tmp_path):
    scaled(live, 1.1).to_csv(tmp_path / "requests.csv", index=False)
    sim = pd.read_csv(tmp_path / "requests.csv")
    t = rows(compare_runs(live, sim))
    assert abs(t.loc[("tpot", "p90"), "error"] - 0.1) < 1e-9


def test_validation_summary_on_a_hand_made_table():
    table = pd.DataFrame({
        "metric": ["ttft", "ttft", "tpot", "request_throughput", "output_token_throughput"],
        "statistic": ["mean", "p90", "mean", "value", "value"],
        "live": [1.0, 2.0, 0.0, 4.0, 10.0],
        "sim": [1.1, 1.4, 0.5, 4.8, 9.0],
        "error": [0.1, -0.3, float("nan"), 0.2, -0.1],
    })
    table["abs_error"] = table.error.abs()
    s = validation_summary(table)
    assert s["mape"] == pytest.approx((0.1 + 0.3 + 0.2 + 0.1) / 4)
    assert s["max_abs_error"] == pytest.approx(0.3)
    assert s["worst"] == {"metric": "ttft", "statistic": "p90", "error": pytest.approx(-0.3)}
    assert s["by_statistic"] == pytest.approx({"mean": 0.1, "p90": 0.3, "value": 0.15})
    assert (s["num_rows"], s["num_undefined"]) == (5, 1)
    json.dumps(s, allow_nan=False)  # plain floats throughout
    assert all(type(v) is float for v in s["by_statistic"].values())


def test_validation_summary_of_real_comparison(live):
    s = validation_summary(compare_runs(live, scaled(live, 1.1)))
    assert s["by_statistic"]["p90"] == pytest.approx(0.1, abs=1e-9)
    assert s["worst"]["metric"] in ("ttft", "tpot", "e2e_latency", "normalized_latency")


def test_validation_table_lists_every_metric(live):
    text = validation_table(compare_runs(live, scaled(live, 1.1)))
    lines = text.splitlines()
    assert lines[0].split() == ["metric", "stat", "live", "sim", "error"]
    assert len(lines) == 2 + 10
    assert len({len(line) for line in lines}) == 1  # aligned columns
    for metric in ("ttft", "tpot", "e2e_latency", "normalized_latency", "request_throughput",
                   "output_token_throughput"):
        assert metric in text
    assert text.count("+10.0%") == 8


def test_validation_plot_writes_png(live, tmp_path):
    path = validation_plot(live, scaled(live, 1.1), tmp_path / "cdf.png", title="validate")
    assert path == tmp_path / "cdf.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_step_time_errors_are_zero_for_the_model_that_produced_the_times():
    from analysis.validate import step_time_errors
    from sim.run import SimConfig, build_cost_model, run_simulation
    from traces import resolve_trace

    cfg = SimConfig(chunked_prefill=True, max_num_batched_tokens=512)
    res = run_simulation(cfg, resolve_trace("sharegpt-like", num_requests=80, rate=6.0, seed=0))
    exact = step_time_errors(res.iterations, build_cost_model(cfg))
    assert exact["iterations"] == len(res.iterations) and exact["mape"] == 0 and exact["prompt_mape"] == 0
    slower = res.iterations.assign(duration=res.iterations.duration * 1.25)
    off = step_time_errors(slower, build_cost_model(cfg))
    assert off["mape"] == pytest.approx(0.2) and off["bias"] == pytest.approx(-0.2)
