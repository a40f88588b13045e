"""Paged attention (torch path and Triton kernels) against contiguous scaled_dot_product_attention.

Triton runs natively on CUDA and under TRITON_INTERPRET=1 on CPU (set here and in conftest before
triton is imported); sizes are tiny so that the interpreter stays fast.
"""

import itertools
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F

from backend.attention import torch_paged

DEV = "cuda" if torch.cuda.is_available() else "cpu"
D = 16


def _triton():
    pytest.importorskip("triton")
    if DEV == "cpu":
        pytest.importorskip("numpy")
        assert os.environ.get("TRITON_INTERPRET") == "1"
    from backend.attention import triton_kernels

    return triton_kernels


def make_paged(lens, block_size, hkv, shared_prefix=0, seed=0, dtype=torch.float32, spare=3):
    """Random per-sequence K/V [L, Hkv, D] stored in a shuffled paged cache.

    With `shared_prefix` > 0, every sequence's first `shared_prefix` tokens (a whole number of
    blocks) are the same blocks, as after prefix sharing / fork.
    """
    g = torch.Generator().manual_seed(seed)
    assert shared_prefix % block_size == 0
    n_shared = shared_prefix // block_size
    need = n_shared + sum(-(-(L - shared_prefix) // block_size) for L in lens) + spare
    perm = torch.randperm(need, generator=g).tolist()
    shared_blocks = [perm.pop() for _ in range(n_shared)]
    kc = torch.zeros(need, block_size, hkv, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    shared_k = torch.randn(shared_prefix, hkv, D, generator=g)
    shared_v = torch.randn(shared_prefix, hkv, D, generator=g)
    ks, vs, tables = [], [], []
    for L in lens:
        k = torch.cat([shared_k, torch.randn(L - shared_prefix, hkv, D, generator=g)]).to(dtype)
        v = torch.cat([shared_v, torch.randn(L - shared_prefix, hkv, D, generator=g)]).to(dtype)
        table = shared_blocks + [perm.pop() for _ in range(-(-(L - shared_prefix) // block_size))]
        for p in range(L):
            kc[table[p // block_size], p % block_size] = k[p]
            vc[table[p // block_size], p % block_size] = v[p]
        ks.append(k)
        vs.append(v)
        tables.append(table)
    width = max(len(t) for t in tables) + 1
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    return kc.to(DEV), vc.to(DEV), bt.to(DEV), [k.to(DEV) for k in ks], [v.to(DEV) for v in vs]


def ref_attention(q, k, v, start):
    """Contiguous SDPA: q [n, H, D] at positions start.., k/v [L, Hkv, D]; causal with offset."""
    H, hkv = q.shape[1], k.shape[1]
    kk = k.transpose(0, 1).repeat_interleave(H // hkv, 0).float()
    vv = v.transpose(0, 1).repeat_interleave(H // hkv, 0).float()
    n, L = q.shape[0], k.shape[0]
    mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1).float(), kk, vv, attn_mask=mask).transpose(0, 1)


CASES = [
    # (block_size, H, Hkv, context lengths, shared prefix)
    (1, 4, 2, [1, 7, 20], 0),
    (16, 4, 2, [1, 16, 33, 45], 0),       # 16: a context ending exactly on a block boundary
    (16, 4, 1, [32, 5], 0),               # MQA; 32 ends on a boundary
    (32, 2, 2, [32, 64, 3, 40], 0),       # no GQA; 32 and 64 end on boundaries
    (16, 4, 2, [40, 37, 48], 32),         # shared prefix: the first two blocks are the same ids
    (32, 6, 2, [33, 70], 32),             # group of 3 heads, shared first block
]


def _decode_inputs(case, seed=0):
    bs, H, hkv, lens, shared = case
    kc, vc, bt, ks, vs = make_paged(lens, bs, hkv, shared, seed=seed)
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(seed + 1)).to(DEV)
    ref = torch.stack([ref_attention(q[i:i + 1], ks[i], vs[i], lens[i] - 1)[0] for i in range(len(lens))])
    return q, kc, vc, bt, lens, ref


@pytest.mark.parametrize("case", CASES)
def test_torch_decode_matches_sdpa(case):
    q, kc, vc, bt, lens, ref = _decode_inputs(case)
    out = torch_paged.decode_attention(q, kc, vc, bt, lens, D ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_compiled_decode_matches_sdpa(case):
    if DEV == "cuda":  # the CPU default; compiling it for CUDA too would only spend the GPU check's minutes
        pytest.skip("the compiled decode is the CPU path (Triton serves CUDA)")
    from backend.attention import compiled_decode

    q, kc, vc, bt, lens, ref = _decode_inputs(case)
    out = compiled_decode.decode_attention(q, kc, vc, bt, lens, D ** -0.5)
    assert not compiled_decode._COMPILED.failed, "compilation failed: the eager fallback was tested"
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=1e-4)


def _group_cost(lens, groups, call_cost):
    return sum(call_cost + len(g) * max(lens[i] for i in g) for g in groups)


@pytest.mark.parametrize("lens", [[1, 300, 17, 16, 290, 2, 64, 65, 1000, 33], [5], [100] * 7,
                                  [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]])
@pytest.mark.parametrize("call_cost", [0, 64, 512, 10 ** 6])
def test_compiled_decode_length_groups_are_cheapest(lens, call_cost):
    from backend.attention.compiled_decode import length_groups

    groups = length_groups(lens, call_cost)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    # against every way of cutting the sorted lengths into consecutive groups
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    best = min(_group_cost(lens, [order[a:b] for a, b in zip((0,) + cuts, cuts + (len(lens),))], call_cost)
               for r in range(len(lens)) for cuts in itertools.combinations(range(1, len(lens)), r))
    assert _group_cost(lens, groups, call_cost) == best
    if call_cost == 10 ** 6:
        assert len(groups) == 1
    if call_cost == 0:
        assert all(len({lens[i] for i in g}) == 1 for g in groups)


def test_compiled_decode_falls_back_with_a_warning(monkeypatch):
    if DEV == "cuda":
        pytest.skip("the compiled decode is the CPU path (Triton serves CUDA)")
    from backend.attention import compiled_decode

    compiled = compiled_decode._Compiled()
    def broken(*args):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(compiled_decode.torch, "compile", lambda fn, **kw: broken)
    monkeypatch.setattr(compiled_decode, "_COMPILED", compiled)
    q, kc, vc, bt, lens, ref = _decode_inputs(CASES[1])
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        out = compiled_decode.decode_attention(q, kc, vc, bt, lens, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert compiled.failed


def test_torch_decode_chunking_is_invisible():
    q, kc, vc, bt, lens, ref = _decode_inputs(CASES[1])
    for chunk_bytes in (1, 2000, 1 << 30):  # one sequence per chunk ... all in one chunk
        out = torch_paged.decode_attention(q, kc, vc, bt, lens, D ** -0.5, chunk_bytes=chunk_bytes)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_triton_decode_matches_sdpa(case):
    tk = _triton()
    q, kc, vc, bt, lens, ref = _decode_inputs(case)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = tk.decode_attention(q, kc, vc, bt, ctx, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("splits", [2, 3])
def test_triton_decode_split_kv(splits):
    """Split-K: partial softmax states over token ranges, merged by the reduce kernel."""
    tk = _triton()
    q, kc, vc, bt, lens, ref = _decode_inputs((1, 4, 2, [1, 40, 70], 0))
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = tk.decode_attention(q, kc, vc, bt, ctx, D ** -0.5, num_splits=splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


PREFILL_CASES = [
    # (block_size, H, Hkv, starts, new tokens, shared prefix)
    (1, 4, 2, [0, 3, 9], [5, 7, 2], 0),
    (16, 4, 2, [0, 16, 20], [16, 17, 12], 0),   # chunk ending on a boundary, prefix ending on one
    (32, 4, 1, [0, 5], [40, 27], 0),
    (16, 4, 2, [32, 32], [8, 21], 32),          # two chunks over the same cached prefix blocks
]


def _prefill_inputs(case, seed=0):
    bs, H, hkv, starts, news, shared = case
    lens = [s + n for s, n in zip(starts, news)]
    kc, vc, bt, ks, vs = make_paged(lens, bs, hkv, shared, seed=seed)
    g = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(sum(news), H, D, generator=g).to(DEV)
    k_new = torch.cat([k[s:] for k, s in zip(ks, starts)])
    v_new = torch.cat([v[s:] for v, s in zip(vs, starts)])
    qs = [0]
    for n in news:
        qs.append(qs[-1] + n)
    ref = torch.cat([ref_attention(q[qs[i]:qs[i + 1]], ks[i], vs[i], starts[i]) for i in range(len(starts))])
    return q, k_new, v_new, kc, vc, bt, qs, starts, ref


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_torch_prefill_with_cached_prefix(case):
    q, k, v, kc, vc, bt, qs, starts, ref = _prefill_inputs(case)
    out = torch_paged.prefill_attention(q, k, v, kc, vc, bt, qs, starts, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_triton_prefill_with_cached_prefix(case):
    tk = _triton()
    q, _, _, kc, vc, bt, qs, starts, ref = _prefill_inputs(case)
    cu = torch.tensor(qs, dtype=torch.int32, device=DEV)
    st = torch.tensor(starts, dtype=torch.int32, device=DEV)
    out = tk.prefill_attention(q, kc, vc, bt, cu, st, D ** -0.5, max(b - a for a, b in itertools.pairwise(qs)))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(DEV != "cuda", reason="half precision kernels need a GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_triton_half_precision(dtype):
    tk = _triton()
    dt = getattr(torch, dtype)
    bs, H, hkv, lens = 16, 8, 2, [1, 100, 517, 2048]
    kc, vc, bt, ks, vs = make_paged(lens, bs, hkv, dtype=dt)
    q = torch.randn(len(lens), H, D, device=DEV, dtype=dt)
    ref = torch.stack([ref_attention(q[i:i + 1], ks[i], vs[i], lens[i] - 1)[0] for i in range(len(lens))])
    out = tk.decode_attention(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32, device=DEV), D ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_triton_store_matches_torch_store():
    tk = _triton()
    from backend.kv_cache import PagedKVCache

    cache_a = PagedKVCache(2, 2, D, block_size=4, num_blocks=6, device=DEV)
    cache_b = PagedKVCache(2, 2, D, block_size=4, num_blocks=6, device=DEV)
    k = torch.randn(5, 2, D, device=DEV)
    v = torch.randn(5, 2, D, device=DEV)
    slots = torch.tensor([3, 4, 17, 22, 9], device=DEV)
    tk.store_kv(k, v, cache_a.key_cache(1), cache_a.value_cache(1), slots)
    cache_b.key_cache(1)[slots // 4, slots % 4] = k
    cache_b.value_cache(1)[slots // 4, slots % 4] = v
    assert torch.equal(cache_a.gpu, cache_b.gpu)
    # a slot of -1 is skipped
    tk.store_kv(k[:1] + 1, v[:1] + 1, cache_a.key_cache(0), cache_a.value_cache(0),
                torch.tensor([-1], device=DEV))
    assert torch.equal(cache_a.gpu, cache_b.gpu)


def test_triton_copy_blocks():
    tk = _triton()
    cache = torch.randn(6, 2, 2, 4, 2, D, device=DEV)
    before = cache.clone()
    tk.copy_blocks(cache, [(0, 3), (5, 1)], chunk=128)
    assert torch.equal(cache[3], before[0]) and torch.equal(cache[1], before[5])
    for b in (0, 2, 4, 5):
        assert torch.equal(cache[b], before[b])


def test_backend_selection():
    from backend.attention import compiled_decode, get_attention

    assert get_attention("cpu") is compiled_decode.paged_attention
    assert get_attention("cpu", "torch") is torch_paged.paged_attention
    with pytest.raises(ValueError, match="known"):
        get_attention("cpu", "flash")
