"""Multi-client workloads: several clients, each with its own share of the request rate, arrival
burstiness, length distribution, priority and SLO class, merged into one timestamped trace.

The trace is generated at a total rate of 1 request/s; `--rate` rescales it (the shape, and so each
client's share and burstiness, is kept). Each client draws its lengths from a named synthetic
workload (`traces.synthetic.SYNTHETIC`), from its own seeded stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from traces.arrivals import constant, gamma, poisson
from traces.synthetic import LENGTH_WORKLOADS
from traces.trace import Trace


@dataclass(frozen=True)
class ClientSpec:
    """One client of a multi-client workload (see the module docstring)."""

    name: str
    share: float                  # fraction of the total request rate
    burstiness: float = 1.0       # inter-arrival CV: 1 Poisson, 0 constant, > 1 bursty (Gamma)
    lengths: str = "sharegpt-like"
    priority: int = 0             # lower is served first by the `priority` policy
    slo_ttft: float | None = None
    slo_tpot: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("client: a name is required")
        if not (self.share > 0 and math.isfinite(self.share)):
            raise ValueError(f"client {self.name!r}: share must be > 0, got {self.share}")
        if not (self.burstiness >= 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"client {self.name!r}: burstiness must be >= 0, got {self.burstiness}")
        if self.lengths not in LENGTH_WORKLOADS:
            raise ValueError(f"client {self.name!r}: unknown synthetic workload {self.lengths!r} for lengths; "
                             f"known: {', '.join(LENGTH_WORKLOADS)}")
        for k in ("slo_ttft", "slo_tpot"):
            v = getattr(self, k)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"client {self.name!r}: {k} must be > 0 seconds, got {v}")


# A default mix: short interactive requests with tight SLOs, chat, and a bursty batch client that
# sends half the load with loose targets (the setting fair-share and SLO-aware policies address).
DEFAULT_CLIENTS: tuple[ClientSpec, ...] = (
    ClientSpec("interactive", 0.2, 1.0, "alpaca-like", priority=0, slo_ttft=0.5, slo_tpot=0.1),
    ClientSpec("chat", 0.3, 1.0, "sharegpt-like", priority=1, slo_ttft=2.0, slo_tpot=0.2),
    ClientSpec("batch", 0.5, 3.0, "sharegpt-like", priority=2, slo_ttft=30.0, slo_tpot=1.0),
)


def _arrivals(spec: ClientSpec, count: int, rate: float, seed: int) -> np.ndarray:
    if spec.burstiness == 0:
        return constant(count, rate)
    if spec.burstiness == 1:
        return poisson(count, rate, seed)
    return gamma(count, rate, spec.burstiness, seed)


def multi_client(n: int, seed: int = 0, clients: tuple[ClientSpec, ...] = DEFAULT_CLIENTS) -> Trace:
    """`n` requests from `clients` (shares normalised to 1), timestamped at a total rate of 1/s."""
    if not clients:
        raise ValueError("multi_client needs at least one client")
    names = [c.name for c in clients]
    if len(set(names)) != len(names):
        raise ValueError(f"multi_client: client names must be unique, got {names}")
    total = sum(c.share for c in clients)
    streams = np.random.SeedSequence(seed).spawn(2 * len(clients))
    parts = []
    for i, c in enumerate(clients):
        share = c.share / total
        count = math.ceil(1.5 * share * n) + 8  # more than needed: the merge keeps the first n
        arrival = _arrivals(c, count, share, int(streams[2 * i].generate_state(1)[0]))
        lengths = LENGTH_WORKLOADS[c.lengths](count, seed=int(streams[2 * i + 1].generate_state(1)[0]))
        parts.append((arrival, lengths.prompt_len, lengths.output_len, i))
    arrival = np.concatenate([p[0] for p in parts])
    who = np.concatenate([np.full(len(p[0]), p[3]) for p in parts])
    prompt = np.concatenate([p[1] for p in parts])
    output = np.concatenate([p[2] for p in parts])
    order = np.lexsort((who, arrival))[:n]  # ties broken by client index: deterministic
    spec = [clients[j] for j in who[order]]
    nan = float("nan")
    return Trace(
        arrival=arrival[order] - (arrival[order][0] if n else 0.0),
        prompt_len=prompt[order], output_len=output[order],
        client=[c.name for c in spec], priority=np.array([c.priority for c in spec], np.int64),
        slo_ttft=np.array([nan if c.slo_ttft is None else c.slo_ttft for c in spec]),
        slo_tpot=np.array([nan if c.slo_tpot is None else c.slo_tpot for c in spec]),
        name="multi-client",
        source=f"synthetic:multi-client {'+'.join(names)} seed={seed}",
    )
