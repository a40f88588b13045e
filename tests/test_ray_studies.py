"""Studies on Ray give the serial tables; seeds as a study axis (analysis.seeds)."""

import sys

import numpy as np
import pandas as pd
import pytest

from analysis.capacity import capacity_table
from analysis.parallel import RAY_MISSING, run_tasks
from analysis.routing import router_sweep
from analysis.seeds import ci_table, seed_workloads
from analysis.sweep import sweep
from sim.run import SimConfig
from traces import resolve_trace

try:
    import ray
except ImportError:  # the cluster extra is optional
    ray = None


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (its start-up is most of these tests' time)."""
    if ray is None:
        pytest.skip("ray is not installed (pip install 'pagesim[cluster]')")
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    yield
    ray.shutdown()


def _workload(seed: int = 2):
    return resolve_trace("sharegpt-like", num_requests=30, rate=4.0, seed=seed)


def _no_wall(table: pd.DataFrame) -> pd.DataFrame:
    return table.drop(columns=[c for c in ("wall_s",) if c in table])


@pytest.mark.slow
def test_sweep_and_routing_on_ray_give_the_serial_tables(local_ray):
    trace = _workload()
    studies = {
        "sweep": lambda **kw: sweep(trace, SimConfig(num_gpu_blocks=300), ["vllm", "orca-max"], [2.0, 6.0], **kw)[0],
        "routing": lambda **kw: router_sweep(trace, SimConfig(num_gpu_blocks=300, replicas=2),
                                             ["round-robin", "least-loaded"], [4.0, 8.0], **kw),
        "seeded capacity": lambda **kw: capacity_table([_workload(s) for s in (0, 1)],
                                                       SimConfig(num_gpu_blocks=300, slo_ttft=1.0),
                                                       ["least-loaded"], [6.0], **kw)[1],
    }
    for name, run in studies.items():
        serial, on_ray = run(), run(executor="ray")
        pd.testing.assert_frame_equal(_no_wall(serial), _no_wall(on_ray), check_exact=True, obj=name)


@pytest.mark.slow
def test_ray_calls_on_done_for_every_task_and_raises_a_task_error_as_itself(local_ray):
    seen = []
    assert run_tasks(len, [("a" * k,) for k in range(6)], executor="ray",
                     on_done=lambda i, r: seen.append((i, r))) == list(range(6))
    assert sorted(seen) == [(k, k) for k in range(6)]
    with pytest.raises(ValueError, match="invalid literal"):
        run_tasks(int, [("1",), ("x",)], executor="ray")


def test_ray_executor_without_ray_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    with pytest.raises(SystemExit, match=r"pip install 'pagesim\[cluster\]'") as e:
        run_tasks(len, [("ab",)], executor="ray")
    assert str(e.value) == RAY_MISSING


def test_bad_executor_settings_fail_in_one_line(tmp_path, capsys):
    from pagesim.cli import main

    with pytest.raises(ValueError, match="executor must be one of"):
        run_tasks(len, [("ab",)], executor="threads")
    code = main(["sweep", "--num-requests", "10", "--rates", "1", "--ray-address", "head:6379",
                 "--out", str(tmp_path / "s")])
    assert code == 2
    assert capsys.readouterr().err.strip() == "pagesim sweep: error: a Ray address applies to --executor ray only"


def test_seeds_past_the_largest_seed_fail_in_one_line():
    with pytest.raises(ValueError, match=r"--seeds 2 from --seed 4294967295 goes past"):
        seed_workloads(_workload, 2**32 - 1, 2)


def test_progress_bar_on_request_only(capsys):
    run_tasks(len, [("ab",), ("abc",)], progress=True)
    assert "simulations" in capsys.readouterr().err
    run_tasks(len, [("ab",), ("abc",)])  # stderr is not a terminal under pytest
    assert capsys.readouterr().err == ""


def test_ci_table_is_the_t_interval_over_seeds_bounded_where_the_metric_is():
    table = pd.DataFrame({"policy": ["a"] * 3 + ["b"], "rate": [1.0] * 4, "seed": [0, 1, 2, 0],
                          "latency": [1.0, 2.0, 3.0, 5.0], "meets": [True, False, True, True],
                          "answer": [4, None, 6, None], "error": [-1.0, 0.5, 2.0, 0.0]})
    summary = ci_table(table, ["policy", "rate"])
    a, b = summary.iloc[0], summary.iloc[1]
    assert list(summary.columns) == ["policy", "rate", "seeds"] + [
        f"{m}{s}" for m in ("latency", "meets", "answer", "error") for s in ("", "_ci95_low", "_ci95_high")]
    assert (a.seeds, b.seeds) == (3, 1)
    half = 4.302653 / np.sqrt(3)  # t(0.975, 2) * s / sqrt(n)
    # a latency cannot be negative: the interval stops at 0
    assert a.latency == 2.0 and a.latency_ci95_low == 0.0 and a.latency_ci95_high == pytest.approx(2 + half)
    # a share stays inside [0, 1] (the t interval alone gives -0.77 .. 2.1)
    assert a.meets == pytest.approx(2 / 3) and (a.meets_ci95_low, a.meets_ci95_high) == (0.0, 1.0)
    answer_half = 12.7062 * np.std([4, 6], ddof=1) / np.sqrt(2)
    assert a.answer == 5.0 and a.answer_ci95_high == pytest.approx(5 + answer_half, rel=1e-4)
    # a signed metric is not clipped
    err_half = 4.302653 * np.std([-1.0, 0.5, 2.0], ddof=1) / np.sqrt(3)
    assert a.error_ci95_low == pytest.approx(0.5 - err_half) and a.error_ci95_low < -1
    assert b.latency == 5.0 and np.isnan(b.latency_ci95_low) and np.isnan(b.answer)


def test_seeded_sweep_repeats_the_plain_one_at_its_first_seed():
    base = SimConfig(num_gpu_blocks=300)
    plain, _ = sweep(_workload(0), base, ["vllm", "orca-max"], [2.0, 6.0])
    assert "seed" not in plain
    seeded, memory = sweep(seed_workloads(_workload, 0, 2), base, ["vllm", "orca-max"], [2.0, 6.0])
    assert len(seeded) == 2 * len(plain) and sorted(seeded.seed.unique()) == [0, 1]
    first = seeded[seeded.seed == 0].drop(columns="seed").reset_index(drop=True)
    pd.testing.assert_frame_equal(_no_wall(first), _no_wall(plain), check_exact=True)
    # other seeds draw other workloads: their rows differ
    assert not seeded[seeded.seed == 1].throughput.reset_index(drop=True).equals(plain.throughput)
    assert set(memory) == {"vllm", "orca-max"}


def test_seeds_on_the_cli_write_a_summary_and_one_seed_writes_todays_table(tmp_path, capsys):
    from pagesim.cli import main

    common = ["sweep", "--num-requests", "20", "--rates", "2", "4", "--policies", "vllm", "orca-max",
              "--num-gpu-blocks", "300"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    one = pd.read_csv(tmp_path / "one" / "sweep.csv")
    plain, _ = sweep(resolve_trace("sharegpt-like", num_requests=20, rate=2.0, seed=0), SimConfig(num_gpu_blocks=300),
                     ["vllm", "orca-max"], [2.0, 4.0])
    pd.testing.assert_frame_equal(_no_wall(one), _no_wall(plain), check_dtype=False)
    assert not (tmp_path / "one" / "sweep_summary.csv").exists()

    assert main([*common, "--seeds", "3", "--out", str(tmp_path / "three")]) == 0
    summary = pd.read_csv(tmp_path / "three" / "sweep_summary.csv")
    assert len(summary) == 4 and (summary.seeds == 3).all()
    assert {"mean_normalized_latency", "mean_normalized_latency_ci95_low", "throughput_ci95_high"} <= set(summary.columns)
    assert (summary.mean_normalized_latency_ci95_low < summary.mean_normalized_latency).all()
    assert (summary.mean_normalized_latency < summary.mean_normalized_latency_ci95_high).all()
    assert "mean [95% t interval] over 3 seeds" in capsys.readouterr().out
