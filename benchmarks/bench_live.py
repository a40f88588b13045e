"""Live engine vs HF transformers on CPU: SmolLM2-135M serving 32 requests of mixed prompt and
output lengths. pagesim's engine (vllm policy, paged KV cache, iteration-level batching) against
HF `generate()` on static, left-padded batches of the same requests (each batch decodes until its
longest request is done, as static batching does). Both greedy with EOS ignored; throughput counts
each request's own output tokens. Target: >= 2x. Each runs its CPU default: HF its dense linears,
pagesim oneDNN-prepacked ones (`ModelRunner(prepack=False)` gives the dense path) and the compiled
decode attention (`attention="torch"` gives the eager gather path); the ablation rows time those.

Two length mixes: `sharegpt-like/4` (the project's synthetic ShareGPT-fitted lengths, a quarter of
their size to fit a CPU: long-tailed, as real chat outputs are) and `uniform` (prompts 16-256,
outputs 16-128: little spread, so static batching wastes little).

    python -m benchmarks.bench_live [--requests 32] [--hf-batch 8 32] [--workloads sharegpt-like/4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def workload(n: int, kind: str = "sharegpt-like/4", seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs, seeded."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        prompts, outputs = rng.integers(16, 257, n), rng.integers(16, 129, n)
    elif kind == "sharegpt-like/4":
        from traces.synthetic import sharegpt_like
        t = sharegpt_like(n, seed=seed)
        prompts, outputs = np.maximum(t.prompt_len // 4, 4), np.maximum(t.output_len // 4, 4)
    else:
        raise ValueError(f"unknown workload {kind!r}; known: sharegpt-like/4, uniform")
    return [(rng.integers(300, 40000, int(p)).tolist(), int(o)) for p, o in zip(prompts, outputs)]


def run_pagesim(config, weights, reqs, prepack: bool | None = None, attention: str | None = None) -> float:
    import torch

    from backend.live_executor import build_live_replica
    from backend.model_runner import ModelRunner
    from backend.replay import serve
    from policies import Request, SamplingParams
    from policies.replica_config import ReplicaConfig

    blocks = sum(-(-(len(p) + o) // 16) for p, o in reqs) + 16
    runner = ModelRunner(config, weights, "cpu", dtype=torch.float32, num_gpu_blocks=blocks, block_size=16,
                         prepack=prepack, attention=attention)
    requests = [Request(i, 0.0, len(p), SamplingParams(max_tokens=o, ignore_eos=True), prompt_token_ids=p)
                for i, (p, o) in enumerate(reqs)]
    replica = build_live_replica(ReplicaConfig(blocks, 16, max_num_batched_tokens=2048), runner, [config.eos_token_id])
    t0 = time.perf_counter()
    serve(replica, requests, realtime=False)
    return time.perf_counter() - t0


def run_hf(model, reqs, batch: int) -> float:
    import torch

    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, (p, _) in enumerate(chunk):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        new = max(o for _, o in chunk)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--workloads", nargs="+", default=["sharegpt-like/4", "uniform"])
    ap.add_argument("--ablations", action=argparse.BooleanOptionalAction, default=True,
                    help="also time pagesim with plain dense linears, and with eager (uncompiled) "
                         "gather attention (default on)")
    args = ap.parse_args(argv)
    import torch
    import transformers

    from backend.weights import load_smollm2, smollm2_gguf_path

    config, weights = load_smollm2()
    path = smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    print(f"SmolLM2-135M on CPU ({torch.get_num_threads()} threads), {args.requests} requests per workload")
    print(f"{'workload':<16} {'engine':<30} {'wall s':>8} {'out tok/s':>10} {'speedup':>8}")
    for kind in args.workloads:
        reqs = workload(args.requests, kind)
        tokens = sum(o for _, o in reqs)
        ours = run_pagesim(config, weights, reqs)
        print(f"{kind:<16} {'pagesim live (vllm, paged)':<30} {ours:>8.1f} {tokens / ours:>10.1f} {'':>8}")
        if args.ablations:
            for label, kw in (("  same, dense linears", {"prepack": False}),
                              ("  same, eager attention", {"attention": "torch"})):
                t = run_pagesim(config, weights, reqs, **kw)
                print(f"{kind:<16} {label:<30} {t:>8.1f} {tokens / t:>10.1f} {t / ours:>7.2f}x")
        for b in args.hf_batch:
            t = run_hf(hf, reqs, b)
            print(f"{kind:<16} {f'HF generate, static batch {b}':<30} {t:>8.1f} {tokens / t:>10.1f} "
                  f"{t / ours:>7.2f}x")
    print("speedup = HF wall time / pagesim wall time, same requests and output tokens (target >= 2)")


if __name__ == "__main__":
    main()
