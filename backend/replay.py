"""The wall-clock serving loop of a live replica (`serve`), and a trace replayed on it: the model
loaded, the replica built, the requests served (in real time or all at once), and the run's tables.
What `pagesim live`, `pagesim validate`, `pagesim generate`, the profiler's served workload and the
beam measurement run.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from backend.live_executor import build_live_replica, load_model
from backend.model_runner import ModelRunner
from policies.iteration_log import IterationLog
from policies.metrics import summarize
from policies.replica_config import ReplicaConfig
from policies.request import Request, SequenceGroup
from policies.request_rows import request_frame
from policies.step import ReplicaStep
from policies.trace_requests import requests_from_trace


@dataclass(frozen=True)
class LiveOptions:
    """The model and replica of a live replay (the `pagesim live` options): the runner's cache is
    the replica's (num_gpu_blocks, num_cpu_blocks, block_size)."""

    model: str = "smollm2-135m"
    device: str = "cpu"
    attention: str | None = None
    replica: ReplicaConfig = field(default_factory=lambda: ReplicaConfig(num_gpu_blocks=512, num_cpu_blocks=512))
    seed: int = 0


def serve_trace(options: LiveOptions, trace: Any, n: int | None = None, beam_width: int | None = None,
                realtime: bool = True, check: Callable[[ModelRunner], Any] | None = None,
                prepare: Callable[[ModelRunner], None] | None = None,
                progress: bool = False) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """Serve the trace's requests (policies.trace_requests; `n`, `beam_width` override the trace's)
    on the model under the replica's policy; (requests, iterations, summary) as `pagesim live`
    writes them. After the warm-up, `prepare(runner)` runs once (it may take minutes:
    re-profiling); `check(runner)` runs right before and right after serving, its results in the
    summary as check_before / check_after. Neither is timed."""
    t0 = time.perf_counter()
    model = load_model(options.model, seed=options.seed)
    cfg, rc = model.config, options.replica
    runner = ModelRunner(cfg, model.weights, options.device, attention=options.attention,
                         num_gpu_blocks=rc.num_gpu_blocks, num_cpu_blocks=rc.num_cpu_blocks, block_size=rc.block_size)
    # a replayed request's max_tokens is what the model's context leaves after its prompt
    requests = requests_from_trace(trace, cfg.max_position, n, beam_width)
    for r in requests:
        # the trace's own ids, as simulated (they were replaced by synthetic ones, so live and
        # simulated prefix caching saw different prompts)
        r.prompt_token_ids = replay_prompt_ids(r, cfg.vocab_size, options.seed)
        r.hash_block_size = r.hash_block_size or rc.block_size
    replica = build_live_replica(rc, runner, [cfg.eos_token_id], seed=options.seed)  # warms the model up
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
    run = serve(replica, requests, realtime=realtime, on_progress=show)
    after = check(runner) if check is not None else None
    if bar is not None:
        bar.close()
    req_df = request_frame(run.groups)
    it_df = run.log.frame()
    summary = summarize(req_df, it_df, rc.slo_ttft, rc.slo_tpot)
    summary.update(mode="live", model=options.model, device=options.device, wall_time_s=run.wall_time,
                   kv_capacity_tokens=runner.num_gpu_blocks * rc.block_size)
    if check is not None:
        summary.update(check_before=before, check_after=after)
    return req_df, it_df, summary


@dataclass
class LiveRun:
    groups: list[SequenceGroup]
    log: IterationLog
    wall_time: float
    beam_results: dict[int, list[tuple[list[int], float]]] = field(default_factory=dict)


def serve(replica: ReplicaStep, requests: list[Request], realtime: bool = True,
          on_progress=None, observer=None) -> LiveRun:
    """Replay requests (arrival offsets in seconds) against a live replica (build_live_replica:
    the loop's one iteration is the simulator's). With `realtime`, a request enters the queue when
    the wall clock reaches its arrival; without, all are queued at once. Each iteration's duration
    is measured wall time, scheduling and bookkeeping included. `observer(start, duration,
    scheduler)` is called after every iteration, as in simulation."""
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    scheduler = replica.scheduler
    t0 = time.perf_counter()
    def clock() -> float:
        return time.perf_counter() - t0

    if not realtime:
        for r in pending:
            r.arrival = 0.0
    while pending or scheduler.has_unfinished():
        now = clock()
        while pending and pending[0].arrival <= now:
            scheduler.add_request(pending.popleft())
        if not scheduler.has_unfinished():
            time.sleep(max(0.0, pending[0].arrival - clock()))
            continue
        step = replica.begin(now)
        if step.idle:
            if not step.plan.rejected:
                if not pending:
                    raise RuntimeError(f"scheduler {scheduler.name} is stuck with nothing running")
                time.sleep(max(0.0, min(pending[0].arrival - clock(), 0.01)))
            continue
        end = clock()
        step.result.duration = end - now  # measured: the model, scheduling and bookkeeping
        replica.complete(step, end)
        if observer is not None:
            observer(now, step.result.duration, scheduler)
        if on_progress is not None:
            on_progress(end, len(scheduler.done))
    scheduler.assert_drained()
    return LiveRun(list(scheduler.done), replica.log, time.perf_counter() - t0, replica.executor.beam_results)


def replay_prompt_ids(request: Request, vocab_size: int, seed: int = 0) -> list[int]:
    """The prompt a trace request replays: the trace's own token ids (checked against the model's
    vocabulary: an id outside it would index past the embedding), else seeded synthetic ones."""
    ids = request.prompt_token_ids
    if ids is None:
        return synthetic_prompt_ids(request, vocab_size, seed)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"request {request.request_id}: prompt token id {bad} is outside the model's vocabulary "
                         f"[0, {vocab_size})")
    return list(ids)


def synthetic_prompt_ids(request: Request, vocab_size: int, seed: int = 0) -> list[int]:
    """Token ids for a length-only trace request, seeded. Prompt blocks named by equal prefix
    hashes get equal tokens, so prefix caching finds the same sharing live as in simulation."""
    ids: list[int] = []
    lo = min(256, vocab_size // 2)  # stay clear of special tokens at the start of the vocabulary
    if request.prefix_hashes is not None:
        hbs = request.hash_block_size
        for h in request.prefix_hashes:
            need = min(hbs, request.prompt_len - len(ids))
            rng = np.random.default_rng([seed, int(h) & 0xFFFFFFFFFFFF])
            ids += rng.integers(lo, vocab_size, need).tolist()
    rest = request.prompt_len - len(ids)
    if rest > 0:
        rng = np.random.default_rng([seed, 1 << 40, request.request_id])
        ids += rng.integers(lo, vocab_size, rest).tolist()
    return ids[:request.prompt_len]
