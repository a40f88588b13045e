"""Paged decode attention vs contiguous scaled_dot_product_attention.

CPU: the torch paged path, batch 32, contexts 256..2048, for SmolLM2-135M and Llama-3-8B head
shapes (float32), then over block sizes 1..256 at context 1024. `ratio` is the eager gather path /
SDPA (enable_gqa=True); `ratio_packed` compares it with SDPA fed the GQA-packed query layout
[B, Hkv, H / Hkv, D] that it uses itself; `ratio_compiled` is the torch.compile'd path (the CPU
default, `backend.attention.compiled_decode`) / SDPA. CUDA (when present): the Triton paged decode kernel for Llama-3-8B shapes
(32 query heads, 8 KV heads, head_dim 128, bf16), batch 1..256, contexts 128..8192, with achieved
bandwidth against a measured device-to-device copy bandwidth, and the kernel over block sizes 1..256.

    python -m benchmarks.bench_attention [--device cpu|cuda|all] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

CPU_SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3-8b": (32, 8, 128)}
CPU_CONTEXTS = (256, 512, 1024, 2048)
GPU_SHAPE = (32, 8, 128)
GPU_BATCHES = (1, 4, 16, 64, 256)
GPU_CONTEXTS = (128, 512, 2048, 8192)


def _time_cpu(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Median wall times (ms) of each function, called in turn within every repetition (so that a
    burst of load from other processes hits all of them alike), after two warm-up rounds."""
    for _ in range(2):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) * 1e3 for ts in times]


def _time_cuda(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40))


def paged_inputs(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: str, seed: int = 0):
    """q [B, H, D], caches [num_blocks, bs, Hkv, D] with a shuffled block table [B, ctx / bs]."""
    g = torch.Generator(device=device).manual_seed(seed)
    nb = batch * (-(-ctx // block_size))
    shape = (nb, block_size, kv_heads, head_dim)
    kc = torch.randn(shape, generator=g, device=device, dtype=dtype)
    vc = torch.randn(shape, generator=g, device=device, dtype=dtype)
    perm = torch.randperm(nb, generator=g, device=device)
    bt = perm.view(batch, -1).to(torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=g, device=device, dtype=dtype)
    return q, kc, vc, bt


def contiguous_inputs(q: torch.Tensor, ctx: int, kv_heads: int, seed: int = 1):
    B, _, D = q.shape
    g = torch.Generator(device=q.device).manual_seed(seed)
    k = torch.randn(B, kv_heads, ctx, D, generator=g, device=q.device, dtype=q.dtype)
    v = torch.randn(B, kv_heads, ctx, D, generator=g, device=q.device, dtype=q.dtype)
    return k, v


def _cpu_case(name: str, shape: tuple[int, int, int], batch: int, ctx: int, block_size: int, reps: int) -> dict:
    from backend.attention import compiled_decode, torch_paged

    H, Hkv, D = shape
    q, kc, vc, bt = paged_inputs(batch, ctx, H, Hkv, D, block_size, torch.float32, "cpu")
    k, v = contiguous_inputs(q, ctx, Hkv)
    q4 = q.unsqueeze(2)
    qg = q.view(batch, Hkv, H // Hkv, D)
    lens = [ctx] * batch
    # each paged path keeps its chunk plan across calls, as the layers of one step share it
    plans: tuple[dict, dict] = ({}, {})
    compiled_decode.decode_attention(q, kc, vc, bt, lens, D ** -0.5)  # compile outside the timing
    if compiled_decode._COMPILED.failed:
        raise RuntimeError("torch.compile failed: no compiled decode to time")
    t_sdpa, t_packed, t_paged, t_compiled = _time_cpu([
        lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True),
        lambda: F.scaled_dot_product_attention(qg, k, v),
        lambda: torch_paged.decode_attention(q, kc, vc, bt, lens, D ** -0.5, plan_cache=plans[0]),
        lambda: compiled_decode.decode_attention(q, kc, vc, bt, lens, D ** -0.5, plan_cache=plans[1]),
    ], reps)
    return {"device": "cpu", "shape": name, "batch": batch, "context": ctx, "sdpa_ms": t_sdpa,
            "paged_ms": t_paged, "ratio": t_paged / t_sdpa, "sdpa_packed_ms": t_packed,
            "ratio_packed": t_paged / t_packed, "compiled_ms": t_compiled, "ratio_compiled": t_compiled / t_sdpa}


def bench_cpu(reps: int = 7, batch: int = 32, block_size: int = 16) -> list[dict]:
    return [_cpu_case(name, shape, batch, ctx, block_size, reps)
            for name, shape in CPU_SHAPES.items() for ctx in CPU_CONTEXTS]


def bench_cpu_block_sizes(reps: int = 7, batch: int = 32, ctx: int = 1024,
                          block_sizes=(1, 4, 16, 64, 256)) -> list[dict]:
    """The torch paged path over block sizes (SmolLM2 and Llama-3-8B head shapes, one context)."""
    rows = []
    for name, shape in CPU_SHAPES.items():
        for bs in block_sizes:
            r = _cpu_case(name, shape, batch, ctx, bs, reps)
            r["shape"] = f"{name} bs={bs}"
            rows.append(r)
    return rows


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_cuda(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _cuda_case(batch: int, ctx: int, block_size: int, copy_bw: float) -> dict:
    from backend.attention import triton_kernels

    H, Hkv, D = GPU_SHAPE
    q, kc, vc, bt = paged_inputs(batch, ctx, H, Hkv, D, block_size, torch.bfloat16, "cuda")
    k, v = contiguous_inputs(q, ctx, Hkv)
    q4 = q.unsqueeze(2)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    t_sdpa = _time_cuda(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
    t_tri = _time_cuda(lambda: triton_kernels.decode_attention(q, kc, vc, bt, lens, D ** -0.5, ctx, out=out))
    err = float("nan")
    if ctx * batch <= 1 << 20:  # check the kernel against SDPA over the gathered cache
        k_p = kc[bt.long()].reshape(batch, -1, Hkv, D).transpose(1, 2)
        v_p = vc[bt.long()].reshape(batch, -1, Hkv, D).transpose(1, 2)
        ref = F.scaled_dot_product_attention(q4.float(), k_p.float(), v_p.float(), enable_gqa=True)[:, :, 0]
        err = float((out.float() - ref).abs().max())
    kv_bytes = 2 * batch * ctx * Hkv * D * 2
    sdpa_gbs = kv_bytes / (t_sdpa * 1e-3) / 1e9
    paged_gbs = kv_bytes / (t_tri * 1e-3) / 1e9
    return {"device": "cuda", "shape": "llama-3-8b", "batch": batch, "context": ctx,
            "sdpa_ms": t_sdpa, "paged_ms": t_tri, "ratio": t_tri / t_sdpa, "sdpa_gbs": sdpa_gbs,
            "paged_gbs": paged_gbs, "paged_bw_frac": paged_gbs / copy_bw, "max_abs_err": err}


def bench_cuda(block_size: int = 16, max_kv_bytes: int = 12 << 30) -> tuple[list[dict], float]:
    """Triton decode vs SDPA over the batch x context grid (cases whose K+V exceed max_kv_bytes skipped)."""
    _, Hkv, D = GPU_SHAPE
    copy_bw = copy_bandwidth()
    rows = []
    for batch in GPU_BATCHES:
        for ctx in GPU_CONTEXTS:
            if 2 * batch * ctx * Hkv * D * 2 <= max_kv_bytes:
                rows.append(_cuda_case(batch, ctx, block_size, copy_bw))
                torch.cuda.empty_cache()
    return rows, copy_bw


def bench_cuda_block_sizes(batch: int = 64, ctx: int = 2048, block_sizes=(1, 4, 16, 64, 256)) -> list[dict]:
    """The Triton decode kernel at one batch and context over block sizes: what a smaller block
    costs the kernel (the term the roofline model lacks for the paper's block-size study)."""
    copy_bw = copy_bandwidth()
    rows = []
    for bs in block_sizes:
        r = _cuda_case(batch, ctx, bs, copy_bw)
        r["shape"] = f"llama-3-8b bs={bs}"
        rows.append(r)
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    cols = ["shape", "batch", "context", "sdpa_ms", "paged_ms", "ratio"]
    extra = [c for c in ("sdpa_packed_ms", "ratio_packed", "compiled_ms", "ratio_compiled", "sdpa_gbs", "paged_gbs", "paged_bw_frac", "max_abs_err")
             if rows and c in rows[0]]
    cols += extra
    print("  ".join(f"{c:>13}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>13.3f}" if isinstance(r[c], float) else f"{r[c]:>13}" for c in cols))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    result: dict = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if args.device in ("cpu", "all"):
        result["cpu"] = bench_cpu(args.reps)
        print_table(result["cpu"], f"CPU decode, torch paged vs contiguous SDPA (float32, {torch.get_num_threads()} "
                                   "threads; ratio = paged (eager gather) / sdpa, ratio_compiled = paged "
                                   "(torch.compile'd, the CPU default) / sdpa)")
        result["cpu_block_sizes"] = bench_cpu_block_sizes(args.reps)
        print_table(result["cpu_block_sizes"], "CPU decode by KV block size (batch 32, context 1024)")
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        result["cuda"], result["copy_gbs"] = bench_cuda()
        result["gpu"] = torch.cuda.get_device_name()
        print_table(result["cuda"], f"CUDA decode, Triton paged vs contiguous SDPA (bf16, {result['gpu']}, "
                                    f"device copy {result['copy_gbs']:.0f} GB/s)")
        result["cuda_block_sizes"] = bench_cuda_block_sizes()
        print_table(result["cuda_block_sizes"], "CUDA decode by KV block size (batch 64, context 2048)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
