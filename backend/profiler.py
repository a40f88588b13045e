"""The profiler: times a grid of batch compositions on a real model, the first step of calibration.

Each grid point is one engine iteration described the way a scheduler describes it: a list of
(new tokens, cached tokens) per sequence, plus blocks swapped and copied. The profiler builds the
`StepPlan` for it (so its `StepComposition` is computed by the very rule the schedulers use), runs
it through `ModelRunner.execute` and the sampler as the live executor does, and records the
composition's numbers and the median measured time. Fitting belongs to the simulator
(sim/profiled.py); the composition root (`pagesim profile`) joins the two into a profile file.

KV contents do not change a step's time, so the cache is not prefilled: a point's sequences get
distinct blocks (reading the same blocks for every sequence would flatter the caches) holding
whatever the cache holds.

Grid points time the executor alone. A live iteration also pays for scheduling, input preparation
and output bookkeeping, so the profiler then serves a small calibration workload through the real
`vllm` scheduler and `LiveExecutor` (all requests queued at once: batches from full down to one)
and records every iteration it ran, measured as `pagesim live` measures it. Its requests are
uniform in length and seeded apart from any trace a user validates against.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from backend.live_executor import build_live_replica
from backend.model_runner import Batch, ModelRunner, SeqInput
from backend.replay import serve
from backend.sampler import Sampler, SamplingParams, log_softmax
from policies.iteration_log import iteration_compositions
from policies.plan import ScheduledSeq, StepPlan
from policies.replica_config import ReplicaConfig


@dataclass(frozen=True)
class ProfilePoint:
    """One iteration to time: `seqs` as (new tokens, cached tokens before them) per sequence."""

    label: str
    seqs: tuple[tuple[int, int], ...]
    swap_blocks: int = 0  # swapped out, and as many swapped in
    copy_blocks: int = 0

    def blocks_needed(self, block_size: int) -> int:
        return sum(-(-(n + s) // block_size) for n, s in self.seqs) + 2 * self.swap_blocks + 2 * self.copy_blocks

    def kv_tokens(self) -> int:
        return sum(n + s for n, s in self.seqs)


@dataclass(frozen=True)
class ProfileGrid:
    """Which compositions to time. Decodes cover batch x context; prefills cover chunk length x
    batch x cached prefix (the prefix is what chunked prefill and recompute read back); mixed
    points put one prefill next to decodes; swap and copy points move blocks next to 8 decodes (the
    decodes beside a prefill, swap or copy have `side_context` tokens of context)."""

    decode_batches: tuple[int, ...] = (1, 4, 16, 32, 64)
    decode_contexts: tuple[int, ...] = (64, 256, 1024)
    prefill_lengths: tuple[int, ...] = (16, 64, 256, 512)
    prefill_batches: tuple[int, ...] = (1, 4)
    prefix_lengths: tuple[int, ...] = (0, 256)
    mixed_decodes: tuple[int, ...] = (8, 32)
    mixed_prefill: int = 128
    swap_blocks: tuple[int, ...] = (16, 64)
    copy_blocks: tuple[int, ...] = (64,)
    side_context: int = 256
    block_sizes: tuple[int, ...] = ()  # more block sizes at which every decode point is timed again
    reps: int = 3
    max_kv_tokens: int = 32768  # points holding more KV than this are skipped
    serve_requests: int = 24    # the served calibration workload (0: none)
    serve_prompt: tuple[int, int] = (16, 256)  # prompt lengths, uniform in [lo, hi]
    serve_output: tuple[int, int] = (16, 96)

    def points(self) -> list[ProfilePoint]:
        pts = [ProfilePoint(f"decode b={b} ctx={c}", ((1, c - 1),) * b)
               for b in self.decode_batches for c in self.decode_contexts]
        pts += [ProfilePoint(f"prefill b={b} len={n} prefix={p}", ((n, p),) * b)
                for b in self.prefill_batches for n in self.prefill_lengths for p in self.prefix_lengths]
        side = (1, self.side_context - 1)
        pts += [ProfilePoint(f"mixed decodes={d} prefill={self.mixed_prefill}",
                             ((self.mixed_prefill, 0),) + (side,) * d) for d in self.mixed_decodes]
        pts += [ProfilePoint(f"swap {k} blocks out+in", (side,) * 8, swap_blocks=k) for k in self.swap_blocks]
        pts += [ProfilePoint(f"copy {k} blocks", (side,) * 8, copy_blocks=k) for k in self.copy_blocks]
        return [p for p in pts if p.kv_tokens() <= self.max_kv_tokens]

    def decode_points(self) -> list[ProfilePoint]:
        """The points --block-sizes times again: plain decodes (no prefill, swap or copy)."""
        return [p for p in self.points() if p.label.startswith("decode ")]

    def served_blocks_needed(self, block_size: int) -> int:
        """Device blocks the served workload can hold at once (every request at its longest)."""
        return self.serve_requests * -(-(self.serve_prompt[1] + self.serve_output[1]) // block_size)

    def blocks_needed(self, block_size: int) -> tuple[int, int]:
        """(device blocks, CPU blocks) a runner needs for every point and the served workload."""
        pts = self.points()
        return (max([p.blocks_needed(block_size) for p in pts] + [self.served_blocks_needed(block_size)]),
                max([p.swap_blocks for p in pts] + [1]))

    @classmethod
    def quick(cls) -> ProfileGrid:
        """A small grid (tests, smoke runs): enough points to fit every coefficient."""
        return cls(decode_batches=(1, 4), decode_contexts=(16, 48), prefill_lengths=(8, 24), prefill_batches=(1, 2),
                   prefix_lengths=(0, 16), mixed_decodes=(2,), mixed_prefill=8, swap_blocks=(2,), copy_blocks=(2,),
                   side_context=16, reps=2, max_kv_tokens=512, serve_requests=4, serve_prompt=(4, 24),
                   serve_output=(2, 6))


@dataclass
class ProfileRun:
    measurements: list[dict]
    skipped: list[str] = field(default_factory=list)  # points that did not fit the cache, with why


def profile_model(runner: ModelRunner, grid: ProfileGrid, seed: int = 0,
                  on_point: Callable[[int, int, dict], None] | None = None) -> ProfileRun:
    """Time every grid point that fits the runner's cache; `on_point(i, total, measurement)` after each."""
    rng = np.random.default_rng(seed)
    sampler = Sampler(seed=seed, device=runner.device)
    points = grid.points()
    run = ProfileRun([])
    total = len(points) + (1 if grid.serve_requests else 0)
    # the same model over caches of the other block sizes; each decode point is timed at all of
    # them back to back, so that the machine's drift does not pass for a block-size effect
    decodes = grid.decode_points()
    others = [runner.with_cache(bs, max(p.blocks_needed(bs) for p in decodes))
              for bs in dict.fromkeys(grid.block_sizes) if bs != runner.block_size] if decodes else []
    for i, point in enumerate(points):
        why = _cannot_run(point, runner)
        if why:
            run.skipped.append(f"{point.label}: {why}")
            continue
        built = [(r, *_build(point, r, rng)) for r in [runner] + (others if point in decodes else [])]
        timed = _time_interleaved([(r, batch) for r, _, batch in built], sampler, grid.reps)
        for (r, plan, _), times in zip(built, timed):
            label = point.label if r is runner else f"{point.label} bs={r.block_size}"
            m = {"label": label, **plan.composition().counts(), "block_size": r.block_size,
                 "time_s": statistics.median(times), "times_s": times}
            run.measurements.append(m)
        if on_point is not None:
            on_point(i, total, m)
    need = grid.served_blocks_needed(runner.block_size)
    if grid.serve_requests and need > runner.num_gpu_blocks:
        run.skipped.append(f"served workload: needs up to {need} device blocks; the cache has {runner.num_gpu_blocks}")
    elif grid.serve_requests:
        served = serve_calibration(runner, grid, seed)
        run.measurements += served
        if on_point is not None and served:
            on_point(total - 1, total, served[-1])
    return run


def _cannot_run(point: ProfilePoint, runner: ModelRunner) -> str:
    """Why the runner cannot time `point` ("" when it can): its cache is too small, or a sequence
    is longer than the model's context (that was the runner's error, after minutes of profiling)."""
    need = point.blocks_needed(runner.block_size)
    if need > runner.num_gpu_blocks or point.swap_blocks > runner.kv_cache.num_cpu_blocks:
        return (f"needs {need} device blocks and {point.swap_blocks} CPU blocks; the cache has "
                f"{runner.num_gpu_blocks} and {runner.kv_cache.num_cpu_blocks}")
    longest = max(n + s for n, s in point.seqs)
    if longest > runner.config.max_position:
        return f"a sequence of {longest} tokens exceeds the model's context of {runner.config.max_position}"
    return ""


def calibration_requests(grid: ProfileGrid, vocab_size: int, seed: int = 0) -> list:
    """The served calibration workload: seeded uniform prompt and output lengths, EOS ignored."""
    from policies.request import Request
    from policies.request import SamplingParams as RequestParams

    rng = np.random.default_rng([seed, 0xCA1])
    lo = min(256, vocab_size // 2)
    requests = []
    for i in range(grid.serve_requests):
        p = int(rng.integers(grid.serve_prompt[0], grid.serve_prompt[1] + 1))
        out = int(rng.integers(grid.serve_output[0], grid.serve_output[1] + 1))
        ids = rng.integers(lo, vocab_size, p).tolist()
        requests.append(Request(i, 0.0, p, RequestParams(max_tokens=out, ignore_eos=True), out, ids))
    return requests


def serve_calibration(runner: ModelRunner, grid: ProfileGrid, seed: int = 0) -> list[dict]:
    """Serve `grid.serve_requests` seeded uniform-length requests, all queued at once, through the
    vllm scheduler and the live executor; one measurement per iteration (its loop wall time)."""
    requests = calibration_requests(grid, runner.config.vocab_size, seed)
    replica = build_live_replica(ReplicaConfig(runner.num_gpu_blocks, runner.block_size), runner,
                                 [runner.config.eos_token_id], seed=seed)
    log = serve(replica, requests, realtime=False).log.frame()  # it records each composition
    return [{"label": "served", **c.counts(), "time_s": float(t), "source": "served"}
            for c, t in zip(iteration_compositions(log, runner.block_size), log.duration, strict=True)]


def _build(point: ProfilePoint, runner: ModelRunner, rng: np.random.Generator) -> tuple[StepPlan, Batch]:
    """The plan a scheduler would hand over for this point, and the runner's batch for it."""
    bs, vocab = runner.block_size, runner.config.vocab_size
    next_block = 0
    seqs, inputs = [], []
    for j, (n, start) in enumerate(point.seqs):
        nb = -(-(n + start) // bs)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        seqs.append(ScheduledSeq(j, j, start, n, table, True, None))  # priced, never executed
        inputs.append(SeqInput(rng.integers(min(256, vocab // 2), vocab, n).tolist(), start, table, True))
    k = point.swap_blocks
    swap_out = [(next_block + b, b) for b in range(k)]
    swap_in = [(b, next_block + k + b) for b in range(k)]
    next_block += 2 * k
    copies = [(next_block + b, next_block + point.copy_blocks + b) for b in range(point.copy_blocks)]
    plan = StepPlan(seqs=seqs, copies=copies, swap_out=swap_out, swap_in=swap_in, block_size=bs)
    return plan, Batch(inputs, copies, swap_in, swap_out)


def _time_point(runner: ModelRunner, batch: Batch, sampler: Sampler, reps: int) -> list[float]:
    """Wall times of `reps` executions after one warm-up: swaps, copies, forward pass, then greedy
    sampling and the chosen tokens' log-probabilities, as the live executor does per step."""
    return _time_interleaved([(runner, batch)], sampler, reps)[0]


def _time_interleaved(runs: list[tuple[ModelRunner, Batch]], sampler: Sampler, reps: int) -> list[list[float]]:
    """`_time_point` for several (runner, batch) pairs, repetitions taken in turn (one of each, then
    again), so that a slow spell of the machine falls on all of them alike."""
    for runner, batch in runs:
        _execute(runner, batch, sampler)  # warm-up
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for i, (runner, batch) in enumerate(runs):
            times[i].append(_execute(runner, batch, sampler))
    return times


def _execute(runner: ModelRunner, batch: Batch, sampler: Sampler) -> float:
    params = [SamplingParams(temperature=0.0)] * len(batch.seqs)
    t0 = time.perf_counter()
    logits = runner.execute(batch)
    tokens = sampler(logits, params)
    log_softmax(logits).gather(-1, tokens[:, None]).tolist()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def environment(runner: ModelRunner, model_name: str) -> dict:
    """Where a profile was measured: model, device, software (kept in the profile file)."""
    cfg = runner.config
    dev = runner.device
    device = {"type": dev.type, "threads": torch.get_num_threads(), "machine": platform.machine(),
              "processor": platform.processor() or platform.machine()}
    if dev.type == "cuda":
        device["name"] = torch.cuda.get_device_name(dev)
    else:
        device["name"] = _cpu_name()
    attn = runner.attention
    software = {"python": platform.python_version(), "torch": torch.__version__,
                "pagesim": _version("pagesim"), "triton": _version("triton"),
                "attention": f"{getattr(attn, '__module__', '')}.{getattr(attn, '__name__', type(attn).__name__)}"}
    model = {"name": model_name, "arch": cfg.arch, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
             "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
             "vocab_size": cfg.vocab_size}
    return {"model": model, "device": device, "software": software, "dtype": str(runner.dtype).removeprefix("torch.")}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


DRIFT_LABELS = ("decode b=4 ctx=256", "decode b=16 ctx=256", "decode b=32 ctx=64", "prefill b=1 len=256 prefix=0")


def drift(runner: ModelRunner, measurements: list[dict], labels: tuple[str, ...] = DRIFT_LABELS, reps: int = 3,
          seed: int = 0) -> float | None:
    """How fast this machine runs now against when a profile was measured: the median over a few
    of the profile's grid points of (time now / time in the profile). None when the profile holds
    none of those points or they do not fit the runner's cache."""
    recorded = {m["label"]: m["time_s"] for m in measurements if m.get("source", "grid") == "grid"}
    points = [p for p in ProfileGrid().points() if p.label in labels and p.label in recorded
              and p.blocks_needed(runner.block_size) <= runner.num_gpu_blocks]
    if not points:
        return None
    rng = np.random.default_rng(seed)
    sampler = Sampler(seed=seed, device=runner.device)
    ratios = [statistics.median(_time_point(runner, _build(p, runner, rng)[1], sampler, reps)) / recorded[p.label]
              for p in points]
    return float(statistics.median(ratios))


@dataclass
class Retimed:
    """A profile's measurements taken again on this machine (`retime`)."""

    measurements: list[dict]
    speed: float          # median over the re-timed grid points of (time now / time in the profile)
    retimed: int          # grid points timed again
    carried: int          # points at other block sizes carried over, scaled by `speed`
    served: int           # served iterations measured again
    skipped: list[str] = field(default_factory=list)


def retime(runner: ModelRunner, measurements: list[dict], block_size: int, reps: int = 2, seed: int = 0,
           grid: ProfileGrid | None = None) -> Retimed:
    """Time again, on `runner`'s model, the grid points a profile holds at its own block size (the
    same compositions, by label, `reps` repetitions each) and serve the calibration workload again
    if the profile had served iterations. The profile's decode points at other block sizes (what
    prices KV blocks apart from tokens) are not re-timed, which would take several times longer:
    they are carried over with their times scaled by the speed measured on the re-timed points, so
    that the block term keeps its measured share. Runs on its own cache (the runner's is left
    alone). Raises ValueError when none of the profile's grid points is in the grid."""
    served = any(m.get("source") == "served" for m in measurements)
    grid = replace(grid or ProfileGrid(), reps=reps, block_sizes=(),
                   serve_requests=(grid or ProfileGrid()).serve_requests if served else 0)
    own = {m["label"]: m for m in measurements
           if m.get("source", "grid") == "grid" and m.get("block_size", block_size) == block_size}
    others = [m for m in measurements if m.get("source", "grid") == "grid" and m.get("block_size", block_size) != block_size]
    points = [p for p in grid.points() if p.label in own]
    if not points:
        raise ValueError("the profile holds none of the profiler's grid points (labels); re-profile it with "
                         "`pagesim profile`")
    need = max([p.blocks_needed(block_size) for p in points] + [grid.served_blocks_needed(block_size) * served])
    cache = runner.with_cache(block_size, need, max([p.swap_blocks for p in points] + [1]))
    rng = np.random.default_rng(seed)
    sampler = Sampler(seed=seed, device=runner.device)
    out, ratios = [], []
    for p in points:
        plan, batch = _build(p, cache, rng)
        # one more warm-up than `profile_model`: with few repetitions, a timed one that still pays
        # a new shape's compilation would move the median (measured: 43x on a first pass, 4.7x after)
        _execute(cache, batch, sampler)
        times = _time_point(cache, batch, sampler, reps)
        t = statistics.median(times)
        out.append({"label": p.label, **plan.composition().counts(), "block_size": block_size, "time_s": t,
                    "times_s": times})
        ratios.append(t / own[p.label]["time_s"])
    speed = float(statistics.median(ratios))
    carried = [{**{k: v for k, v in m.items() if k != "times_s"}, "time_s": m["time_s"] * speed, "scaled_by": speed}
               for m in others]
    again = serve_calibration(cache, grid, seed) if served else []
    timed = {p.label for p in points}
    return Retimed(out + carried + again, speed, len(out), len(carried), len(again),
                   [f"{label}: not a point of the profiler's grid" for label in own if label not in timed])
