"""Trace rows as requests: what the simulator and the live replay both serve.

A trace (traces.trace.Trace, read here by its columns only: this layer does not import traces/)
becomes one Request per row, decoding exactly the trace's output length (EOS ignored) so that
simulated and live runs do identical work.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

import numpy as np

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
    prompt, output = trace.prompt_len.astype(np.int64), trace.output_len.astype(np.int64)
    arrivals = trace.arrival.astype(float).tolist()
    ns = [n] * num if n is not None else trace.n.tolist()
    beams = [beam_width] * num if beam_width is not None else trace.beam_width.tolist()
    hashes = trace.prefix_hashes
    ids = trace.prompt_token_ids
    # the class columns as whole lists (each row's value, or the Request default), passed by position
    client, priority, slo_ttft, slo_tpot = _class_columns(trace)
    # one SamplingParams per distinct (max_tokens, n, beam_width), shared (frozen); the keys made,
    # looked up and mapped by C loops (no bytecode per row)
    max_tokens = np.maximum(np.maximum(max_model_len - prompt, output), 1)
    keys = list(zip(max_tokens.tolist(), ns, beams))
    params = dict.fromkeys(keys)
    for key in params:
        params[key] = SamplingParams(max_tokens=key[0], ignore_eos=True, n=key[1], beam_width=key[2])
    sampling = list(map(params.__getitem__, keys))
    # the optional columns as whole lists too, and the requests made by one map (no bytecode per row)
    token_ids = repeat(None) if ids is None else [None if x is None else list(x) for x in ids]
    prefix_hashes = repeat(None) if hashes is None else [None if x is None else tuple(x) for x in hashes]
    reasons = [r or None for r in trace.reject_reason] if trace.reject_reason else repeat(None)
    return list(map(Request, range(num), arrivals, prompt.tolist(), sampling, output.tolist(), token_ids, prefix_hashes,
                    repeat(trace.hash_block_size or 16), priority, reasons, client, slo_ttft, slo_tpot))


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
