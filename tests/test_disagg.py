"""Disaggregated serving (sim/disagg.py): prefill replicas, a KV link, decode replicas."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pagesim.cli import main as cli_main
from sim.run import SimConfig, run_simulation
from sim.specs import get_hardware, get_model
from traces import resolve_trace
from traces.trace import Trace


def test_every_request_is_joined_from_its_two_halves():
    tr = resolve_trace("sharegpt-like", num_requests=200, rate=8.0, seed=1)
    # 1000 blocks a replica: never filled (no preemption; the same iterations as the A100's ~30k), and
    # debug's pool check after every iteration scans 1000 blocks, not 30k (40 s of the suite)
    res = run_simulation(SimConfig(model="llama-3-8b", hardware="a100-80gb", disaggregate=(2, 3),
                                   router="least-loaded", num_gpu_blocks=1000, debug=True), tr)
    r = res.requests
    assert r.request_id.tolist() == list(range(200)) and (r.status == "finished").all()
    assert r.output_len.tolist() == tr.output_len.tolist()  # first token there, the rest here
    moved = r[r.output_len > 1]
    assert moved.transfer_s.notna().all() and set(moved.decode_replica) <= {0, 1, 2}
    assert set(moved.prefill_replica) == {0, 1}
    assert (r.first_token_time < r.finish_time).all() | (r.output_len == 1).all()
    # the decode half recomputes only the prompt's last partial block and the first token
    bs = 16
    expected = moved.prompt_len + 1 - bs * ((moved.prompt_len - 1) // bs)
    assert (moved.decode_recomputed_tokens == expected).all()
    assert set(res.iterations.pool) == {"prefill", "decode"}
    pre = res.iterations[res.iterations.pool == "prefill"]
    assert (pre.decode_tokens == 0).all()  # prefill replicas never decode: each request leaves after one token
    assert res.summary["disaggregated"]["transfers"] == len(moved)
    assert r.num_preemptions.sum() == 0


def test_transfer_time_is_bytes_over_bandwidth_and_a_slow_link_queues():
    tr = Trace(arrival=np.array([0.0, 0.0, 0.0]), prompt_len=np.array([1000, 1000, 1000]),
               output_len=np.array([5, 5, 5]), name="three")
    model, hw = get_model("llama-3-8b"), get_hardware("a100-80gb")
    # the three are prefilled in one iteration, so their transfers queue on the one link
    fast = run_simulation(SimConfig(model="llama-3-8b", hardware="a100-80gb", disaggregate=(1, 1)), tr).requests
    nvlink = 1000 * model.kv_bytes_per_token / hw.interconnect_bandwidth
    assert sorted(fast.transfer_s) == pytest.approx([nvlink, 2 * nvlink, 3 * nvlink])
    # 1 GB/s: each 128 MB transfer takes 0.13 s
    slow = run_simulation(SimConfig(model="llama-3-8b", hardware="a100-80gb", disaggregate=(1, 1),
                                    transfer_bandwidth=1e9), tr).requests
    one = 1000 * model.kv_bytes_per_token / 1e9
    assert sorted(slow.transfer_s) == pytest.approx([one, 2 * one, 3 * one])
    assert slow.ttft.tolist() == fast.ttft.tolist()  # the first token does not wait for the link
    assert (slow.e2e_latency > fast.e2e_latency).all()


def test_a_small_decode_cache_recomputes_what_it_evicted():
    tr = resolve_trace("sharegpt-like", num_requests=150, rate=40.0, seed=2)
    roomy = run_simulation(SimConfig(model="llama-3-8b", hardware="a100-80gb", disaggregate=(1, 1)), tr).summary
    tight = run_simulation(SimConfig(model="llama-3-8b", hardware="a100-80gb", disaggregate=(1, 1),
                                     num_gpu_blocks=200, debug=True), tr).summary
    assert tight["num_finished"] + tight["num_rejected"] == 150
    assert tight["disaggregated"]["decode_recomputed_tokens"] > 2 * roomy["disaggregated"]["decode_recomputed_tokens"]


def test_one_token_requests_never_leave_the_prefill_replica():
    tr = Trace(arrival=np.array([0.0, 0.1]), prompt_len=np.array([50, 60]), output_len=np.array([1, 3]), name="t")
    r = run_simulation(SimConfig(model="llama-3-8b", disaggregate=(1, 1)), tr).requests.set_index("request_id")
    assert np.isnan(r.transfer_s[0]) and r.finish_time[0] == r.first_token_time[0] and r.output_len[0] == 1
    assert r.transfer_s[1] > 0 and r.output_len[1] == 3


def test_bad_disaggregated_configs_are_clear_errors():
    tr = resolve_trace("sharegpt-like", num_requests=5, rate=1.0, seed=0)
    for kw, match in (({"disaggregate": (0, 2)}, "at least one prefill"),
                      ({"disaggregate": (1, 1), "policy": "orca-max"}, "'vllm' policy only"),
                      ({"disaggregate": (1, 1), "n": 2}, "parallel sampling"),
                      ({"disaggregate": (1, 1), "replicas": 3}, "replica counts there"),
                      ({"disaggregate": (1, 1), "transfer_bandwidth": 0.0}, "transfer_bandwidth")):
        with pytest.raises(ValueError, match=match):
            run_simulation(SimConfig(**kw), tr)


def test_cli_simulate_disaggregated(tmp_path, capsys):
    out = tmp_path / "d"
    rc = cli_main(["simulate", "--num-requests", "40", "--rate", "4", "--model", "llama-3-8b", "--disaggregate", "1",
                   "2", "--transfer-bandwidth", "25", "--out", str(out), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "1 prefill + 2 decode" in text and "25 GB/s" in text
    reqs = pd.read_csv(out / "requests.csv")
    assert len(reqs) == 40 and {"prefill_replica", "decode_replica", "transfer_s"} <= set(reqs.columns)
    with pytest.raises(SystemExit):  # argparse names the flag and the unit
        cli_main(["simulate", "--disaggregate", "1", "1", "--transfer-bandwidth", "0", "--out", str(out)])
    assert "--transfer-bandwidth: must be > 0 GB/s" in capsys.readouterr().err


def test_disagg_study_compares_every_split_with_colocated(tmp_path, capsys):
    from analysis.disagg import disagg_study, setups

    assert [n for n, _ in setups(3)] == ["colocated", "1+2", "2+1"]
    with pytest.raises(ValueError, match="adding up to 4"):
        setups(4, [(1, 2)])
    tr = resolve_trace("sharegpt-like", num_requests=60, rate=4.0, seed=0)
    base = SimConfig(model="llama-3-8b", hardware="a100-80gb", router="least-loaded")
    table = disagg_study(tr, base, 3, [4.0, 8.0])
    assert list(zip(table.setup, table.rate)) == [(s, r) for s in ("colocated", "1+2", "2+1") for r in (4.0, 8.0)]
    assert table.throughput.gt(0).all() and table.tpot_p90.gt(0).all()
    # the same table from worker processes
    pd.testing.assert_frame_equal(table.drop(columns="wall_s"),
                                  disagg_study(tr, base, 3, [4.0, 8.0], jobs=2).drop(columns="wall_s"))
    out = tmp_path / "dg"
    assert cli_main(["disagg", "--num-requests", "40", "--rates", "4", "--gpus", "2", "--out", str(out)]) == 0
    assert len(pd.read_csv(out / "disagg.csv")) == 2 and (out / "disagg.png").stat().st_size > 0
    assert cli_main(["disagg", "--num-requests", "10", "--rates", "4", "--splits", "2-2", "--out", str(out)]) == 2
    assert "PREFILL+DECODE" in capsys.readouterr().err
