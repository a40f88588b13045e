"""Adversarial inputs to the simulator-side command line, run in-process through `pagesim.cli.main`.

Every case must end in a clean error (a non-zero exit, one stderr line naming the file, line, field
or flag; never an uncaught exception) or a documented rejection in which every input request is a
row of requests.csv and a count in summary.json. The cases marked "was:" failed before their fix.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pandas as pd
import pytest

import policies.limits
from pagesim.cli import main
from traces import load_trace, resolve_trace

HARDWARE = Path(__file__).resolve().parents[1] / "specs" / "hardware" / "a100-40gb.json"
CALIBRATION = Path(__file__).resolve().parents[1] / "sim" / "calibrations" / "vllm-v1-h100.json"
BENCH = Path(__file__).resolve().parent / "data" / "vllm_bench_serve_result.json"
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
         "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 4096,
         "torch_dtype": "bfloat16"}
TINY_RUN = ["--num-requests", "3", "--rate", "1", "--quiet"]


def write(path: Path, content: str | bytes) -> str:
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return str(path)


def clean_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a refused command; any uncaught exception fails the test by itself."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse refusing a flag
        code = exit_.code
    err = capsys.readouterr().err
    assert code not in (0, None), f"accepted: {argv}"
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------- trace files

TRACES = [
    ("empty.csv", "", "file is empty"),
    ("header.csv", "prompt_len,output_len\n", "no requests (header only"),
    ("missing.csv", "prompt_len\n5\n", "cannot detect trace format from columns ['prompt_len']"),
    ("nan.csv", "prompt_len,output_len\n5,nan\n", "line 2: column 'output_len': missing value"),
    ("inf.csv", "prompt_len,output_len\n5,inf\n", "line 2: column 'output_len': non-integer length inf"),
    ("neg.csv", "prompt_len,output_len\n-5,3\n", "line 2: column 'prompt_len': negative length -5"),
    ("semicolon.csv", "prompt_len;output_len\n5;3\n", "cannot detect trace format"),
    ("binary.csv", bytes(range(256)) * 4, "binary.csv"),
    ("ts.csv", "arrival,prompt_len,output_len\n0,5,3\nnan,5,3\n", "line 3: column 'arrival': missing value"),
    ("tsneg.csv", "arrival,prompt_len,output_len\n-1,5,3\n", "line 2: column 'arrival': timestamp -1"),
    ("junk.jsonl", "{not json}\n", "line 1: unreadable JSON"),
    ("str.jsonl", '{"timestamp": 0, "input_length": "ten", "output_length": 5}\n', "field 'input_length' = 'ten'"),
    ("nan.jsonl", '{"timestamp": NaN, "input_length": 10, "output_length": 5}\n', "field 'timestamp' = nan"),
    ("az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nnotatime,10,5\n", "line 2: column 'TIMESTAMP'"),
    ("BurstGPT_1.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                       "5,ChatGPT,-3,18,15,Conversation log\n", "line 2: column 'Request tokens': negative"),
    ("junk.parquet", b"PAR1junk", "cannot read as Parquet"),
    # the client / priority / SLO columns were dropped unread, so bad values passed silently (was: rc 0)
    ("prio.csv", "prompt_len,output_len,priority\n5,3,high\n", "line 2: column 'priority': 'high' is not a number"),
    ("prio2.csv", "prompt_len,output_len,priority\n5,3,1.5\n", "line 2: column 'priority': 1.5 is not an integer"),
    ("slo.csv", "prompt_len,output_len,slo_ttft\n5,3,\n5,3,-1\n", "line 3: column 'slo_ttft': -1, expected a finite"),
    ("tpot.csv", "prompt_len,output_len,slo_tpot\n5,3,x\n", "line 2: column 'slo_tpot': 'x'"),
    # a column of only true/false parsed as booleans and replayed as 1 / 0 (was: rc 0, a 1-token prompt)
    ("bool.csv", "prompt_len,output_len\nTrue,3\n", "line 2: column 'prompt_len': 'True' is not a number"),
    ("priobool.csv", "prompt_len,output_len,priority\n5,3,False\n", "line 2: column 'priority': 'False'"),
    ("slobool.csv", "prompt_len,output_len,slo_ttft\n5,3,true\n", "line 2: column 'slo_ttft': 'True'"),
    # pandas renamed the second 'arrival' to 'arrival.1' and the first was used (was: rc 0)
    ("twice.csv", "arrival,prompt_len,output_len,arrival\n0,5,3,1\n", "header: column(s) ['arrival'] appear more"),
    ("negid.csv", "prompt_len,output_len,prompt_token_ids\n2,3,1 -5\n", "line 2: column 'prompt_token_ids': "
                                                                      "token id -5 is negative"),
    # was "use either n > 1 (parallel sampling) or beam_width > 1, not both", naming no file or line
    ("both.csv", "prompt_len,output_len,n,beam_width\n5,3,1,4\n5,3,2,3\n", "line 3: column 'beam_width': 3 with n 2"),
    # was "request 1: ..." by index after sorting by arrival: here line 2
    ("ids.csv", "arrival,prompt_len,output_len,prompt_token_ids\n1,3,2,1 2\n0,2,2,1 2\n", "line 2: column "
                                                                                         "'prompt_token_ids': 2 ids"),
    ("hashes.csv", "arrival,prompt_len,output_len,prefix_hashes,hash_block_size\n1,10,2,1 2,16\n0,5,2,3,16\n",
     "line 2: column 'prefix_hashes': 2 hashes for prompt_len 10"),
    # float64 time at 1e300 s has no resolution left (was: rc 0, TTFT 0 and 1e12 req/s)
    ("late.csv", "arrival,prompt_len,output_len\n0,5,3\n1e300,5,3\n", "line 3: column 'arrival': timestamp 1e+300 "
                                                                     "is beyond 2**32 s"),
    ("late.jsonl", '{"timestamp": 1e20, "input_length": 10, "output_length": 5}\n', "line 1: field 'timestamp' = "
                                                                                     "1e+20 ms is beyond 2**32 s"),
]


@pytest.mark.parametrize("name, content, says", TRACES, ids=[t[0] for t in TRACES])
def test_bad_trace_file_names_the_file_and_line(tmp_path, capsys, name, content, says):
    path = write(tmp_path / name, content)
    line = clean_error(["simulate", "--trace", path, *TINY_RUN, "--out", str(tmp_path / "o")], capsys)
    assert line.startswith("pagesim simulate: error: ") and name in line and says in line
    assert not (tmp_path / "o").exists()


def test_a_directory_as_trace_is_refused(tmp_path, capsys):
    line = clean_error(["simulate", "--trace", str(tmp_path), *TINY_RUN, "--out", str(tmp_path / "o")], capsys)
    assert f"trace '{tmp_path}' is neither a synthetic workload" in line and "it is a directory" in line


def test_an_os_error_mid_command_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    # any OSError, not only a missing file (a full disk, a permission refused), was a traceback
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pagesim.commands.simulate.run_simulation", full_disk)
    line = clean_error(["simulate", "--trace", "fixed", *TINY_RUN, "--out", str(tmp_path / "o")], capsys)
    assert line == "pagesim simulate: error: [Errno 28] No space left on device"


def test_bom_and_crlf_load_like_plain_text(tmp_path):
    path = write(tmp_path / "bom.csv", "\ufeffprompt_len,output_len\r\n5,3\r\n6,2\r\n")
    assert list(load_trace(path).prompt_len) == [5, 6]
    # was: "line 1: unreadable JSON (Unexpected UTF-8 BOM)" for the same file as JSON lines
    path = write(tmp_path / "bom.jsonl", '\ufeff{"timestamp": 0, "input_length": 5, "output_length": 3}\r\n'
                                         '{"timestamp": 9, "input_length": 6, "output_length": 2}\r\n')
    assert list(load_trace(path).prompt_len) == [5, 6]


def test_client_priority_and_slo_survive_a_save_and_load(tmp_path):
    # was: load_trace dropped them, so priority / vtc / edf ran a saved multi-client trace classless
    trace = resolve_trace("multi-client", num_requests=40, rate=2.0, seed=3)
    for suffix in (".csv", ".parquet"):
        again = load_trace(trace.save(tmp_path / f"t{suffix}"))
        assert again.client == trace.client and len(set(again.client)) > 1
        assert list(again.priority) == list(trace.priority)
        assert list(again.slo_ttft) == list(trace.slo_ttft) and list(again.slo_tpot) == list(trace.slo_tpot)


def test_unsorted_classes_stay_with_their_requests(tmp_path):
    path = write(tmp_path / "u.csv", "arrival,prompt_len,output_len,client,priority,slo_ttft\n"
                                     "2,7,3,b,1,\n1,5,3,a,0,0.5\n")
    with pytest.warns(UserWarning, match="not sorted"):
        trace = load_trace(path)
    assert list(trace.prompt_len) == [5, 7] and trace.client == ["a", "b"] and list(trace.priority) == [0, 1]
    assert trace.slo_ttft[0] == 0.5 and pd.isna(trace.slo_ttft[1])


# ---------------------------------------------------------------- model config.json


def config(tmp_path: Path, name: str, **changes) -> str:
    cfg = {k: v for k, v in {**LLAMA, **changes}.items() if v is not None}
    return write(tmp_path / name, json.dumps(cfg))


@pytest.mark.parametrize("changes, says", [
    ({"architectures": ["FooForCausalLM"], "model_type": "foo"}, "model_type 'foo'"),
    ({"hidden_size": None}, "hidden_size: missing"),
    ({"num_hidden_layers": 0}, "num_hidden_layers: must be an int >= 1, got 0"),
    ({"num_attention_heads": -4}, "num_attention_heads: must be an int >= 1, got -4"),
    ({"num_attention_heads": 30}, "hidden_size 4096 is not a multiple of num_attention_heads 30"),
    ({"num_key_value_heads": 5}, "num_heads 32 is not a multiple of num_kv_heads 5"),
    ({"hidden_size": "4096"}, "hidden_size: must be an int >= 1, got '4096'"),
    ({"torch_dtype": "int3"}, "torch_dtype: unknown dtype 'int3'"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
      "num_experts_per_tok": 10}, "num_experts_per_tok (experts_per_token): must be in 1..num_experts 8"),
])
def test_bad_model_config_names_the_file_and_field(tmp_path, capsys, changes, says):
    path = config(tmp_path, "m.json", **changes)
    line = clean_error(["simulate", "--model", path, *TINY_RUN, "--out", str(tmp_path / "o")], capsys)
    assert f"error: {path}: " in line and says in line


@pytest.mark.parametrize("text, says", [
    ("[1, 2]", "expected a JSON object (a HF config.json), got a JSON list"),  # was: AttributeError
    ("{", "line 1: not valid JSON"),
    ("", "line 1: not valid JSON"),
])
def test_model_config_that_is_not_an_object(tmp_path, capsys, text, says):
    path = write(tmp_path / "c.json", text)
    line = clean_error(["simulate", "--model", path, *TINY_RUN, "--out", str(tmp_path / "o")], capsys)
    assert f"error: {path}: {says}" in line


def test_unknown_model_lists_the_known_ones(tmp_path, capsys):
    line = clean_error(["simulate", "--model", "acme/NoSuch-7b", *TINY_RUN, "--out", str(tmp_path / "o")], capsys)
    assert "unknown model 'acme/NoSuch-7b'" in line and "known: " in line


# ---------------------------------------------------------------- hardware JSON


def hardware(tmp_path: Path, text: str) -> str:
    return write(tmp_path / "gpu.json", text)


BASE_HW = HARDWARE.read_text()


@pytest.mark.parametrize("text, says", [
    (BASE_HW.replace('"hbm_bandwidth_gb_s": 1555,', ""), "hbm_bandwidth_gb_s: missing"),
    (BASE_HW.replace('"hbm_bandwidth_gb_s": 1555', '"hbm_bandwidth_gb_s": 0'), "must be a number > 0, got 0"),
    (BASE_HW.replace('"hbm_bandwidth_gb_s": 1555', '"hbm_bandwidth_gb_s": "1555"'), "got '1555'"),
    # was: NaN passed the > 0 check and the run priced every step NaN
    (BASE_HW.replace('"peak_bf16_tflops": 312', '"peak_bf16_tflops": NaN'), "peak_bf16_tflops: must be a number > 0, got nan"),
    # was: OverflowError from int(inf)
    (BASE_HW.replace('"memory_mib": 40960', '"memory_mib": Infinity'), "memory_mib: must be a number > 0, got inf"),
    (BASE_HW.replace('"a100",', "").replace('"aliases": [', '"aliases": "a100", "x": ['), "aliases: must be a list"),
    ("[]", "not a JSON object"),
    (b"\xff\xfe{}", "cannot read"),
])
def test_bad_hardware_file_names_the_file_and_field(tmp_path, capsys, text, says):
    path = hardware(tmp_path, text)
    line = clean_error(["simulate", "--hardware", path, *TINY_RUN, "--out", str(tmp_path / "o")], capsys)
    assert f"error: {path}: " in line and says in line


# ---------------------------------------------------------------- calibration and profile files


def calibration(tmp_path: Path, change) -> str:
    data = json.loads(CALIBRATION.read_text())
    change(data)
    return write(tmp_path / "cal.json", json.dumps(data))


@pytest.mark.parametrize("flag, make, says", [
    ("--calibration", lambda d: d.update(version=99), "calibration version 99; this pagesim reads 1"),
    ("--calibration", lambda d: d["params"].update(gemm_latency_s=float("nan")),
     "gemm_latency_s: expected a finite number >= 0, got nan"),
    ("--calibration", lambda d: d.update(hardware="nope"), "unknown hardware 'nope'"),
    ("--calibration", lambda d: d.pop("format"), "not a pagesim calibration"),
    ("--profile", lambda d: d.pop("format"), "not a pagesim profile"),
])
def test_bad_calibration_or_profile_names_the_file(tmp_path, capsys, flag, make, says):
    path = calibration(tmp_path, make)
    line = clean_error(["simulate", flag, path, "--model", "llama-3-8b", "--hardware", "h100-sxm", *TINY_RUN,
                        "--out", str(tmp_path / "o")], capsys)
    assert f"error: {path}: " in line and says in line


@pytest.mark.parametrize("flag", ["--calibration", "--profile"])
def test_binary_calibration_or_profile_names_the_file(tmp_path, capsys, flag):
    path = write(tmp_path / "junk.json", b"\xff\xfe\x00")  # was: a bare 'utf-8 codec' message, no file
    line = clean_error(["simulate", flag, path, *TINY_RUN, "--out", str(tmp_path / "o")], capsys)
    assert f"error: {path}: cannot read" in line


# ---------------------------------------------------------------- measurement files (fidelity)


def bench(tmp_path: Path, **changes) -> str:
    data = {**json.loads(BENCH.read_text()), **changes}
    return write(tmp_path / "bench.json", json.dumps(data))


@pytest.mark.parametrize("changes, says", [
    ({"request_rate": 0}, "request_rate: expected a number > 0, got 0"),
    ({"request_rate": "inf"}, "request_rate: 'inf'"),
    ({"model_id": "acme/none"}, "model_id: unknown model 'acme/none'"),
    ({"input_lens": [10]}, "input_lens: expected 6 integers >= 0"),
    ({"completed": 0}, "completed: no request completed"),
    ({"mean_ttft_ms": float("nan")}, "mean_ttft_ms: expected a number >= 0, got nan"),
    ({"tensor_parallel_size": "3"}, "tensor_parallel_size: 3 does not divide llama-3-8b's 32 attention heads"),
])
def test_bad_vllm_bench_file_names_the_field(tmp_path, capsys, changes, says):
    path = bench(tmp_path, **changes)
    line = clean_error(["fidelity", "--measurements", path, "--out", str(tmp_path / "o")], capsys)
    assert f"error: {path}: " in line and says in line


@pytest.mark.parametrize("text, says", [
    ("", "empty file"), ("[]", "not a measurements file"), ('{"experiments": []}', "experiments: expected a non-empty list"),
    (b"\xff\xfe", "cannot read"),
])
def test_unreadable_measurement_files(tmp_path, capsys, text, says):
    path = write(tmp_path / "m.json", text)
    line = clean_error(["fidelity", "--measurements", path, "--out", str(tmp_path / "o")], capsys)
    assert f"error: {path}: {says}" in line


# ---------------------------------------------------------------- options


@pytest.mark.parametrize("argv, says", [
    (["--tp", "1024"], "tp (--tp): 1024 does not divide opt-13b's 40 attention heads"),
    (["--replicas", "0"], "argument --replicas: must be an integer >= 1"),
    (["--rate", "nan"], "argument --rate: must be a finite number"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs"),
    (["--max-num-batched-tokens", "8"], "max_num_batched_tokens must be >= block_size (16), got 8"),
    # was: the scheduler's "num_blocks must be >= 1, got 0", naming no flag
    (["--block-size", "1000000", "--max-num-batched-tokens", "1000000"], "block_size (--block-size): the KV memory"),
    (["--preemption", "swap", "--num-cpu-blocks", "0"], "needs num_cpu_blocks >= 1"),
    (["--replicas", "2", "--replica-hardware", "a100-40gb", "h100-sxm", "l40s"], "names 3 GPUs"),
    (["--policy", "sjf", "--policy-arg", "predictor=bogus"], "unknown predictor 'bogus'"),
    (["--gpu-memory-utilization", "1e-9"], "does not fit on 1 x a100-40gb"),
    # was ignored without --disaggregate
    (["--transfer-bandwidth", "5"], "--transfer-bandwidth is the prefill -> decode KV link: it applies with"),
    # was a TypeError traceback ("'>=' not supported between instances of 'str' and 'int'")
    (["--policy", "sjf", "--policy-arg", "aging=abc"], "policy 'sjf': option aging='abc' must be float"),
])
def test_impossible_options_name_the_flag(tmp_path, capsys, argv, says):
    line = clean_error(["simulate", *TINY_RUN, "--out", str(tmp_path / "o"), *argv], capsys)
    assert line.startswith("pagesim simulate: error: ") and says in line


@pytest.mark.parametrize("argv, says", [
    (["--num-requests", "0"], "--num-requests: must be an integer >= 1, got 0"),  # was: a header-only file
    (["--num-requests", "3", "--rate", "0"], "rate must be a finite number > 0"),
    (["--num-requests", "3", "--burstiness", "2"], "give --rate"),
])
def test_trace_generate_refuses_impossible_options(tmp_path, capsys, argv, says):
    out = tmp_path / "t.csv"
    line = clean_error(["trace", "generate", "--kind", "fixed", *argv, "--out", str(out)], capsys)
    assert says in line and not out.exists()


def test_trace_generate_out_below_a_file_is_refused_and_missing_folders_are_made(tmp_path, capsys):
    blocker = write(tmp_path / "f", "x")
    line = clean_error(["trace", "generate", "--kind", "fixed", "--num-requests", "3", "--out",
                        f"{blocker}/t.csv"], capsys)
    assert f"is inside {blocker}, an existing file" in line  # was: pandas' "non-existent directory"
    deep = tmp_path / "a" / "b" / "t.csv"
    assert main(["trace", "generate", "--kind", "fixed", "--num-requests", "3", "--out", str(deep)]) == 0
    assert len(load_trace(deep)) == 3


# ---------------------------------------------------------------- documented rejections


@pytest.mark.parametrize("prompt, argv, reason", [
    (100_000, ["--model", "llama-7b"], "exceeds the model's context of 2048"),  # longer than max_model_len
    (1_000, ["--num-gpu-blocks", "4"], "blocks but the cache holds 4"),  # larger than the whole KV cache
    (1_000, ["--max-num-batched-tokens", "64"], "exceeds max_num_batched_tokens=64 and chunked prefill is off"),
])
def test_requests_that_cannot_run_are_rejected_rows_not_crashes(tmp_path, capsys, prompt, argv, reason):
    path = write(tmp_path / "t.csv", f"prompt_len,output_len\n5,3\n{prompt},3\n")
    out = tmp_path / "o"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["simulate", "--trace", path, "--rate", "1", "--quiet", "--out", str(out), *argv]) == 0
    rows = pd.read_csv(out / "requests.csv", keep_default_na=False)
    assert list(rows.prompt_len) == [5, prompt]  # every input request is a row
    assert rows.status[1] == "rejected" and reason in rows.reject_reason[1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] == 2 and summary["num_rejected"] == (rows.status == "rejected").sum() >= 1


def test_replicas_beyond_memory_are_refused_with_the_estimate(tmp_path, capsys, monkeypatch):
    # was: --replicas 100000 with caches derived from the hardware went unchecked; the OOM killer ended it
    monkeypatch.setattr(policies.limits, "available_memory", lambda: 64 * 2**30)
    line = clean_error(["simulate", *TINY_RUN, "--replicas", "100000", "--out", str(tmp_path / "o")], capsys)
    assert "GPU blocks (derived)" in line and "on each of 100,000 replicas (--replicas)" in line
    assert "but 64.0 GiB is available" in line


@pytest.mark.parametrize("burstiness", ["1e308", "1e-308"])
def test_extreme_burstiness_is_refused_not_divided_by_zero(tmp_path, capsys, burstiness):
    # was: ZeroDivisionError from the Gamma shape 1/cv**2 (cv*cv overflowed to inf or underflowed to 0)
    line = clean_error(["simulate", *TINY_RUN, "--burstiness", burstiness, "--out", str(tmp_path / "o")], capsys)
    assert f"burstiness (cv) {float(burstiness):g} at rate 1 is out of range" in line


@pytest.mark.parametrize("content, says", [
    ('{"widths": [1]}', "widths: expected a list of objects"),  # was: AttributeError
    ('{"widths": 5}', "widths: expected a list of objects"),  # was: TypeError
    (b"\xff\xfe", "not a `pagesim beams` file"),  # was: no file named
])
def test_bad_beam_picks_file_names_the_file(tmp_path, capsys, content, says):
    path = write(tmp_path / "picks.json", content)
    line = clean_error(["sharing", "--num-requests", "2", "--rates", "1", "--n", "--beam-width", "2",
                        "--beam-picks", path, "--out", str(tmp_path / "o")], capsys)
    assert f"error: {path}: {says}" in line


@pytest.mark.parametrize("out, says", [
    ("{tmp}", "is a directory; give a file name"),
    ("{tmp}/afile/cal.json", "afile is an existing file, not a folder"),
])
def test_calibrate_out_is_checked_before_fitting(tmp_path, capsys, out, says):
    # was: the fit ran (10-30 minutes) and only writing the calibration failed
    write(tmp_path / "afile", "x")
    line = clean_error(["calibrate", "--measurements", "nowhere.json", "--hardware", "h100-sxm",
                        "--out", out.format(tmp=tmp_path)], capsys)
    assert "argument --out" in line and says in line


@pytest.mark.parametrize("command", [["profile", "--from-run", "nowhere"], ["beams"]])
def test_profile_and_beams_out_is_checked_before_the_run(tmp_path, capsys, command):
    # was: profile's IsADirectoryError traceback after the whole grid was timed (beams: after the run)
    line = clean_error([*command, "--out", str(tmp_path)], capsys)
    assert "argument --out" in line and "is a directory; give a file name" in line


def test_jobs_beyond_the_cpus_run_one_worker_per_cpu(monkeypatch, capsys):
    # was: --jobs 10000 forked one process per task, each holding a simulation
    import concurrent.futures

    import analysis.parallel as parallel
    seen = []
    real = concurrent.futures.ProcessPoolExecutor
    monkeypatch.setattr(parallel.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(parallel, "ProcessPoolExecutor", lambda max_workers, **kw: seen.append(max_workers)
                        or real(max_workers=max_workers, **kw))
    assert parallel.run_tasks(abs, [(-i,) for i in range(5)], jobs=10_000, progress=False) == [0, 1, 2, 3, 4]
    assert seen == [2] and "note: --jobs 10000 on 2 CPUs: 2 worker processes" in capsys.readouterr().err
