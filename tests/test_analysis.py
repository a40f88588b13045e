"""Sweeps, plots and reports."""

from __future__ import annotations

import pandas as pd

from analysis.report import summary_table
from analysis.sweep import max_sustainable_rate
from pagesim.cli import main as cli_main


def test_sweep_writes_table_and_figures(tmp_path, capsys):
    out = tmp_path / "sw"
    code = cli_main(["sweep", "--num-requests", "60", "--rates", "0.5", "4", "--policies", "vllm", "orca-max",
                     "--out", str(out)])
    assert code == 0
    table = pd.read_csv(out / "sweep.csv")
    # a stable order, policy then rate (as given), in the table and in the rows printed as runs finish
    assert list(zip(table.policy, table.rate)) == [("vllm", 0.5), ("vllm", 4), ("orca-max", 0.5), ("orca-max", 4)]
    # paged memory is better used than max-length reservations at the high rate
    high = table[table.rate == 4].set_index("policy")
    assert high.kv_token_state_fraction["vllm"] > high.kv_token_state_fraction["orca-max"]
    for png in ("latency_vs_rate.png", "serving.png", "memory_breakdown.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "highest swept rate" in printed
    rows = [line.split()[:2] for line in printed.splitlines() if line.split()[:1] in (["vllm"], ["orca-max"])]
    assert rows[:4] == [["vllm", "0.50"], ["vllm", "4.00"], ["orca-max", "0.50"], ["orca-max", "4.00"]]


def test_max_sustainable_rate():
    t = pd.DataFrame({"policy": ["a", "a", "a", "b", "b"], "rate": [1, 2, 3, 1, 2],
                      "mean_normalized_latency": [0.1, 0.5, 2.0, 3.0, 4.0]})
    best = max_sustainable_rate(t, 1.0)
    assert best["a"] == 2
    assert best["b"] != best["b"]  # NaN: never under the limit


def test_summary_table_side_by_side():
    s = {"num_finished": 10, "request_throughput": 1.5, "ttft": {"mean": 0.1, "p90": 0.2}}
    text = summary_table({"vllm": s, "orca": {**s, "request_throughput": 0.5}})
    assert "1.500" in text and "0.500" in text and "0.100 / 0.200" in text


def test_sharing_meter_counts_shared_blocks_once():
    # a prompt of two full blocks forked into two samples: 4 table entries, 2 physical blocks
    from analysis.sharing import SharingMeter
    from policies import Request, SamplingParams
    from policies.plan import SeqOutcome, StepResult
    from policies.vllm_scheduler import VllmScheduler

    s = VllmScheduler(num_gpu_blocks=10, block_size=4, watermark=0.0)
    s.add_request(Request(0, 0.0, 8, SamplingParams(max_tokens=5, n=2), output_len=5))
    plan = s.schedule(0.0)
    (sid,) = [x.seq_id for x in plan.seqs]
    s.on_step_done(plan, StepResult(1.0, {sid: SeqOutcome(sid, 1, children=[2])}), 1.0)
    meter = SharingMeter()
    meter(1.0, 2.0, s)
    assert (meter.logical, meter.physical) == (8.0, 4.0) and meter.saving == 0.5


def test_sharing_cli_reports_savings(tmp_path, capsys):
    out = tmp_path / "sh"
    code = cli_main(["sharing", "--num-requests", "60", "--rates", "5", "--n", "1", "2", "--beam-width", "3",
                     "--out", str(out)])
    assert code == 2  # a width of 1 is not sharing
    assert "widths >= 2" in capsys.readouterr().err
    code = cli_main(["sharing", "--num-requests", "60", "--rates", "5", "--n", "2", "--beam-width", "3",
                     "--out", str(out)])
    assert code == 0
    t = pd.read_csv(out / "sharing.csv").set_index("decoding")
    assert 0 < t.saving["parallel sampling"] < t.saving["beam search"] < 1


def test_sweep_applies_vllm_options_to_vllm_runs_only(tmp_path, capsys):
    code = cli_main(["sweep", "--num-requests", "40", "--rates", "2", "--policies", "vllm", "orca-max",
                     "--chunked-prefill", "--prefix-caching", "--out", str(tmp_path / "sw")])
    assert code == 0
    out = capsys.readouterr().out
    assert "--chunked-prefill --prefix-caching: vllm runs only" in out
    assert len(pd.read_csv(tmp_path / "sw" / "sweep.csv")) == 2


def test_sweep_with_the_shipped_profile_prices_iterations_from_it(tmp_path, capsys):
    from sim.profiled import ProfiledCostModel

    out = tmp_path / "swp"
    code = cli_main(["sweep", "--model", "smollm2-135m", "--profile", "smollm2-135m-cpu", "--num-gpu-blocks", "256",
                     "--num-requests", "30", "--rates", "1", "--policies", "vllm", "--out", str(out)])
    assert code == 0
    assert "profile smollm2-135m-cpu" in capsys.readouterr().out
    table = pd.read_csv(out / "sweep.csv")
    assert len(table) == 1 and table.rejected.iloc[0] == 0 and table.throughput.iloc[0] > 0
    # a CPU-measured step is tens of milliseconds: far slower than the A100 roofline's
    model = ProfiledCostModel.from_profile("smollm2-135m-cpu")
    assert model.decode_step_time(1, 100) > 0.03
    assert table.tpot_p90.iloc[0] > model.decode_step_time(1, 100) * 0.9


def test_sweep_over_replicas_behind_a_router(tmp_path, capsys):
    # the same 80 requests at 6 req/s: two least-loaded replicas keep latency below one replica's
    rows = {}
    for replicas in (1, 2):
        out = tmp_path / f"sw{replicas}"
        code = cli_main(["sweep", "--num-requests", "80", "--rates", "6", "--policies", "vllm", "orca-max",
                         "--replicas", str(replicas), "--router", "least-loaded", "--out", str(out)])
        assert code == 0
        rows[replicas] = pd.read_csv(out / "sweep.csv").set_index("policy")
    assert "2 replicas (least-loaded)" in capsys.readouterr().out
    for policy in ("vllm", "orca-max"):
        assert rows[2].mean_normalized_latency[policy] < rows[1].mean_normalized_latency[policy]


def test_block_size_study_holds_capacity_and_prices_small_blocks_only_with_a_block_term(tmp_path, capsys):
    import json

    from analysis.block_size import best_block_sizes, block_size_sweep
    from sim.profiled import FEATURES
    from sim.run import SimConfig
    from traces import resolve_trace

    # short requests (Alpaca-like) in a small cache: a 256-token block holds one request and wastes
    # most of itself; one-token blocks pay the block term on every token of context
    trace = resolve_trace("alpaca-like", num_requests=150, rate=20.0, seed=1)
    coef = {"base": 0.004, "tokens": 2e-4, "sampled": 1e-4, "prefill_attn_pairs": 1e-9,
            "decode_context_tokens": 2e-7, "decode_blocks": 4e-6}
    profile = {"format": "pagesim-profile", "version": 1, "model": {"name": "smollm2-135m"}, "block_size": 16,
               "fit": {"coef": {k: coef.get(k, 0.0) for k in FEATURES}}, "measurements": []}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    base = SimConfig(model="smollm2-135m", cost_model="profiled", profile=str(path))
    table = block_size_sweep(trace, base, (1, 16, 256), (20.0,), kv_tokens=2048)
    t = table.set_index("block_size")
    assert (t.num_gpu_blocks * t.index).tolist() == [2048, 2048, 2048]
    assert t.reference_decode_ms[1] > t.reference_decode_ms[16] > t.reference_decode_ms[256]  # the block term
    assert t.internal_frag[256] > 0.5 > t.internal_frag[16] > t.internal_frag[1] == 0.0
    assert best_block_sizes(table) == {20.0: [16]}
    # the study on the command line: capacity in tokens is required with a profile
    code = cli_main(["block-size", "--profile", str(path), "--model", "smollm2-135m", "--num-requests", "40",
                     "--block-sizes", "4", "16", "--rates", "2", "--out", str(tmp_path / "b")])
    assert code == 2 and "--kv-tokens" in capsys.readouterr().err
    code = cli_main(["block-size", "--profile", str(path), "--model", "smollm2-135m", "--num-requests", "40",
                     "--block-sizes", "4", "16", "--rates", "2", "--kv-tokens", "4096", "--out", str(tmp_path / "b")])
    assert code == 0 and len(pd.read_csv(tmp_path / "b" / "block_size.csv")) == 2
    assert (tmp_path / "b" / "block_size.png").read_bytes()[:4] == b"\x89PNG"
    assert "lowest mean normalized latency" in capsys.readouterr().out


def test_studies_give_the_same_tables_in_worker_processes():
    from analysis.block_size import block_size_sweep
    from analysis.capacity import capacity_table
    from analysis.routing import router_sweep
    from analysis.sharing import sharing_table
    from analysis.sweep import sweep
    from sim.run import SimConfig
    from traces import resolve_trace

    trace = resolve_trace("sharegpt-like", num_requests=60, rate=4.0, seed=2)
    base = SimConfig(num_gpu_blocks=300)
    runs = {
        "sweep": lambda jobs: sweep(trace, base, ["vllm", "orca-max"], [2.0, 6.0], jobs=jobs)[0],
        "routing": lambda jobs: router_sweep(trace, SimConfig(num_gpu_blocks=300, replicas=2),
                                             ["round-robin", "least-loaded"], [4.0, 8.0], jobs=jobs),
        "block size": lambda jobs: block_size_sweep(trace, base, (8, 16, 32), (4.0,), kv_tokens=4096, jobs=jobs),
        "capacity": lambda jobs: capacity_table(trace, SimConfig(num_gpu_blocks=300, slo_ttft=1.0),
                                                ["round-robin", "least-loaded"], [6.0], jobs=jobs)[1],
        "sharing": lambda jobs: sharing_table(resolve_trace("alpaca-like", num_requests=40, rate=4.0, seed=0), base,
                                              [4.0], [("n", 2), ("beam", 2)], jobs=jobs),
    }
    for name, run in runs.items():
        serial, parallel = run(1), run(2)
        drop = [c for c in ("wall_s",) if c in serial]
        pd.testing.assert_frame_equal(serial.drop(columns=drop), parallel.drop(columns=drop), check_exact=True,
                                      obj=name)


def test_run_tasks_rejects_no_workers():
    import pytest

    from analysis.parallel import run_tasks
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        run_tasks(len, [("ab",)], jobs=0)
    assert run_tasks(len, [("ab",), ("abc",)], jobs=2) == [2, 3]


def test_columns_lay_out_header_and_rows_from_one_spec():
    from analysis.report import Columns

    cols = Columns(("policy", "policy", "<12"), ("rate", "rate", ">6.2f"), ("blocks", "n", ">8,"), ("hit", "h", ">6.1%"))
    assert cols.header() == f"{'policy':<12} {'rate':>6} {'blocks':>8} {'hit':>6}"
    row = cols.row({"policy": "vllm", "rate": 1.5, "n": 12345, "h": 0.25})
    assert row == "vllm           1.50   12,345  25.0%" and len(row) == len(cols.header())


def test_columns_widen_to_the_longest_name_so_plug_in_routers_stay_aligned():
    from analysis.report import Columns

    cols = Columns(("router", "router", "<16"), ("rate", "rate", ">6.2f"))
    long = "my_routers.module:ShortestQueue"
    wide = cols.widened("router", ["least-loaded", long])
    header = wide.header()
    assert header.index("rate") == len(long) + 1 + 2  # "rate" right-aligned in its 6 characters
    for name in ("least-loaded", long):
        row = wide.row({"router": name, "rate": 2.0})
        assert len(row) == len(header) and row.endswith("  2.00")
    # short names keep the default width; other columns are untouched
    assert cols.widened("router", ["vllm"]).header() == cols.header()
    assert cols.widened("rate", ["x" * 9]).row({"router": "a", "rate": 1.0}).endswith("     1.00")


def _sleep_then(k: int, seconds: float) -> int:
    import time
    time.sleep(seconds)
    return k


def test_run_tasks_reports_in_task_order_whatever_finishes_first():
    from analysis.parallel import run_tasks
    seen = []
    # the first task finishes last: its row still comes first, the others right after it
    results = run_tasks(_sleep_then, [(0, 0.6), (1, 0.0), (2, 0.0), (3, 0.0)], jobs=2,
                        on_done=lambda i, r: seen.append((i, r)))
    assert results == [0, 1, 2, 3] and seen == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_saturation_is_where_achieved_throughput_falls_behind_the_offered_rate():
    import numpy as np
    import pandas as pd

    from analysis.plots import saturation_rate
    g = pd.DataFrame({"rate": [1.0, 2.0, 3.0, 4.0], "throughput": [1.0, 1.95, 2.5, 2.6]})
    assert saturation_rate(g) == 3.0  # 2.5 < 0.9 * 3
    assert np.isnan(saturation_rate(g.assign(throughput=g.rate)))  # keeps up everywhere
    seeded = pd.DataFrame({"rate": [2.0, 2.0], "seed": [0, 1], "throughput": [1.9, 1.5]})
    assert saturation_rate(seeded) == 2.0  # the mean over seeds, 1.7, is behind


def test_titles_name_files_not_their_paths():
    import argparse

    from pagesim.cli_args import study_title
    args = argparse.Namespace(model="/somewhere/models/acme-7b/config.json", hardware="h100-sxm", profile=None,
                              calibration="/tmp/fits/my-cal.json")
    assert study_title(args) == "acme-7b on h100-sxm, calibration my-cal (client-side latencies)"
    assert study_title(argparse.Namespace(model="opt-13b", hardware="a100-40gb", profile="/p/q/cpu.json")) \
        == "opt-13b, profile cpu"


def test_policies_names_an_unknown_policy_before_printing_anything(tmp_path, capsys):
    assert cli_main(["policies", "--policies", "vllm", "nosuch", "--rates", "1", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "unknown policy 'nosuch'" in err
