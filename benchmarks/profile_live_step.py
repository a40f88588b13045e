"""Where one live decode step's time goes: SmolLM2-135M on CPU, a batch of decoding sequences with
mixed contexts on a shuffled (fragmented) paged cache; median step time, then torch.profiler's
operator table over a few steps.

    python -m benchmarks.profile_live_step [--batch 32] [--min-context 40] [--max-context 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--min-context", type=int, default=40)
    ap.add_argument("--max-context", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from backend.model_runner import Batch, ModelRunner, SeqInput
    from backend.weights import load_smollm2

    config, weights = load_smollm2()
    rng = random.Random(args.seed)
    bs = args.block_size
    contexts = [rng.randint(args.min_context, args.max_context) for _ in range(args.batch)]
    per_seq = [-(-(c + 1) // bs) for c in contexts]
    runner = ModelRunner(config, weights, "cpu", dtype=torch.float32, num_gpu_blocks=sum(per_seq), block_size=bs)
    ids = list(range(sum(per_seq)))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in per_seq:
        tables.append(ids[at:at + n])
        at += n
    batch = Batch([SeqInput([5], c, t, True) for c, t in zip(contexts, tables)])
    with torch.inference_mode():
        for _ in range(3):
            runner.execute(batch)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            runner.execute(batch)
            times.append(time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                runner.execute(batch)
    print(f"decode step, batch {args.batch}, contexts {args.min_context}-{args.max_context} "
          f"(sum {sum(contexts)}), {torch.get_num_threads()} threads: median {statistics.median(times) * 1e3:.1f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
