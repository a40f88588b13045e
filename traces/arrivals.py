"""Seeded arrival processes and the rule for giving a trace its arrival times.

All generators return sorted float64 arrays of n arrival times in seconds, starting after time 0
(the first arrival is one inter-arrival gap after 0, as in a process started at 0). The same
(arguments, seed) always gives the same array.
"""

from __future__ import annotations

import math

import numpy as np

from traces.trace import MAX_ARRIVAL, Trace

# Stream key that separates arrival randomness from length randomness drawn with the same seed
# (synthetic generators use the bare seed): the two must be independent, not the same bit stream.
ARRIVAL_STREAM = 0xA11


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng([ARRIVAL_STREAM, int(seed)])


def _check_positive(value: float, name: str) -> float:
    if value is None or not isinstance(value, (int, float, np.number)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_burstiness(value: float) -> float:
    if isinstance(value, (int, float, np.number)) and value == 0:
        return 0.0
    try:
        return _check_positive(value, "burstiness")
    except ValueError:
        raise ValueError(f"burstiness must be a finite number >= 0 (0: constant arrivals), got {value!r}") from None


def _check_rate(value: float) -> float:
    """A rate > 0 whose mean gap 1/rate is finite too (1e-320 passes > 0 but its gap overflows)."""
    rate = _check_positive(value, "rate")
    if not math.isfinite(1.0 / rate):
        raise ValueError(f"rate {value!r} is too small: the mean gap 1/rate overflows")
    return rate


def _check_count(n: int) -> int:
    if int(n) != n or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    return int(n)


def constant(n: int, rate: float) -> np.ndarray:
    """Evenly spaced arrivals, one every 1/rate seconds (what load generators such as
    inference-perf's "constant" load run); no randomness, so no seed."""
    n, rate = _check_count(n), _check_rate(rate)
    return np.arange(1, n + 1, dtype=np.float64) / rate


def poisson(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Poisson process: exponential inter-arrival gaps with mean 1/rate."""
    n, rate = _check_count(n), _check_rate(rate)
    return np.cumsum(_rng(seed).exponential(1.0 / rate, size=n))


def gamma(n: int, rate: float, cv: float, seed: int = 0) -> np.ndarray:
    """Gamma renewal process: gaps with mean 1/rate and coefficient of variation ``cv``.

    Shape k = 1/cv^2, scale = 1/(rate*k). cv = 1 is the exponential (Poisson); cv > 1 is burstier
    (clumps of arrivals separated by long gaps), cv < 1 more regular.
    """
    n, rate = _check_count(n), _check_rate(rate)
    cv = _check_positive(cv, "cv")
    # an extreme cv makes cv*cv 0 or inf and the shape or scale 0 or inf (was a ZeroDivisionError)
    shape = 1.0 / (cv * cv) if 0 < cv * cv < math.inf else 0.0
    scale = 1.0 / (rate * shape) if 0 < rate * shape < math.inf else 0.0
    if not (0 < shape < math.inf and 0 < scale < math.inf):
        raise ValueError(f"burstiness (cv) {cv:g} at rate {rate:g} is out of range: the Gamma shape 1/cv**2 and "
                         f"scale 1/(rate*shape) must be finite and > 0")
    return np.cumsum(_rng(seed).gamma(shape, scale, size=n))


def rescale(timestamps: np.ndarray, rate: float) -> np.ndarray:
    """Stretch or compress sorted timestamps to mean rate ``rate``, keeping their shape.

    The result starts at 0 and its mean rate (N-1)/duration equals ``rate``; relative gaps (and
    hence the inter-arrival CV) are unchanged.
    """
    rate = _check_rate(rate)
    ts = np.asarray(timestamps, dtype=np.float64)
    duration = float(ts[-1] - ts[0]) if len(ts) else 0.0
    if len(ts) < 2 or duration <= 0:
        raise ValueError("rescale needs at least two distinct timestamps")
    return (ts - ts[0]) * ((len(ts) - 1) / duration / rate)


def apply_arrivals(
    trace: Trace, rate: float | None = None, burstiness: float | None = None, seed: int = 0
) -> Trace:
    """Give ``trace`` the arrival times a run should use.

    - rate None: keep the trace's own timestamps (a length-only trace is an error: give a rate);
    - rate given, trace has timestamps: rescale them to ``rate`` (shape kept);
    - rate given, length-only trace: Poisson arrivals, or Gamma with CV ``burstiness`` if given;
      ``burstiness`` 0 means constant arrivals, evenly spaced at 1/rate.
    ``burstiness`` only shapes generated arrivals, so it is refused for a timestamped trace.
    """
    if rate is not None:
        rate = _check_rate(rate)
    if burstiness is not None:
        burstiness = _check_burstiness(burstiness)
    label = trace.name or "trace"
    if trace.has_timestamps and burstiness is not None:
        raise ValueError(
            f"burstiness applies to generated arrivals only; {label!r} has its own timestamps "
            "(give --rate alone to rescale them)"
        )
    if rate is None:
        if not trace.has_timestamps:
            raise ValueError(f"{label!r} has no timestamps: give --rate (requests/s) to generate arrivals")
        return trace
    if trace.has_timestamps:
        arrival = rescale(trace.arrival, rate) if len(trace) >= 2 else np.zeros(len(trace))
    elif burstiness is None:
        arrival = poisson(len(trace), rate, seed)
    elif burstiness == 0:
        arrival = constant(len(trace), rate)
    else:
        arrival = gamma(len(trace), rate, burstiness, seed)
    # refused here, naming the rate, rather than by the Trace's own check on its arrivals
    if len(arrival) and not arrival[-1] <= MAX_ARRIVAL:
        raise ValueError(f"rate {rate:g} is too small for {len(trace):,} requests: the last would arrive at "
                         f"{arrival[-1]:.3g} s, beyond 2**32 s (about 136 years); give a higher --rate")
    return trace.with_arrivals(arrival)
