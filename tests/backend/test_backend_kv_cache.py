import pytest

torch = pytest.importorskip("torch")

from backend.kv_cache import PagedKVCache, block_bytes

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cache(**kw):
    args = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "num_blocks": 10,
            "num_cpu_blocks": 6, "device": DEV}
    args.update(kw)
    return PagedKVCache(**args)


def _fill(cache, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache.gpu.copy_(torch.randn(cache.gpu.shape, generator=g).to(cache.gpu))


def test_layout_and_views():
    c = _cache()
    assert c.gpu.shape == (10, 3, 2, 4, 2, 8)
    assert c.key_cache(1).shape == (10, 4, 2, 8) and c.value_cache(2).shape == (10, 4, 2, 8)
    assert c.key_cache(1).data_ptr() == c.gpu[0, 1, 0].data_ptr()
    assert c.block_bytes == block_bytes(3, 2, 8, 4, torch.float32) == 2 * 3 * 4 * 2 * 8 * 4
    assert c.num_slots == 40


def test_store_writes_slots():
    c = _cache()
    k = torch.randn(5, 2, 8, device=DEV)
    v = torch.randn(5, 2, 8, device=DEV)
    slots = torch.tensor([0, 5, 6, 39, 17], device=DEV)
    c.store(1, k, v, slots)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(c.key_cache(1)[s // 4, s % 4], k[t])
        assert torch.equal(c.value_cache(1)[s // 4, s % 4], v[t])
    assert c.key_cache(0).abs().sum() == 0 and c.key_cache(2).abs().sum() == 0


def test_copy_blocks_all_layers():
    c = _cache()
    _fill(c)
    before = c.gpu.clone()
    c.copy_blocks([(1, 7), (2, 8), (4, 0)])
    assert torch.equal(c.gpu[7], before[1]) and torch.equal(c.gpu[8], before[2]) and torch.equal(c.gpu[0], before[4])
    for b in (1, 2, 3, 4, 5, 6, 9):
        assert torch.equal(c.gpu[b], before[b])


def test_swap_round_trip():
    c = _cache()
    _fill(c, seed=1)
    before = c.gpu.clone()
    c.swap_out([(3, 0), (4, 1), (9, 5)])
    c.gpu[[3, 4, 9]] = 0
    c.swap_in([(0, 6), (1, 7), (5, 2)])
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(c.gpu[6], before[3]) and torch.equal(c.gpu[7], before[4]) and torch.equal(c.gpu[2], before[9])
    assert torch.equal(c.cpu[0], before[3].cpu())


def test_swap_out_of_range():
    c = _cache()
    with pytest.raises(IndexError):
        c.swap_out([(0, 6)])
    with pytest.raises(IndexError):
        c.swap_in([(0, 10)])


def test_pinned_pool_on_cuda():
    c = _cache()
    assert c.cpu.device.type == "cpu"
    assert c.cpu.is_pinned() == (DEV == "cuda")


def test_budget_sizing():
    per = block_bytes(3, 2, 8, 4, torch.float32)
    c = _cache(num_blocks=None, memory_budget=per * 7 + per // 2, device="cpu")
    assert c.num_blocks == 7
    with pytest.raises(ValueError, match="less than one block"):
        _cache(num_blocks=None, memory_budget=per - 1, device="cpu")
    with pytest.raises(ValueError, match="exactly one"):
        _cache(num_blocks=4, memory_budget=per * 4)
    with pytest.raises(ValueError, match="fraction"):
        _cache(num_blocks=None, memory_budget=0.5, device="cpu")


@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_budget_fraction_on_cuda():
    free, _ = torch.cuda.mem_get_info()
    c = _cache(num_blocks=None, memory_budget=0.01)
    assert abs(c.num_blocks * c.block_bytes - free * 0.01) <= c.block_bytes + free * 0.001


def test_a_cache_larger_than_memory_is_a_clear_error():
    from backend.kv_cache import PagedKVCache

    with pytest.raises(ValueError, match=r"num_gpu_blocks: 1,000,000,000 blocks of .* do not fit in cpu memory"):
        PagedKVCache(30, 3, 64, 16, num_blocks=1_000_000_000)
