"""Request traces: the Trace type, loaders for public formats, arrival processes, synthetic
workloads. Imports nothing else from this project (numpy, pandas, pyarrow only)."""

from __future__ import annotations

import warnings
from pathlib import Path

from traces.arrivals import apply_arrivals
from traces.loaders import KNOWN_FORMATS, TraceFormatError, load_trace
from traces.trace import Trace
from traces.workloads import SYNTHETIC, make_synthetic

DEFAULT_SYNTHETIC_REQUESTS = 1000
DEFAULT_SYNTHETIC_RATE = 1.0  # req/s: a synthetic workload given no rate runs (Poisson), and says so

__all__ = [
    "KNOWN_FORMATS",
    "SYNTHETIC",
    "Trace",
    "TraceFormatError",
    "apply_arrivals",
    "load_trace",
    "make_synthetic",
    "resolve_trace",
]


def resolve_trace(
    spec: str,
    num_requests: int | None = None,
    rate: float | None = None,
    burstiness: float | None = None,
    seed: int = 0,
    format: str | None = None,
) -> Trace:
    """The trace a run should replay, with arrivals applied.

    ``spec`` is a synthetic workload name (``SYNTHETIC``; ``num_requests`` defaults to
    DEFAULT_SYNTHETIC_REQUESTS, and ``rate`` to DEFAULT_SYNTHETIC_RATE with a warning when the
    workload has no timestamps of its own) or a trace file path (``num_requests`` keeps the first
    requests). Arrivals follow ``apply_arrivals``: a length-only trace file needs ``rate``.
    """
    if spec in SYNTHETIC:
        if format is not None:  # it was ignored: a user meaning a file of that name got the synthetic kind
            raise ValueError(f"--trace-format {format}: applies to trace files, not the synthetic workload {spec!r}")
        n = DEFAULT_SYNTHETIC_REQUESTS if num_requests is None else num_requests
        trace = make_synthetic(spec, n, seed=seed)
        if rate is None and not trace.has_timestamps:
            rate = DEFAULT_SYNTHETIC_RATE
            warnings.warn(f"no --rate given: {spec} arrives at {rate:g} req/s "
                          + ("(Poisson)" if burstiness is None else f"(burstiness {burstiness:g})"), stacklevel=2)
    elif Path(spec).is_file():
        trace = load_trace(spec, format=format)
        if num_requests is not None:
            trace = trace.head(num_requests)
    else:
        what = "is a directory, not a trace file" if Path(spec).is_dir() else "does not exist"
        raise ValueError(
            f"trace {spec!r} is neither a synthetic workload ({', '.join(SYNTHETIC)}) "
            f"nor an existing file: it {what}"
        )
    return apply_arrivals(trace, rate=rate, burstiness=burstiness, seed=seed)
