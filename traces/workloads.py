"""Every synthetic workload by name: the single-stream ones (traces.synthetic) and the multi-client
mix drawn from them (traces.clients)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from traces.clients import multi_client
from traces.synthetic import LENGTH_WORKLOADS
from traces.trace import Trace

SYNTHETIC: dict[str, Callable[..., Trace]] = {
    **LENGTH_WORKLOADS,
    # several clients with their own rate shares, burstiness, lengths, priority and SLO class
    # (timestamped at 1 request/s in all, which --rate rescales)
    "multi-client": lambda n, seed=0, **kw: multi_client(n, seed=seed, **kw),
}


def make_synthetic(name: str, n: int, seed: int = 0, **kw: Any) -> Trace:
    """Generate ``n`` requests of the synthetic workload ``name`` (a key of ``SYNTHETIC``)."""
    if name not in SYNTHETIC:
        raise ValueError(f"unknown synthetic workload {name!r}; known: {', '.join(SYNTHETIC)}")
    if int(n) != n or n < 0:
        raise ValueError(f"num_requests must be an integer >= 0, got {n!r}")
    return SYNTHETIC[name](int(n), seed=seed, **kw)
