"""Triton kernels for paged KV cache: store (reshape_and_cache), block copy, paged decode attention
(split over KV tokens, GQA packed: one program per (sequence, kv head, split) serves the whole group
of query heads), and prefill-with-cached-prefix attention (causal within the chunk).

They also run on CPU tensors under `TRITON_INTERPRET=1` (slowly: keep sizes tiny). There, and for
float32 inputs, operands are cast to float32 before `tl.dot` (IEEE precision).

Shapes as in `torch_paged`: q [T, H, D]; caches [num_blocks, block_size, Hkv, D] with unit stride
in D (other strides free: the cache is a strided per-layer view); block tables [S, max_blocks] int32.
Block ids are widened to int64 before address arithmetic (large caches exceed 2**31 elements).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from backend.attention.metadata import AttentionMetadata


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pad(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _dot_fp32(t: torch.Tensor) -> bool:
    return _interpreting() or t.dtype == torch.float32


# ---- store ----------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     s_kt, s_kh, s_vt, s_vh, s_cb, s_ct, s_ch,
                     BLOCK_SIZE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                     H_PAD: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    valid = (tl.zeros([H_PAD, 1], tl.int64) + slot) >= 0
    mask = (h < HKV) & (d < D) & valid
    dst = blk * s_cb + off * s_ct + h * s_ch + d
    k = tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=mask)
    tl.store(kc_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into their slots; a slot of -1 is skipped."""
    T, Hkv, D = k.shape
    if T == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride()
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HKV=Hkv, D=D, H_PAD=_pad(Hkv, 1), D_PAD=_pad(D, 1))


# ---- block copy -----------------------------------------------------------------------------------
@triton.jit
def _copy_blocks_kernel(cache_ptr, src_ptr, dst_ptr, block_numel, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    x = tl.load(cache_ptr + src * block_numel + offs, mask=mask)
    tl.store(cache_ptr + dst * block_numel + offs, x, mask=mask)


def copy_blocks(cache: torch.Tensor, pairs: Sequence[tuple[int, int]], chunk: int | None = None) -> None:
    """Copy whole blocks (first dim of the contiguous `cache`) for (src, dst) pairs, one launch."""
    if not pairs:
        return
    assert cache.is_contiguous()
    block_numel = cache[0].numel()
    chunk = chunk or (256 if _interpreting() else 4096)
    ids = torch.tensor(pairs, dtype=torch.int64).T.contiguous().to(cache.device)
    grid = (len(pairs), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](cache, ids[0], ids[1], block_numel, CHUNK=chunk)


# ---- the tile loop both attention kernels share --------------------------------------------------
@triton.jit
def _load_kv_tile(kc_ptr, vc_ptr, bt_row_ptr, j, jmask, kvh, d, dmask, s_cb, s_ct, s_ch,
                  BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr):
    """Keys and values [TILE, D_PAD] of one sequence's token positions `j` (masked by `jmask`),
    read through its block table row; block ids widened to int64 before the address arithmetic."""
    blk = tl.load(bt_row_ptr + j // BLOCK_SIZE, mask=jmask, other=0).to(tl.int64)
    base = blk * s_cb + (j % BLOCK_SIZE) * s_ct + kvh * s_ch
    kvmask = jmask[:, None] & dmask[None, :]
    k = tl.load(kc_ptr + base[:, None] + d[None, :], mask=kvmask, other=0.0)
    v = tl.load(vc_ptr + base[:, None] + d[None, :], mask=kvmask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _attend_tile(q, k, v, visible, scale, m, lsum, acc, DOT_FP32: tl.constexpr):
    """One step of online softmax: fold the keys/values of a tile into the running max `m`, sum
    `lsum` and unnormalised output `acc` of the query rows `q`; `visible` [rows, TILE] masks scores."""
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    lsum = lsum * alpha + tl.sum(p, 1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, lsum, acc


# ---- decode ---------------------------------------------------------------------------------------
@triton.jit
def _decode_kernel(out_ptr, q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, po_ptr, pm_ptr, pl_ptr,
                   scale, tokens_per_split, num_splits,
                   s_qt, s_qh, s_ot, s_oh, s_cb, s_ct, s_ch, s_bt,
                   BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                   D: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr,
                   DOT_FP32: tl.constexpr, SPLIT: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    ctx = tl.load(ctx_ptr + seq)
    lo = split * tokens_per_split
    hi = tl.minimum(ctx, lo + tokens_per_split)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    qmask = (g < GROUP)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + seq * s_qt + heads[:, None] * s_qh + d[None, :], mask=qmask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for j0 in range(lo, hi, TILE):
        j = j0 + tl.arange(0, TILE)
        jmask = j < hi
        k, v = _load_kv_tile(kc_ptr, vc_ptr, bt_ptr + seq * s_bt, j, jmask, kvh, d, d < D, s_cb, s_ct, s_ch,
                             BLOCK_SIZE, DOT_FP32)
        m, lsum, acc = _attend_tile(q, k, v, jmask[None, :], scale, m, lsum, acc, DOT_FP32)
    if SPLIT:
        row = (seq * num_heads + heads) * num_splits + split
        tl.store(pm_ptr + row, m, mask=g < GROUP)
        tl.store(pl_ptr + row, lsum, mask=g < GROUP)
        tl.store(po_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=qmask)
    else:
        o = acc / lsum[:, None]
        tl.store(out_ptr + seq * s_ot + heads[:, None] * s_oh + d[None, :], o, mask=qmask)


@triton.jit
def _decode_reduce_kernel(out_ptr, po_ptr, pm_ptr, pl_ptr, num_splits, s_ot, s_oh,
                          D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    smask = s < num_splits
    row = (seq * num_heads + head) * num_splits + s
    m = tl.load(pm_ptr + row, mask=smask, other=float("-inf"))
    lsum = tl.load(pl_ptr + row, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(lsum > 0, tl.exp(m - m_max), 0.0)
    acc = tl.load(po_ptr + row[:, None] * D_PAD + d[None, :], mask=smask[:, None] & (d < D)[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(out_ptr + seq * s_ot + head * s_oh + d, o, mask=d < D)


def _num_splits(batch: int, kv_heads: int, max_context: int, tile: int, device: torch.device) -> int:
    """Enough programs to fill the GPU (2 per SM), with at least 4 tiles of work per split."""
    if _interpreting() or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(2 * sms, max(1, batch * kv_heads))
    return max(1, min(want, triton.cdiv(max_context, 4 * tile), 64))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     max_context: int | None = None, out: torch.Tensor | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    """Paged decode: q [B, H, D] over contexts of `context_lens` [B] (int32, on q's device)."""
    B, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride() == v_cache.stride()
    max_context = int(context_lens.max()) if max_context is None else max_context
    group = H // Hkv
    tile = max(16, bs) if _interpreting() else max(64, bs)
    splits = num_splits or _num_splits(B, Hkv, max_context, tile, q.device)
    per_split = triton.cdiv(triton.cdiv(max_context, splits), tile) * tile
    splits = triton.cdiv(max_context, per_split)
    d_pad = _pad(D)
    if splits > 1:
        po = torch.empty(B * H * splits, d_pad, dtype=torch.float32, device=q.device)
        pm = torch.empty(B * H * splits, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
    else:
        po = pm = pl = out
    _decode_kernel[(B, Hkv, splits)](
        out, q, k_cache, v_cache, block_tables, context_lens, po, pm, pl,
        scale, per_split, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=bs, GROUP=group, G_PAD=_pad(group), D=D, D_PAD=d_pad, TILE=tile,
        DOT_FP32=_dot_fp32(q), SPLIT=splits > 1)
    if splits > 1:
        _decode_reduce_kernel[(B, H)](out, po, pm, pl, splits, out.stride(0), out.stride(1),
                                      D=D, D_PAD=d_pad, S_PAD=_pad(splits, 1))
    return out


# ---- prefill with cached prefix -------------------------------------------------------------------
@triton.jit
def _prefill_kernel(out_ptr, q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_q_ptr, start_ptr, scale,
                    s_qt, s_qh, s_ot, s_oh, s_cb, s_ct, s_ch, s_bt,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    mt = tl.program_id(2)
    q0 = tl.load(cu_q_ptr + seq)
    n = tl.load(cu_q_ptr + seq + 1) - q0
    start = tl.load(start_ptr + seq)
    kvh = head // GROUP
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n
    qpos = start + rows
    d = tl.arange(0, D_PAD)
    dmask = d < D
    qmask = rmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + (q0 + rows)[:, None] * s_qt + head * s_qh + d[None, :], mask=qmask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    hi = tl.where(mt * BLOCK_M < n, start + tl.minimum(n, (mt + 1) * BLOCK_M), 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for j0 in range(0, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jmask = j < hi
        k, v = _load_kv_tile(kc_ptr, vc_ptr, bt_ptr + seq * s_bt, j, jmask, kvh, d, dmask, s_cb, s_ct, s_ch,
                             BLOCK_SIZE, DOT_FP32)
        visible = jmask[None, :] & (j[None, :] <= qpos[:, None])  # causal within the chunk
        m, lsum, acc = _attend_tile(q, k, v, visible, scale, m, lsum, acc, DOT_FP32)
    o = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
    tl.store(out_ptr + (q0 + rows)[:, None] * s_ot + head * s_oh + d[None, :], o, mask=qmask)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_q: torch.Tensor, starts: torch.Tensor, scale: float,
                      max_q_len: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill chunks over cache (new K/V already stored): q [N, H, D]; cu_q [P + 1] and starts [P]
    int32 on device; query row r of chunk i attends positions [0, starts[i] + r]."""
    H, D = q.shape[1], q.shape[2]
    out = torch.empty_like(q) if out is None else out
    P = starts.shape[0]
    if P == 0:
        return out
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    bm, bn = (16, 16) if _interpreting() else (64, 64)
    grid = (P, H, triton.cdiv(max_q_len, bm))
    _prefill_kernel[grid](
        out, q, k_cache, v_cache, block_tables, cu_q, starts, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=bs, GROUP=H // Hkv, D=D, D_PAD=_pad(D), BLOCK_M=bm, BLOCK_N=bn, DOT_FP32=_dot_fp32(q))
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Same contract as `torch_paged.paged_attention` (k, v are already in the cache)."""
    out = torch.empty_like(q)
    p = meta.num_prefill_tokens
    if meta.num_prefills:
        prefill_attention(q[:p], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_q,
                          meta.prefill_starts_t, scale, meta.max_prefill_len, out=out[:p])
    if meta.num_decodes:
        decode_attention(q[p:], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens_t,
                         scale, meta.max_decode_context, out=out[p:])
    return out
