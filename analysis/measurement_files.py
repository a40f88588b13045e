"""Measured serving runs read from files: each file's format told by its content (the readers are
analysis.measurement_formats and, for guidellm results, analysis.benchmark_results)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from analysis.bench_settings import sidecar_path, with_server_settings
from analysis.benchmark_results import is_guidellm, load_guidellm
from analysis.measurement_formats import (
    Fields,
    json_objects,
    pagesim_run,
    read_settings,
    source_hardware,
    vllm_bench,
    vllm_h100_experiment,
)
from analysis.measurements import Experiment
from analysis.request_runs import is_request_run, load_request_run


def load_measurements(paths: str | Path | Sequence[str | Path], models_dirs: Sequence[str | Path] | None = None,
                      server: dict[str, Any] | None = None) -> list[Experiment]:
    """Every experiment in the files (or run folders) given, in order; the format of each is told by
    its content. `server`: settings `vllm bench serve` results do not record (analysis/bench_settings.py).
    Malformed input raises ValueError naming the file and the field."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out: list[Experiment] = []
    for p in paths:
        out.extend(load_file(Path(p), models_dirs, server))
    return out


def load_file(path: Path, models_dirs: Sequence[str | Path] | None = None,
              server: dict[str, Any] | None = None) -> list[Experiment]:
    """The experiments of one measurements file, pagesim run folder or per-request run folder
    (format told by content). `server`: settings a `vllm bench serve` result does not record
    (analysis/bench_settings.py), over those of its sidecar file."""
    if is_request_run(path):
        return [load_request_run(path, models_dirs)]
    if path.is_dir() or (path.name in ("requests.csv", "summary.json") and (path.parent / "requests.csv").is_file()):
        return [pagesim_run(path if path.is_dir() else path.parent, models_dirs)]
    if not path.is_file():
        raise ValueError(f"{path}: no such file or run folder")
    objects = json_objects(path)
    if len(objects) == 1 and isinstance(objects[0], dict) and "experiments" in objects[0]:
        f = Fields(objects[0], path)
        hardware = source_hardware(objects[0].get("source"))
        return [vllm_h100_experiment(e, models_dirs, hardware) for e in f.items("experiments")]
    if len(objects) == 1:
        if is_guidellm(objects[0]):
            return load_guidellm(path, models_dirs)
    if all(isinstance(o, dict) and "request_rate" in o for o in objects):
        many = len(objects) > 1
        # a sidecar that exists but cannot be read is refused (was: a folder of that name was skipped)
        sidecar = read_settings(sidecar_path(path)) if sidecar_path(path).exists() else {}
        # a setting's error names where it came from (was: the result file, for a sidecar's value)
        origins = {**{k: str(sidecar_path(path)) for k in sidecar},
                   **{k: "the server settings given (--server-settings, --tp, ...)" for k in server or {}}}
        return [vllm_bench(Fields(with_server_settings(o, sidecar, server), path, f"[{i}]" if many else "", origins),
                           f"{path.stem}" + (f"#{i}" if many else ""), models_dirs) for i, o in enumerate(objects)]
    raise ValueError(f"{path}: not a measurements file: expected an object with \"experiments\" (vllm-h100 "
                     "measurements.json), a `vllm bench serve` result (with \"request_rate\"), a guidellm result, "
                     "or a pagesim run folder (requests.csv + summary.json)")
