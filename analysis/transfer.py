"""A calibration for a GPU with kernel profiles but no end-to-end measurement: its operator terms
from its own kernel profiles, the engine's and client's terms carried over from a calibration of
the same engine on another GPU, and a record of which term came from where.

The split follows what each term describes (sim/calibrated.py): GEMM, elementwise and attention
kernels are the GPU's (measured by the profiler on it); the per-iteration and per-sequence host
work and the client terms are the engine's (its scheduler, sampler and frontend on a comparable
host); the all-reduce latency, when no profile times it, is the new GPU's link latency from its
hardware file (as a fit with no stage at TP > 1 takes it: analysis/calibrate.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sim.calibrated import Calibration
from sim.specs import get_hardware

# the terms kernel profiles can give (analysis/kernel_profiles.py, analysis/operator_fit.py)
OPERATOR_TERMS = ("gemm_latency_s", "gemm_eff_max", "gemm_m_half", "weight_mem_eff", "elementwise_mem_eff",
                  "elementwise_floor_s", "attn_mem_eff", "prefill_attn_eff", "allreduce_latency_s", "allreduce_bus_eff")


def transfer_calibration(base: Calibration, operators: dict[str, float], operator_source: str, hardware: str,
                         name: str) -> Calibration:
    """`base` moved to `hardware`: the profiled `operators` replace base's, the link latency is the
    new hardware's when not profiled, everything else is carried; `meta["provenance"]` says, per
    parameter, where its value came from. Unknown operator names raise ValueError."""
    unknown = set(operators) - set(OPERATOR_TERMS)
    if unknown:
        raise ValueError(f"operator terms: unknown {sorted(unknown)}; known: {', '.join(OPERATOR_TERMS)}")
    hw = get_hardware(hardware)
    carried = f"carried from calibration {base.name} (fitted on {base.hardware})"
    provenance: dict[str, str] = {n: carried for n in base.params.to_dict()}
    changes: dict[str, Any] = dict(operators)
    provenance.update(dict.fromkeys(operators, f"kernel profiles of {hw.name}: {operator_source}"))
    if "allreduce_latency_s" not in operators and hw.interconnect_latency_s > 0:
        changes["allreduce_latency_s"] = hw.interconnect_latency_s
        provenance["allreduce_latency_s"] = f"hardware file {hw.name}: the link's small-message latency"
    base_fit = base.meta.get("fit", {})
    meta = {"engine": base.meta.get("engine"), "provenance": provenance,
            "carried_from": {"name": base.name, "hardware": base.hardware,
                             "in_sample_errors": base_fit.get("in_sample", {}).get("median_abs_error"),
                             "command": base.meta.get("command")}}
    return Calibration(replace(base.params, **changes), hw.name, name, meta)
