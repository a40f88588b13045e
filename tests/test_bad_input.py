"""Bad input gets a clear one-line error (file and line for data, the flag for arguments), never a
traceback, a silent replacement or an error after the run; every input request gets a result row.
Issue 11, last section: each test here failed before its fix."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import policies.limits
from pagesim.cli import main
from policies.trace_requests import requests_from_trace
from sim.run import SimConfig, run_simulation
from traces import apply_arrivals, load_trace
from traces.loaders import TraceFormatError
from traces.trace import Trace

# ---------------------------------------------------------------- trace files


def write(path, text: str | bytes):
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_mooncake_length_too_large_for_int64_names_the_line(tmp_path):
    path = write(tmp_path / "m.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                                      '{"timestamp": 1, "input_length": 1e20, "output_length": 5}\n')
    with pytest.raises(TraceFormatError, match=r"m.jsonl: line 2: field 'input_length' = 1e\+20 is too large"):
        load_trace(path)


def test_csv_length_beyond_int64_names_file_and_line_azure(tmp_path):
    # 2**63 wrapped to -2**63 in the int64 cast; the error then named neither file nor line
    path = write(tmp_path / "az.csv", AZURE + "2023-11-16 18:15:46.6805900,10,5\n"
                                             "2023-11-16 18:15:47.0,9223372036854775808,5\n")
    with pytest.raises(TraceFormatError, match=r"az.csv: line 3: column 'ContextTokens': length "
                                                r"9223372036854775808 is too large"):
        load_trace(path)


def test_csv_length_beyond_int64_names_the_line_pagesim(tmp_path):
    path = write(tmp_path / "p.csv", "prompt_len,output_len\n10,5\n11,18446744073709551616\n")
    with pytest.raises(TraceFormatError, match=r"p.csv: line 3: column 'output_len': length .* is too large"):
        load_trace(path)


def test_trace_refuses_values_beyond_int64_instead_of_wrapping():
    with pytest.raises(ValueError, match="beyond int64"):
        Trace(arrival=[0.0], prompt_len=np.array([2.0**63]), output_len=[1])


@pytest.mark.parametrize("name", ["t.jsonl", "t.csv"])
def test_non_utf8_byte_names_the_line(tmp_path, name):
    if name.endswith(".jsonl"):
        text = (b'{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                b'{"timestamp": 1, "input_length": 10, "output_length": 5, "note": "\xff"}\n')
    else:
        text = b"prompt_len,output_len,note\n10,5,a\n11,6,\xfe\n"
    path = write(tmp_path / name, text)
    with pytest.raises(TraceFormatError, match=rf"{name}: line [23]: byte 0x(ff|fe) at column \d+ is not UTF-8"):
        load_trace(path)


@pytest.mark.parametrize("second", ["2023-11-16 18:15:47.0+01:00", "2023-11-16T18:15:47Z"])
def test_azure_mixed_time_zones_name_the_line(tmp_path, second):
    first = "2023-11-16 18:15:46.6805900" if second.endswith("Z") else "2023-11-16 18:15:46.6805900+00:00"
    path = write(tmp_path / "az.csv", AZURE + f"{first},10,5\n{second},10,5\n")
    with pytest.raises(TraceFormatError, match=r"az.csv: line 3: column 'TIMESTAMP': .* time zone"):
        load_trace(path)


def test_azure_one_time_zone_throughout_still_loads(tmp_path):
    path = write(tmp_path / "az.csv", AZURE + "2023-11-16T18:15:46Z,10,5\n2023-11-16 18:15:48+00:00,10,5\n")
    assert list(load_trace(path).arrival) == [0.0, 2.0]


# ---------------------------------------------------------------- BurstGPT failed requests

# two failed requests (0 response tokens; 0 of both), one of each log type
BURSTGPT = (Path(__file__).parent / "data" / "burstgpt_failed_requests.csv").read_text()


def burstgpt(tmp_path):
    path = write(tmp_path / "BurstGPT_1.csv", BURSTGPT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return path, load_trace(path)


def test_burstgpt_zero_token_rows_are_rejected_rows_of_the_run(tmp_path):
    _, trace = burstgpt(tmp_path)
    result = run_simulation(SimConfig(), trace)
    req = result.requests
    assert list(req.request_id) == [0, 1, 2, 3, 4]  # one row per input request
    assert list(req.status) == ["finished", "rejected", "finished", "rejected", "finished"]
    assert req.reject_reason[1] == "zero response tokens in the trace (BurstGPT_1.csv line 3)"
    assert req.reject_reason[3] == "zero request and response tokens in the trace (BurstGPT_1.csv line 5)"
    assert list(req.prompt_len) == [472, 1087, 417, 0, 1360]
    assert result.summary["num_requests"] == 5 and result.summary["num_rejected"] == 2


def test_burstgpt_rejected_rows_reach_requests_csv_and_summary(tmp_path, capsys):
    path, _ = burstgpt(tmp_path)
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["simulate", "--trace", str(path), "--quiet", "--out", str(out)]) == 0
    rows = pd.read_csv(out / "requests.csv", keep_default_na=False)
    assert len(rows) == 5 and (rows.status == "rejected").sum() == 2
    assert rows.reject_reason[1].startswith("zero response tokens")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] == 5 and summary["num_rejected"] == 2


def test_rejected_rows_survive_head_and_the_pagesim_format(tmp_path):
    _, trace = burstgpt(tmp_path)
    assert trace.head(2).reject_reason == ["", trace.reject_reason[1]]
    again = load_trace(trace.save(tmp_path / "again.csv"))
    assert again.reject_reason == trace.reject_reason
    np.testing.assert_array_equal(again.prompt_len, trace.prompt_len)


def test_pagesim_zero_length_without_a_reason_is_refused(tmp_path):
    path = write(tmp_path / "p.csv", "prompt_len,output_len,reject_reason\n10,5,\n0,5,failed upstream\n12,0,\n")
    with pytest.raises(TraceFormatError, match=r"p.csv: line 4: column 'output_len': zero length without a "
                                                r"reject_reason"):
        load_trace(path)


def test_requests_from_trace_marks_rejected_rows():
    trace = Trace(arrival=[0.0, 1.0], prompt_len=[5, 0], output_len=[3, 0], reject_reason=["", "broken"])
    reqs = requests_from_trace(trace, 2048)
    assert [r.reject_reason for r in reqs] == [None, "broken"]


# ---------------------------------------------------------------- SimConfig (library users)


@pytest.mark.parametrize("field, value, flag", [
    ("num_gpu_blocks", 0, "--num-gpu-blocks"),  # was silently replaced by the derived capacity
    ("slo_ttft", -1.0, "--slo-ttft"),
    ("slo_tpot", float("nan"), "--slo-tpot"),
    ("seed", -1, "--seed"),
    ("seed", 2**32, "--seed"),
    ("tp", 3, "--tp"),  # OPT-13B has 40 heads
])
def test_sim_config_refuses_values_no_run_can_use(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        SimConfig(**{field: value})


def test_tp_must_divide_the_heads():
    with pytest.raises(ValueError, match=r"40 attention heads .* use one of 1, 2, 4, 5, 8, 10, 20, 40"):
        SimConfig(model="opt-13b", tp=3)
    assert SimConfig(model="opt-13b", tp=8).tp == 8


def test_a_cache_too_large_for_memory_is_refused_with_the_estimate(monkeypatch):
    monkeypatch.setattr(policies.limits, "available_memory", lambda: 64 * 2**30)
    with pytest.raises(ValueError, match=r"1,000,000,000 GPU blocks \(--num-gpu-blocks\).* at least 223\.5 GiB "
                                         r".* 64\.0 GiB is available"):
        SimConfig(num_gpu_blocks=1_000_000_000)
    with pytest.raises(ValueError, match="on each of 4 replicas"):
        SimConfig(num_gpu_blocks=100_000_000, replicas=4)
    assert SimConfig(num_gpu_blocks=100_000_000).num_gpu_blocks == 100_000_000  # 22 GiB fits


def test_too_many_requests_for_memory_are_refused(monkeypatch):
    monkeypatch.setattr(policies.limits, "available_memory", lambda: 10_000)
    monkeypatch.setattr(policies.limits, "_NOT_WORTH_CHECKING", 0)
    trace = Trace(arrival=np.zeros(10), prompt_len=np.ones(10), output_len=np.ones(10))
    with pytest.raises(ValueError, match=r"10 requests: .* at least 14,000 B of memory, but 10,000 B is available"):
        requests_from_trace(trace, 2048)


def test_a_tiny_rate_is_refused_by_the_library():
    trace = Trace(arrival=np.zeros(3), prompt_len=[1, 2, 3], output_len=[1, 1, 1], has_timestamps=False)
    with pytest.raises(ValueError, match="rate 1e-320 is too small"):
        apply_arrivals(trace, rate=1e-320)
    # a rate whose gap is finite but whose arrivals leave float64 no resolution (was: TTFT 0 in the results)
    with pytest.raises(ValueError, match="rate 1e-300 is too small for 3 requests: the last would arrive at"):
        apply_arrivals(trace, rate=1e-300)
    with pytest.raises(ValueError, match=r"arrival\[0\] = 1e\+300 s is beyond 2\*\*32 s"):
        Trace(arrival=[1e300], prompt_len=[1], output_len=[1])


# ---------------------------------------------------------------- the command line

# every command with a directory --out, with the arguments it needs besides
OUT_COMMANDS = {
    "simulate": [], "live": [], "validate": ["--profile", "p"], "demo": [], "sweep": [], "sharing": [],
    "routing": [], "capacity": ["--slo-ttft", "1"], "disagg": [], "block-size": [], "preemption": [],
    "policies": ["--rates", "1"], "fidelity": ["--measurements", "m.json"],
}
SEED_COMMANDS = ["simulate", "live", "validate", "sweep", "sharing", "routing", "capacity", "disagg",
                 "block-size", "preemption", "profile", "generate", "beams", "fidelity", "calibrate"]


def parse_error(argv, capsys) -> str:
    """The one line argparse printed for a refused argument (exit code 2)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(lines) == 1
    return lines[0]


def run_error(argv, capsys) -> str:
    """The one line main() printed for a refused value (exit code 2), no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("command", list(OUT_COMMANDS))
def test_out_naming_an_existing_file_is_refused_before_anything_runs(tmp_path, capsys, command):
    existing = write(tmp_path / "results", "not a directory")
    line = parse_error([command, *OUT_COMMANDS[command], "--out", str(existing)], capsys)
    assert f"pagesim {command}: error: argument --out: {existing} names an existing file" in line


def test_out_below_an_existing_file_is_refused(tmp_path, capsys):
    existing = write(tmp_path / "results", "x")
    line = parse_error(["simulate", "--out", str(existing / "run1")], capsys)
    assert "is inside" in line and "an existing file" in line


def test_out_may_be_an_existing_directory(tmp_path, capsys):
    assert main(["simulate", "--num-requests", "3", "--rate", "1", "--quiet", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "requests.csv").is_file()


@pytest.mark.parametrize("argv, flag, says", [
    (["--num-gpu-blocks", "0"], "--num-gpu-blocks", "must be an integer >= 1"),
    (["--slo-ttft", "-1"], "--slo-ttft", "must be a finite number > 0"),
    (["--seed", "-1"], "--seed", "[0, 2**32)"),
    (["--rate", "1e-320"], "--rate", "too small"),
    (["--rate", "inf"], "--rate", "finite"),
    (["--num-requests", "0"], "--num-requests", "must be an integer >= 1"),
    (["--tp", "0"], "--tp", "must be an integer >= 1"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization", "(0, 1]"),
    (["--block-size", "x"], "--block-size", "expected an integer"),
])
def test_simulate_refuses_bad_arguments_in_one_line(tmp_path, capsys, argv, flag, says):
    line = parse_error(["simulate", "--out", str(tmp_path / "o"), *argv], capsys)
    assert line.startswith(f"pagesim simulate: error: argument {flag}") and says in line


@pytest.mark.parametrize("command", SEED_COMMANDS)
def test_every_command_refuses_a_negative_seed(capsys, command):
    assert "argument --seed: must be an integer in [0, 2**32)" in parse_error([command, "--seed", "-1"], capsys)


@pytest.mark.parametrize("command", ["sweep", "sharing", "routing", "capacity", "disagg", "block-size", "policies"])
def test_every_study_refuses_a_tiny_rate_and_a_zero_cache(capsys, command):
    assert "argument --rates: 1e-320 req/s is too small" in parse_error([command, "--rates", "1", "1e-320"], capsys)
    assert "argument --num-gpu-blocks" in parse_error([command, "--num-gpu-blocks", "0"], capsys)


def test_tp_that_does_not_divide_the_heads_names_the_flag(tmp_path, capsys):
    err = run_error(["simulate", "--tp", "3", "--num-requests", "2", "--rate", "1", "--out", str(tmp_path / "o")],
                    capsys)
    assert err.startswith("pagesim simulate: error: tp (--tp): 3 does not divide opt-13b's 40 attention heads")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command, extra", [
    ("simulate", []), ("sweep", []), ("sharing", []), ("capacity", ["--slo-ttft", "1"]), ("disagg", []),
    ("block-size", []), ("routing", []), ("preemption", []), ("demo", []),
])
def test_too_many_requests_are_refused_up_front_with_the_estimate(tmp_path, capsys, monkeypatch, command, extra):
    monkeypatch.setattr(policies.limits, "available_memory", lambda: 64 * 2**30)
    err = run_error([command, *extra, "--num-requests", "100000000000", "--out", str(tmp_path / "o")], capsys)
    assert "--num-requests 100,000,000,000: the simulator's bookkeeping alone would need at least" in err
    assert "TiB of memory, but 64.0 GiB is available" in err


def test_a_cache_too_large_for_memory_is_refused_by_simulate(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(policies.limits, "available_memory", lambda: 64 * 2**30)
    err = run_error(["simulate", "--num-gpu-blocks", "1000000000", "--out", str(tmp_path / "o")], capsys)
    assert "1,000,000,000 GPU blocks (--num-gpu-blocks)" in err and "223.5 GiB" in err


def test_trace_generate_refuses_a_negative_seed_and_reports_memory_in_one_line(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "t.csv")
    assert main(["trace", "generate", "--kind", "fixed", "--num-requests", "3", "--seed", "-1", "--out", out]) == 2
    assert capsys.readouterr().err.strip() == "error: --seed: must be an integer in [0, 2**32), got -1"

    def too_big(*args, **kwargs):
        raise MemoryError("Unable to allocate 745. GiB for an array with shape (100000000000,)")

    monkeypatch.setattr("pagesim.commands.trace.make_synthetic", too_big)
    assert main(["trace", "generate", "--kind", "fixed", "--num-requests", "100000000000", "--out", out]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --num-requests 100,000,000,000: too large for this machine's memory") and "745" in err
