"""Trace rows as requests: what the simulator and the live replay both serve.

A trace (traces.trace.Trace, read here by its columns only: this layer does not import traces/)
becomes one Request per row, decoding exactly the trace's output length (EOS ignored) so that
simulated and live runs do identical work.
"""

from __future__ import annotations

from typing import Any

from policies.limits import REQUEST_BYTES, check_fits
from policies.request import Request, SamplingParams


def requests_from_trace(trace: Any, max_model_len: int, n: int | None = None,
                        beam_width: int | None = None) -> list[Request]:
    """The rows of `trace` (a traces.trace.Trace, or anything with its columns) as requests that
    decode exactly the trace's output length (ignore EOS), one per row: a row with a reject
    reason (trace.reject_reason) becomes a request the scheduler rejects on arrival with that
    reason. max_tokens is what the context leaves after the prompt (what
    Orca-Max reserves). Refuses (ValueError) a trace whose requests could not fit in memory."""
    check_fits(f"{len(trace):,} requests", [(len(trace), REQUEST_BYTES)])
    num = len(trace)
    prompts, outputs = trace.prompt_len.tolist(), trace.output_len.tolist()
    arrivals = trace.arrival.astype(float).tolist()
    ns = [n] * num if n is not None else trace.n.tolist()
    beams = [beam_width] * num if beam_width is not None else trace.beam_width.tolist()
    hashes = trace.prefix_hashes
    ids = trace.prompt_token_ids
    hbs = trace.hash_block_size or 16
    reasons = trace.reject_reason or [""] * num
    # the class columns as whole lists (each row's value, or the Request default), passed by position
    client, priority, slo_ttft, slo_tpot = _class_columns(trace)
    params: dict[tuple[int, int, int], SamplingParams] = {}  # frozen, so equal ones are shared
    reqs = []
    for i, (p, out, arrival, ni, bi) in enumerate(zip(prompts, outputs, arrivals, ns, beams)):
        key = (max(max_model_len - p, out, 1), ni, bi)
        sp = params.get(key)
        if sp is None:
            sp = params[key] = SamplingParams(max_tokens=key[0], ignore_eos=True, n=ni, beam_width=bi)
        reqs.append(Request(i, arrival, p, sp, out, None if ids is None or ids[i] is None else list(ids[i]),
                            None if hashes is None or hashes[i] is None else tuple(hashes[i]), hbs,
                            priority[i], reasons[i] or None, client[i], slo_ttft[i], slo_tpot[i]))
    return reqs


def _class_columns(trace: Any) -> tuple[list[str], list[int], list[float | None], list[float | None]]:
    """(client, priority, slo_ttft, slo_tpot) of every row: the trace's column, or the Request
    field's default where it has none; a NaN SLO is None (the run's SLO)."""
    num = len(trace)
    client = list(trace.client) if trace.client is not None else [""] * num
    priority = trace.priority.tolist() if trace.priority is not None else [0] * num
    slos: list[list[float | None]] = []
    for name in ("slo_ttft", "slo_tpot"):
        values = getattr(trace, name)
        slos.append([None if v != v else v for v in values.tolist()] if values is not None else [None] * num)
    return client, priority, slos[0], slos[1]
