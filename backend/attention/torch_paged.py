"""PagedAttention in plain torch (the CPU path, and a reference on GPU).

Shapes: q [T, H, D]; caches [num_blocks, block_size, Hkv, D] (strided views are fine); block tables
[S, max_blocks] int; H % Hkv == 0 (GQA: query head h reads kv head h // (H // Hkv)).

Decode gathers K/V through the block table into a small reusable workspace, a few sequences at a
time (sorted by length, padded and masked within a chunk) so that the gathered copy stays in the
last-level cache while scaled_dot_product_attention reads it: the cache is read from memory once,
as a contiguous kernel would. The query heads of a GQA group are packed as query rows of their kv
head, so each key is read once per kv head rather than once per query head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from backend.attention.metadata import AttentionMetadata, once_per_step

# Bytes of gathered K+V per decode chunk: small enough to stay in a CPU's last-level cache.
DECODE_CHUNK_BYTES = 8 << 20


class _Workspace:
    """Grow-only scratch buffers for gathered K and V rows."""

    def __init__(self) -> None:
        self.bufs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, rows: int, row_numel: int, dtype: torch.dtype, device: torch.device):
        key = (row_numel, dtype, device)
        have = self.bufs.get(key)
        if have is None or have[0].shape[0] < rows:
            have = tuple(torch.empty(rows, row_numel, dtype=dtype, device=device) for _ in range(2))
            self.bufs[key] = have
        return have[0][:rows], have[1][:rows]


_WORKSPACE = _Workspace()


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows of `cache` [nb, bs, Hkv, D] for `block_ids` [n] into `out` [n, bs*Hkv*D]."""
    return torch.index_select(cache.flatten(1), 0, block_ids, out=out)


def _decode_chunks(lens: Sequence[int], bytes_per_token: int, budget: int, block_size: int) -> list[list[int]]:
    """Sequence indices sorted by length, cut into chunks whose padded K+V fits `budget` bytes."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    chunks: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        padded = -(-lens[i] // block_size) * block_size
        if cur and (len(cur) + 1) * padded * bytes_per_token > budget:
            chunks.append(cur)
            cur = []
        cur.append(i)
    if cur:
        chunks.append(cur)
    return chunks


def _rows(idx: list[int], device: torch.device) -> slice | torch.Tensor:
    """A slice when the indices are consecutive (no gather/scatter copies), else an index tensor."""
    if idx[-1] - idx[0] == len(idx) - 1 and idx == sorted(idx):
        return slice(idx[0], idx[-1] + 1)
    return torch.tensor(idx, device=device)


def _decode_plan(lens: list[int], block_tables: torch.Tensor, bs: int, tok_bytes: int, chunk_bytes: int,
                 device: torch.device) -> list[tuple]:
    """Per chunk: (rows, n, L, block ids, mask or None). The same for every layer of a step."""
    plan = []
    for idx in _decode_chunks(lens, tok_bytes, chunk_bytes, bs):
        n, L = len(idx), lens[idx[-1]]
        nb = -(-L // bs)
        rows = _rows(idx, device)
        ids = block_tables[rows, :nb].reshape(-1)
        mask = None
        if lens[idx[0]] != L:
            chunk_lens = torch.tensor([lens[i] for i in idx], device=device)
            mask = (torch.arange(L, device=device) < chunk_lens[:, None])[:, None, None, :]
        plan.append((rows, n, L, ids, mask))
    return plan


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: Sequence[int], scale: float,
                     out: torch.Tensor | None = None, chunk_bytes: int = DECODE_CHUNK_BYTES,
                     plan_cache: dict | None = None) -> torch.Tensor:
    """One query per sequence over its cached context.

    q [B, H, D]; block_tables [B, >= ceil(max(context_lens) / block_size)]; context_lens: B host ints
    (keys at positions [0, context_len) are attended). Returns [B, H, D] (written into `out` if given).
    `plan_cache`, a dict kept for one step, lets the layers of that step share the chunk plan.
    """
    H, D = q.shape[1], q.shape[2]
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    tok_bytes = 2 * Hkv * D * k_cache.element_size()
    plan = once_per_step(plan_cache, "decode_plan", lambda: _decode_plan(
        [int(x) for x in context_lens], block_tables, bs, tok_bytes, chunk_bytes, q.device))
    for rows, n, L, ids, mask in plan:
        nb = ids.shape[0] // n
        kbuf, vbuf = _WORKSPACE.get(n * nb, bs * Hkv * D, k_cache.dtype, k_cache.device)
        kk = _gather(k_cache, ids, kbuf).view(n, nb * bs, Hkv, D)[:, :L].transpose(1, 2)
        vv = _gather(v_cache, ids, vbuf).view(n, nb * bs, Hkv, D)[:, :L].transpose(1, 2)
        # GQA packing: the H // Hkv query heads sharing a kv head are that head's query rows, so each
        # gathered key is read once per kv head (no causal mask: a decode query sees all its keys).
        qq = q[rows].view(n, Hkv, H // Hkv, D).to(k_cache.dtype)
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
        out[rows] = o.reshape(n, H, D).to(out.dtype)  # SDPA on CUDA may return it non-contiguous
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_tables: torch.Tensor, query_start: Sequence[int],
                      starts: Sequence[int], scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill chunks, each attending causally to its own new tokens and to its cached prefix.

    q [N, H, D], k/v [N, Hkv, D] (this chunk's new keys, already stored in the cache too);
    query_start: P + 1 offsets into the N rows; starts: P cached-prefix lengths. Query row r of
    chunk i (position starts[i] + r) attends keys at positions [0, starts[i] + r].
    """
    out = torch.empty_like(q) if out is None else out
    bs, Hkv, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    gqa = q.shape[1] != Hkv
    for i in range(len(starts)):
        s, e, start = query_start[i], query_start[i + 1], int(starts[i])
        qi = q[s:e].transpose(0, 1)
        if start == 0:
            ki, vi = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            L = start + e - s
            nb = -(-L // bs)
            ids = block_tables[i, :nb]
            ki = k_cache.flatten(1).index_select(0, ids).view(nb * bs, Hkv, D)[:L].transpose(0, 1)
            vi = v_cache.flatten(1).index_select(0, ids).view(nb * bs, Hkv, D)[:L].transpose(0, 1)
            qpos = torch.arange(start, L, device=q.device)
            mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qi.to(ki.dtype), ki, vi, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
        out[s:e] = o.transpose(0, 1).to(out.dtype)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    decode: Callable[..., torch.Tensor] = decode_attention) -> torch.Tensor:
    """Attention for a flat batch (prefill chunks first, then decodes); K/V already stored.

    q [T, H, D], k/v [T, Hkv, D]. Returns [T, H, D]. `decode` computes the decodes (the compiled
    backend passes its own).
    """
    out = torch.empty_like(q)
    p = meta.num_prefill_tokens
    if meta.num_prefills:
        prefill_attention(q[:p], k[:p], v[:p], k_cache, v_cache, meta.prefill_block_tables,
                          meta.prefill_query_start, meta.prefill_starts, scale, out=out[:p])
    if meta.num_decodes:
        decode(q[p:], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                         scale, out=out[p:], plan_cache=meta.per_step)
    return out
