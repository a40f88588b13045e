"""Recompute vs swap (analysis/preemption.py and `pagesim preemption`)."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.preemption import crossover, end_to_end, microbenchmark
from pagesim.cli import main as cli_main
from sim.cost_model import RooflineCostModel
from sim.run import SimConfig
from sim.specs import get_hardware, get_model
from traces import resolve_trace


@pytest.fixture
def roof() -> RooflineCostModel:
    return RooflineCostModel(get_model("opt-13b"), get_hardware("a100-40gb"))


def test_swap_cost_falls_with_block_size_and_recompute_does_not_depend_on_it(roof):
    m = microbenchmark(roof, (1, 4, 16, 64, 256), tokens=512)
    assert m.swap_ms.is_monotonic_decreasing and m.swap_ms.iloc[0] > 3 * m.swap_ms.iloc[-1]
    assert m.recompute_ms.nunique() == 1
    assert (m.swap_ms == m.swap_out_ms + m.swap_in_ms).all()
    # without call latencies, swapping would cost the same at every block size that divides the tokens
    flat = microbenchmark(RooflineCostModel(get_model("opt-13b"), get_hardware("a100-40gb"), memcpy_latency_s=0),
                          (1, 4, 16, 64, 256), tokens=512)
    assert flat.swap_ms.max() == pytest.approx(flat.swap_ms.min())
    with pytest.raises(ValueError, match="tokens"):
        microbenchmark(roof, (16,), tokens=0)


def test_crossover_is_where_swapping_stays_cheaper():
    m = pd.DataFrame({"block_size": [1, 2, 4, 8], "cheaper": ["recompute", "swap", "recompute", "swap"]})
    assert crossover(m) == 8
    m.loc[2, "cheaper"] = "swap"
    assert crossover(m) == 2
    assert crossover(m.assign(cheaper="recompute")) is None


def test_end_to_end_runs_both_modes_at_each_block_size():
    trace = resolve_trace("sharegpt-like", num_requests=80, rate=4.0, seed=0)
    table = end_to_end(trace, SimConfig(num_gpu_blocks=120), (8, 32))
    assert list(zip(table.block_size, table.preemption)) == [(8, "recompute"), (8, "swap"), (32, "recompute"),
                                                            (32, "swap")]
    assert (table.finished + table.rejected == 80).all()
    assert (table.preemptions > 0).all()  # a small cache: both modes preempt


def test_preemption_command_writes_tables_and_plot(tmp_path, capsys):
    out = tmp_path / "pre"
    assert cli_main(["preemption", "--block-sizes", "1", "16", "256", "--num-requests", "40", "--rate", "3",
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "swapping is cheaper from block size" in text
    assert len(pd.read_csv(out / "preemption_micro.csv")) == 3
    assert len(pd.read_csv(out / "preemption_e2e.csv")) == 6
    assert (out / "preemption.png").read_bytes()[:4] == b"\x89PNG"
