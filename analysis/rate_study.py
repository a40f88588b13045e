"""What every simulated study over request rates is configured with (sweep, routing, capacity, block
size, disaggregation, sharing); each study's configuration adds its own choices to it."""

from __future__ import annotations

from dataclasses import dataclass, field

from analysis.parallel import Workers
from sim.run import SimConfig
from traces.trace import Trace


@dataclass(kw_only=True)
class RateStudy:
    """The workload (one trace, or one per seed: analysis.seeds), the configuration every run starts
    from, the request rates, where the runs go, the cost model's title for headers and figures, and
    how many seeds the workload holds. Invariant: `trace`, the first of the workload, is what a
    header names."""

    workload: Trace | list[Trace]
    base: SimConfig
    rates: list[float]
    workers: Workers = field(default_factory=Workers)
    title: str = ""
    seeds: int = 1

    @property
    def trace(self) -> Trace:
        return self.workload[0] if isinstance(self.workload, list) else self.workload
