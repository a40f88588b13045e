"""Decode attention as one fused loop nest: the torch path's maths, compiled by torch.compile.

Eager torch reaches K/V through a block table only by materialising them (index_select), so the
cache is streamed twice: once to gather, once by scaled_dot_product_attention. Written with the
block dimensions kept explicit ([B, blocks, block_size, Hkv, G, D]), inductor turns gather, scores,
softmax and weighted sum into C++ loops that load each key and value row straight from its cache
block: the cache is read once, as a contiguous kernel reads it. (Flattening blocks and offsets into
one length axis made inductor divide every index and ran 1.4-1.7x slower.)

One graph per (heads, kv heads, head dim, block size, dtype, scale): the batch, the block-table
width and the cache size are dynamic. Dynamo would specialise sizes 0 and 1, so batches and block
tables are padded to at least 2 (padding rows attend one key of block 0; padding columns are
masked). Sequences are cut into groups of similar length so that a short context does not read a
long one's padding, with as few groups as that allows (each call has a fixed cost). Where
compilation fails (no C++ compiler, say), a warning is given once and the eager gather path
(`torch_paged.decode_attention`) serves instead. The compiled functions are kept per process (the
module's `_COMPILED`), as torch keeps its own compiled graphs.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Sequence

import numpy as np
import torch

import backend.attention.torch_paged as torch_paged  # the module, not the package: no import loop
from backend.attention.metadata import AttentionMetadata, once_per_step

# One compiled call costs about as much as reading this many more keys (2 CPU cores, SmolLM2 head
# shapes: about 75 us of dynamo guards and launch against 0.08-0.2 us per key).
CALL_COST_KEYS = 512


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D]; block_tables [B, nb]; context_lens [B] tensor. Returns [B, H, D]: one query per
    sequence, computed in the cache's dtype, the GQA query heads grouped under their kv head."""
    B, H, D = q.shape
    nb = block_tables.shape[1]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    ids = block_tables.long()
    k = k_cache[ids].view(B, nb, bs, hkv, 1, D)
    v = v_cache[ids].view(B, nb, bs, hkv, 1, D)
    qg = q.to(k_cache.dtype).view(B, 1, 1, hkv, H // hkv, D) * scale
    s = (qg * k).sum(-1)                                               # [B, nb, bs, Hkv, G]
    pos = torch.arange(nb * bs, device=q.device).view(nb, bs)
    s = s.masked_fill((pos >= context_lens.view(B, 1, 1))[..., None, None], float("-inf"))
    e = torch.exp(s - s.amax((1, 2), keepdim=True))
    o = (e[..., None] * v).sum((1, 2)) / e.sum((1, 2))[..., None]     # [B, Hkv, G, D]
    return o.reshape(B, H, D)


class _Compiled:
    """`_decode` compiled once per (head shape, block size, dtype, scale), built on first use.

    Each key gets its own copy of `_decode`'s code object: dynamo keeps its graphs (and its limit on
    recompilations, 8) per code object, so models and block sizes must not share one, or the ninth
    shape would silently run `_decode` eagerly (materialising every gathered block). `failed` is set
    when a compilation raised; callers then take the eager gather path.
    """

    def __init__(self) -> None:
        self.fns: dict[tuple, object] = {}
        self.failed = False

    def __call__(self, q, k_cache, v_cache, block_tables, context_lens, scale):
        key = (tuple(q.shape[1:]), tuple(k_cache.shape[1:]), k_cache.dtype, q.device, scale)
        fn = self.fns.get(key)
        if fn is None:
            code = _decode.__code__.replace(co_name=f"_decode_{len(self.fns)}")
            fn = torch.compile(types.FunctionType(code, _decode.__globals__), dynamic=False)
            self.fns[key] = fn
            # compiled with these sizes symbolic, the graph then serves any batch, table width and
            # cache size (later inputs need no marks)
            for t, dims in ((q, (0,)), (block_tables, (0, 1)), (context_lens, (0,)), (k_cache, (0,)),
                            (v_cache, (0,))):
                for d in dims:
                    torch._dynamo.mark_dynamic(t, d)
        return fn(q, k_cache, v_cache, block_tables, context_lens, scale)


_COMPILED = _Compiled()


def length_groups(lens: Sequence[int], call_cost_keys: int = CALL_COST_KEYS) -> list[list[int]]:
    """Sequence indices sorted by context length, cut into consecutive groups so that the keys read
    (each group padded to its longest member) plus `call_cost_keys` per group are fewest: one call
    for a batch of similar lengths, more where a short context would read a long one's padding."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    srt = np.array([lens[i] for i in order], dtype=np.int64)
    n = len(srt)
    best = np.zeros(n + 1, dtype=np.int64)   # best[j]: cheapest cost of the first j sequences
    cut = np.zeros(n + 1, dtype=np.int64)    # where the last group of those j starts
    for j in range(1, n + 1):
        starts = np.arange(j)                # last group = sorted sequences [i, j)
        costs = best[:j] + call_cost_keys + (j - starts) * srt[j - 1]
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = int(cut[j])
    return groups[::-1]


def _plan(lens: list[int], block_tables: torch.Tensor, bs: int, device: torch.device) -> list[tuple]:
    """Per group: (rows, n, padded block table [>=2, >=2], padded context lengths)."""
    plan = []
    for idx in length_groups(lens):
        n = len(idx)
        nb = max(2, -(-lens[idx[-1]] // bs))
        rows = torch_paged._rows(idx, device)
        bt = block_tables[rows]
        if bt.shape[1] < nb:
            bt = torch.nn.functional.pad(bt, (0, nb - bt.shape[1]))
        bt = bt[:, :nb]
        glens = [lens[i] for i in idx]
        if n == 1:  # a second, padding row: one key of block 0
            bt = torch.cat([bt, torch.zeros_like(bt)])
            glens.append(1)
        plan.append((rows, n, bt.contiguous(), torch.tensor(glens, device=device)))
    return plan


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: Sequence[int], scale: float,
                     out: torch.Tensor | None = None, plan_cache: dict | None = None) -> torch.Tensor:
    """Same contract as `torch_paged.decode_attention`, computed by the compiled loop nest."""
    if _COMPILED.failed:
        return torch_paged.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                            out=out, plan_cache=plan_cache)
    out = torch.empty_like(q) if out is None else out
    plan = once_per_step(plan_cache, "compiled_decode_plan", lambda: _plan(
        [int(x) for x in context_lens], block_tables, k_cache.shape[1], q.device))
    for rows, n, bt, glens in plan:
        qq = q[rows].contiguous()
        if qq.shape[0] == 1:
            qq = torch.cat([qq, qq])
        try:
            o = _COMPILED(qq, k_cache, v_cache, bt, glens, float(scale))
        except Exception as exc:  # any compiler failure: fall back, and say so once
            _COMPILED.failed = True
            warnings.warn(f"compiled decode attention unavailable ({type(exc).__name__}: {exc}); "
                          "using the eager gather path", stacklevel=2)
            return torch_paged.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                out=out, plan_cache=plan_cache)
        out[rows] = o[:n].to(out.dtype)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The torch path (`torch_paged.paged_attention`) with its decodes computed here."""
    return torch_paged.paged_attention(q, k, v, k_cache, v_cache, meta, scale, decode=decode_attention)
