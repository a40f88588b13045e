"""A trace replayed live: the model loaded, the policy's scheduler and the executor built, the
requests served (in real time or all at once), and the run's tables. What `pagesim live` and
`pagesim validate` run; the loop itself is backend.live.serve.

The requests come from a callable given the model's context length, since a replayed request's
max_tokens is what the context leaves after its prompt (sim.run.requests_from_trace, which the
backend may not import)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from backend.live import LiveExecutor, load_model, replay_prompt_ids, serve
from backend.model_runner import ModelRunner
from policies.metrics import request_frame, summarize
from policies.registry import is_paged, make_scheduler, scheduler_options
from policies.request import Request


@dataclass(frozen=True)
class LiveOptions:
    """The model, cache and policy of a live replay (the `pagesim live` options)."""

    model: str = "smollm2-135m"
    device: str = "cpu"
    attention: str | None = None
    num_gpu_blocks: int = 512
    num_cpu_blocks: int = 512
    block_size: int = 16
    policy: str = "vllm"
    policy_options: dict[str, Any] = field(default_factory=dict)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    preemption: str = "recompute"
    chunked_prefill: bool = False
    prefix_caching: bool = False
    seed: int = 0
    slo_ttft: float | None = None
    slo_tpot: float | None = None


def serve_trace(options: LiveOptions, make_requests: Callable[[int], list[Request]], realtime: bool = True,
                check: Callable[[ModelRunner], Any] | None = None,
                prepare: Callable[[ModelRunner], None] | None = None,
                progress: bool = False) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """Serve `make_requests(context length)` on the model under the policy; (requests,
    iterations, summary) as `pagesim live` writes them. After the warm-up, `prepare(runner)` runs
    once (it may take minutes: re-profiling); `check(runner)` runs right before and right after
    serving, its results in the summary as check_before / check_after. Neither is timed."""
    t0 = time.perf_counter()
    model = load_model(options.model, seed=options.seed)
    cfg = model.config
    runner = ModelRunner(cfg, model.weights, options.device, attention=options.attention,
                         num_gpu_blocks=options.num_gpu_blocks, num_cpu_blocks=options.num_cpu_blocks,
                         block_size=options.block_size)
    kw = scheduler_options(options.policy, options.max_num_seqs, options.max_num_batched_tokens, options.preemption,
                           options.chunked_prefill, options.prefix_caching, options.num_cpu_blocks)
    if not is_paged(options.policy):
        kw["alloc_unit"] = options.block_size  # contiguous chunks must map onto the cache's blocks
    sched = make_scheduler(options.policy, runner.num_gpu_blocks, options.block_size,
                           policy_options=options.policy_options, slo_ttft=options.slo_ttft, **kw)
    sched.max_model_len = cfg.max_position
    requests = make_requests(cfg.max_position)
    for r in requests:
        # the trace's own ids, as simulated (they were replaced by synthetic ones, so live and
        # simulated prefix caching saw different prompts)
        r.prompt_token_ids = replay_prompt_ids(r, cfg.vocab_size, options.seed)
        r.hash_block_size = r.hash_block_size or options.block_size
    executor = LiveExecutor(sched, runner, [cfg.eos_token_id], seed=options.seed)  # warms the model up
    if progress:
        print(f"{options.model} on {options.device}: weights loaded and a warm-up step run (it compiles the CPU "
              f"decode attention) in {time.perf_counter() - t0:.1f} s; serving {len(requests)} requests")
    if prepare is not None:
        prepare(runner)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), unit="req", desc="serving", mininterval=0.5, leave=False)

    def show(now: float, done: int) -> None:
        if bar is not None and done != bar.n:
            bar.update(done - bar.n)
            bar.set_postfix_str(f"t={now:,.1f}s", refresh=False)

    before = check(runner) if check is not None else None
    run = serve(sched, executor, requests, realtime=realtime, on_progress=show)
    after = check(runner) if check is not None else None
    if bar is not None:
        bar.close()
    req_df = request_frame(run.groups)
    it_df = run.log.frame()
    summary = summarize(req_df, it_df, options.slo_ttft, options.slo_tpot)
    summary.update(mode="live", model=options.model, device=options.device, wall_time_s=run.wall_time,
                   kv_capacity_tokens=runner.num_gpu_blocks * options.block_size)
    if check is not None:
        summary.update(check_before=before, check_after=after)
    return req_df, it_df, summary
