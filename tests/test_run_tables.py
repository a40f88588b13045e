"""A run's tables built for scale (issue 23's million-request run within 4 GiB): the iteration
table a column at a time from the logs' pieces, the KV time averages without a sub-frame; each equal to what the
straightforward construction gives."""

import pickle
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from benchmarks.bench_sim import PEAK_TARGET_MB, _peak_vs_target, _per_request
from policies.iteration_log import ITERATION_COLUMNS, IterationLog
from policies.metrics import SUMMARY_COLUMNS, _kv_time_averages, _TimeAverage, summarize
from sim.iteration_table import IterationTable
from sim.run import SimConfig, _iteration_table, run_simulation
from traces import resolve_trace


def _log(seed: int, rows: int) -> IterationLog:
    """A log of `rows` random rows written in windows over several small staging blocks."""
    rng = np.random.default_rng(seed)
    log, t = IterationLog(capacity=5), 0.0
    while log.rows < rows:
        k = int(rng.integers(1, 8))
        cols = {c: rng.integers(0, 3000, k) for c in ITERATION_COLUMNS}
        cols["start"], cols["duration"] = t + np.arange(k) * 0.5, rng.random(k)
        log.add_many(cols)
        t += 0.5 * k
    return log


def test_pop_parts_hands_the_column_over() -> None:
    log = _log(0, 23)
    want = log.column("waiting")
    got = np.concatenate(log.pop_parts("waiting"), dtype=np.int64)
    assert got.tolist() == want.tolist()
    with pytest.raises(KeyError):
        log.parts("waiting")  # the log holds it no more
    assert log.column("running").dtype == np.int64  # the other columns stay


@pytest.mark.parametrize("replicas", [1, 3])
def test_iteration_table_equals_the_logs_frames(replicas: int) -> None:
    frames = [_log(i, 10 + 7 * i).frame() for i in range(replicas)]
    got = _iteration_table([SimpleNamespace(log=_log(i, 10 + 7 * i), index=i) for i in range(replicas)]).frame()
    want = pd.concat([f.assign(replica=i) for i, f in enumerate(frames)], ignore_index=True)
    if replicas == 1:
        want = want.drop(columns="replica")  # one replica: exactly its log's frame
    pd.testing.assert_frame_equal(got, want)


def _eager(logs: list[IterationLog]) -> pd.DataFrame:
    """The straightforward table: each log's frame, one after another, `replica` saying whose."""
    return pd.concat([log.frame().assign(replica=i) for i, log in enumerate(logs)], ignore_index=True)


def test_iteration_table_builds_a_column_when_read_and_keeps_it() -> None:
    want = _eager([_log(i, 9 + 11 * i) for i in range(3)])
    logs = [_log(i, 9 + 11 * i) for i in range(3)]
    table = IterationTable(logs, [0, 1, 2])
    assert all(log.rows and not log._sealed for log in logs)  # the logs handed their pieces over
    assert len(table) == len(want)
    part = table.frame(["kv_free", "duration", "replica"])
    assert list(part.columns) == ["duration", "kv_free", "replica"]  # in the table's order
    pd.testing.assert_frame_equal(part, want[["duration", "kv_free", "replica"]], check_exact=True)
    assert table.column("kv_free") is table.column("kv_free")  # built once
    full = table.frame()
    pd.testing.assert_frame_equal(full, want, check_exact=True)
    assert np.shares_memory(full.kv_free.to_numpy(), part.kv_free.to_numpy())  # the same array in both frames
    with pytest.raises(KeyError, match=r"no column 'kv_used'.*kv_free"):
        table.column("kv_used")


def test_iteration_table_pickles_before_its_columns_are_built() -> None:
    want = _eager([_log(i, 30) for i in range(2)])
    table = IterationTable([_log(i, 30) for i in range(2)], [0, 1])
    table.column("start")
    again = pickle.loads(pickle.dumps(table))
    pd.testing.assert_frame_equal(again.frame(), want, check_exact=True)


def test_a_run_builds_its_iteration_table_when_read() -> None:
    trace = resolve_trace("sharegpt-like", num_requests=80, rate=30, seed=4)
    res = run_simulation(SimConfig(replicas=2, router="least-loaded"), trace)
    assert isinstance(res._iterations, IterationTable)  # the summary read its columns, nothing built the frame
    frame = res.iterations
    assert res.iterations is frame and len(frame) == res.summary["num_iterations"]
    assert list(frame.columns) == ["iteration", *ITERATION_COLUMNS, "replica"]
    assert summarize(res.requests, frame) == summarize(res.requests, frame[list(SUMMARY_COLUMNS)])


@pytest.mark.parametrize("built", [(), ("kv_reserved", "num_seqs")])
def test_time_averages_over_the_tables_blocks_equal_the_frames(built: tuple[str, ...]) -> None:
    """summarize reads a run's table block by block (narrow pieces, some columns perhaps built
    whole already): the same bits as over the frame."""
    frame = IterationTable([_log(i, 40 + 13 * i) for i in range(3)], [0, 1, 2]).frame()
    table = IterationTable([_log(i, 40 + 13 * i) for i in range(3)], [0, 1, 2])
    assert len(table._splits) > 10 and table._pieces["kv_free"][0].dtype == np.int16  # many narrow blocks
    for c in built:
        table.column(c)
    w = frame.duration.to_numpy()
    assert _kv_time_averages(table, _TimeAverage(table.column("duration"))) == _kv_time_averages(frame, _TimeAverage(w))
    got = _TimeAverage(table.column("duration")).of_blocks(table.blocks(["num_seqs"]), np.copyto)
    assert got == float(np.average(frame.num_seqs, weights=w))


def test_kv_time_averages_equal_the_sub_frame_formulation() -> None:
    frame = _log(5, 400).frame()
    w = frame.duration
    kv = frame[["kv_token_states", "kv_reserved", "kv_internal_frag", "kv_external_frag", "kv_free"]]
    allocated = kv.iloc[:, :4].sum(axis=1)
    total = allocated + kv.kv_free
    want = (float(np.average(kv.kv_token_states / allocated.clip(lower=1), weights=w)),
            float(np.average(allocated / total.clip(lower=1), weights=w)))
    got = _kv_time_averages(frame, _TimeAverage(w.to_numpy()))  # its scratch and in-place products
    assert got == want  # bit for bit, not approximately


def test_run_tables_and_summary_hold_every_request() -> None:
    trace = resolve_trace("sharegpt-like", num_requests=120, rate=40, seed=3)
    res = run_simulation(SimConfig(replicas=3, router="least-loaded"), trace)
    assert res.requests.request_id.tolist() == list(range(120))
    assert set(res.requests.status) == {"finished"}
    assert res.summary["num_finished"] == 120 and res.summary["num_iterations"] == len(res.iterations)
    assert sorted(res.iterations.replica.unique()) == [0, 1, 2]
    again = summarize(res.requests.copy(), res.iterations.copy())
    for key in ("kv_usage", "kv_token_state_fraction", "mean_batched_seqs", "duration_s"):
        assert again[key] == res.summary[key]


def test_peak_said_against_the_target() -> None:
    assert _peak_vs_target(PEAK_TARGET_MB - 500).endswith("met, 500 MiB under")
    assert "NOT met, 1,000 MiB over" in _peak_vs_target(PEAK_TARGET_MB + 1000)


def test_per_request_line_separates_cost_from_load() -> None:
    """bench_sim's growth figures: CPU per request, CPU over the reference, and wall over CPU
    (how long the run waited for the CPU on a shared machine)."""
    line = _per_request({"cpu": 150.0, "wall": 180.0, "ref": 0.2}, 1_000_000)
    assert line == "CPU 150 us per request, 750x python_reference_s; wall / CPU 1.20"


@pytest.mark.parametrize("grouped", [False, True])
def test_router_summary_equals_masking_each_replica(grouped: bool):
    """The router summary reads each replica's rows from slices of sorted columns: the figures must
    be those of masking the tables per replica with pandas, bit for bit (NaN latencies, unfinished
    requests, a replica that served nothing)."""
    from policies.router import make_router
    from sim.run import _router_summary

    rng = np.random.default_rng(5)
    n, caches = 400, [("a100-40gb", 100), ("h100-sxm", 200), ("a100-40gb", 50), ("l4", 10)]
    replica = rng.choice([0, 1, 3], n)  # replica 2 served nothing
    latency = rng.lognormal(0, 2, n)
    latency[rng.random(n) < 0.1] = np.nan
    requests = pd.DataFrame({"replica": replica, "status": rng.choice(["finished", "rejected"], n, p=[0.9, 0.1]),
                             "arrival": np.sort(rng.random(n) * 100), "finish_time": rng.random(n) * 100 + 100,
                             "prefix_hit_tokens": rng.integers(0, 500, n), "num_preemptions": rng.integers(0, 3, n),
                             "normalized_latency": latency})
    iterations = pd.DataFrame({"replica": rng.choice(4, 3000), "duration": rng.lognormal(-4, 1, 3000)})
    if grouped:  # rows in replica order, as a run's iteration table has them
        iterations = iterations.sort_values("replica", kind="stable", ignore_index=True)
    got = _router_summary(make_router("least-loaded"), requests, iterations, caches)
    span = float(requests.finish_time.max() - requests.arrival.min())
    for i, row in enumerate(got["replicas"]):
        mine = requests[requests.replica == i]
        done = mine[mine.status == "finished"]
        assert row["requests"] == len(mine) and row["finished"] == len(done)
        assert row["busy_fraction"] == float(iterations.duration[iterations.replica == i].sum()) / span
        assert row["prefix_hit_tokens"] == int(mine.prefix_hit_tokens.sum())
        assert row["preemptions"] == int(mine.num_preemptions.sum())
        mean = float(done.normalized_latency.mean()) if len(done) else float("nan")
        assert row["mean_normalized_latency"] == mean or (mean != mean and row["mean_normalized_latency"] != row["mean_normalized_latency"])


def test_iteration_table_with_an_empty_log_equals_the_logs_frames() -> None:
    logs = [_log(1, 12), IterationLog(), _log(2, 30)]
    want = pd.concat([log.frame().assign(replica=i) for i, log in enumerate(logs)], ignore_index=True)
    got = _iteration_table([SimpleNamespace(log=_log(1, 12), index=0), SimpleNamespace(log=IterationLog(), index=1),
                            SimpleNamespace(log=_log(2, 30), index=2)]).frame()
    pd.testing.assert_frame_equal(got, want, check_exact=True)


def test_request_frame_orders_groups_by_id_whatever_their_order() -> None:
    from policies.request_rows import request_frame
    from sim import run as sim_run

    seen = {}
    tables = sim_run._tables

    def spy(replicas):  # the finished groups, before `_tables` releases them
        groups = list(replicas[0].scheduler.done)
        seen["where"] = {g.request.request_id: i for i, g in enumerate(groups)}  # each group's place in `done`
        seen["frames"] = [request_frame(groups), request_frame(groups[::-1], np.arange(len(groups))[::-1]),
                          request_frame(sorted(groups, key=lambda g: g.request.request_id))]
        with pytest.raises(ValueError, match="replicas for"):
            request_frame(groups, np.zeros(len(groups) - 1, dtype=np.int64))
        return tables(replicas)

    try:
        sim_run._tables = spy
        run_simulation(SimConfig(num_gpu_blocks=200), resolve_trace("multi-client", num_requests=80, rate=20.0, seed=3))
    finally:
        sim_run._tables = tables
    plain, reversed_, in_order = seen["frames"]
    assert plain.request_id.is_monotonic_increasing and len(plain) == 80
    pd.testing.assert_frame_equal(plain, in_order, check_exact=True)
    pd.testing.assert_frame_equal(reversed_.drop(columns="replica"), plain, check_exact=True)
    # each row's `replica` is the value given beside its group: here the group's place in `done`
    assert reversed_.columns[-1] == "replica"
    assert reversed_.replica.tolist() == [seen["where"][i] for i in plain.request_id.tolist()]


@pytest.mark.parametrize("seed", range(4))
def test_stats_equal_pandas_mean_and_quantiles(seed: int) -> None:
    from policies.metrics import _stats

    rng = np.random.default_rng(seed)
    for n in (1, 2, 3, 10, 101, 5000):
        x = pd.Series(rng.lognormal(size=n) * 10.0 ** rng.integers(-4, 4))
        x[rng.random(n) < 0.2 * seed] = np.nan  # some NaN (seed 0: none)
        d = x.dropna()
        want = ({"mean": float(d.mean()), "p50": float(d.quantile(0.5)), "p90": float(d.quantile(0.9)),
                 "p99": float(d.quantile(0.99))} if len(d) else None)
        got = _stats(x)
        if want is None:
            assert all(v != v for v in got.values())  # all NaN
        else:
            assert got == want  # bit for bit, not approximately


def test_a_result_gives_some_iteration_columns_without_the_rest() -> None:
    trace = resolve_trace("sharegpt-like", num_requests=60, rate=30, seed=5)
    res = run_simulation(SimConfig(), trace)
    some = res.iteration_columns(["kv_free", "start"])
    assert isinstance(res._iterations, IterationTable) and list(some.columns) == ["start", "kv_free"]
    pd.testing.assert_frame_equal(some, res.iterations[["start", "kv_free"]], check_exact=True)
    pd.testing.assert_frame_equal(res.iteration_columns(["kv_free", "start"]), some)  # read from the built frame
    with pytest.raises(KeyError, match="kv_used"):
        run_simulation(SimConfig(), trace).iteration_columns(["kv_used"])  # from the logs' pieces
    with pytest.raises(KeyError, match="kv_used"):
        res.iteration_columns(["kv_used"])  # from the built frame
