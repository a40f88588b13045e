"""`vllm bench serve` / benchmark_serving.py result files: the server settings they do not record
(sidecar file, options) and older files without *_e2el_ms (analysis/bench_settings.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.bench_settings import server_options
from analysis.measurement_files import load_measurements
from pagesim.cli import main

BENCH = Path(__file__).parent / "data" / "vllm_bench_serve_result.json"


def _result(tmp_path: Path, name: str = "bench.json", drop: tuple[str, ...] = (), **changes) -> Path:
    d = json.loads(BENCH.read_text())
    for k in drop:
        d.pop(k)
    d.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return path


def test_settings_come_from_the_file_then_a_sidecar_then_options(tmp_path: Path) -> None:
    path = _result(tmp_path, drop=("tensor_parallel_size", "max_num_seqs", "hardware"), model_id="meta-llama/Llama-3.1-70B")
    (tmp_path / "bench.server.json").write_text(json.dumps(
        {"tensor_parallel_size": 8, "gpu": "a100-40gb", "max_num_seqs": 64, "enable_prefix_caching": False}))
    (exp,) = load_measurements(path)
    assert (exp.tp, exp.hardware, exp.max_num_seqs, exp.prefix_caching) == (8, "a100-40gb", 64, False)
    (exp,) = load_measurements(path, server=server_options(tp=4, max_num_batched_tokens=1024))
    assert (exp.tp, exp.max_num_batched_tokens, exp.max_num_seqs) == (4, 1024, 64)  # options win, the rest stays


def test_a_bad_sidecar_is_named(tmp_path: Path) -> None:
    path = _result(tmp_path)
    (tmp_path / "bench.server.json").write_text(json.dumps({"tensor_parallel": 8}))
    with pytest.raises(ValueError, match=r"bench\.server\.json: tensor_parallel: unknown server setting"):
        load_measurements(path)
    (tmp_path / "bench.server.json").write_text(json.dumps({"tensor_parallel_size": "8"}))
    with pytest.raises(ValueError, match=r"bench\.server\.json: tensor_parallel_size: expected int, got '8'"):
        load_measurements(path)


def test_an_older_file_without_e2el_is_read_from_its_ttfts_and_itls(tmp_path: Path) -> None:
    d = json.loads(BENCH.read_text())
    ok = [t > 0 for t in d["ttfts"]]
    e2e = np.array([t + sum(g) for t, g, good in zip(d["ttfts"], d["itls"], ok) if good])
    path = _result(tmp_path, drop=tuple(k for k in d if "e2el" in k))
    s = load_measurements(path)[0].stages[0]
    assert s.e2e.mean == pytest.approx(e2e.mean()) and s.e2e.p99 == pytest.approx(np.percentile(e2e, 99))
    bare = _result(tmp_path, "bare.json", drop=tuple(k for k in d if "e2el" in k) + ("ttfts", "itls"))
    with pytest.raises(ValueError, match=r"bare\.json: mean_e2el_ms: missing, and no per-request ttfts and itls"):
        load_measurements(bare)


def test_fidelity_takes_the_server_settings_as_options(tmp_path: Path, capsys) -> None:
    path = _result(tmp_path, drop=("tensor_parallel_size",), model_id="meta-llama/Llama-3.1-70B",
                   hardware="a100-40gb")
    out = tmp_path / "out"
    # 70B on one A100 40GB leaves no KV cache: refused, then simulated at TP 8
    assert main(["fidelity", "--measurements", str(path), "--out", str(out)]) == 2
    assert "does not fit on 1 x a100-40gb" in capsys.readouterr().out
    assert main(["fidelity", "--measurements", str(path), "--tp", "8", "--max-duration", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "not simulated" not in printed and "1 experiments, 1 stages" in printed
