"""Completions for a few prompts on a real model (`pagesim generate`): the prompts become requests
served at once by the vllm scheduler on a KV cache sized to hold them all, and each request's
completions come back in prompt order (its samples, or its beams best first).
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.live_executor import LoadedModel, build_live_replica
from backend.model_runner import ModelRunner
from backend.replay import serve
from policies.replica_config import ReplicaConfig
from policies.request import Request, SamplingParams

BLOCK_SIZE = 16


@dataclass
class Completions:
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[list[int]]  # token ids of each completion (one per sample or beam)


def generate(model: LoadedModel, prompts: list[str], sampling: SamplingParams, device: str = "cpu",
             attention: str | None = None, seed: int = 0) -> list[Completions]:
    """Each prompt's completions. A prompt that is empty, or whose tokens plus max_tokens exceed the
    model's context, is refused (ValueError naming it) before the model runs."""
    tok, cfg = model.tokenizer, model.config
    if tok is None:
        raise ValueError("the model has no tokenizer; generate needs one (use smollm2-135m)")
    requests = []
    for i, text in enumerate(prompts):
        ids = tok.encode(text)
        if not ids or not text:
            raise ValueError(f"prompt {i + 1} is empty")
        if len(ids) + sampling.max_tokens > cfg.max_position:
            raise ValueError(f"prompt {i + 1}: {len(ids)} tokens + --max-tokens {sampling.max_tokens} exceeds the "
                             f"model's context of {cfg.max_position}")
        requests.append(Request(i, 0.0, len(ids), sampling, prompt_token_ids=ids))
    # every sequence's blocks at its longest, plus one each for copy-on-write, plus a little slack
    per_request = max(sampling.n, sampling.beam_width)
    blocks = sum(-(-(r.prompt_len + sampling.max_tokens) // BLOCK_SIZE) + 1 for r in requests) * per_request + 8
    runner = ModelRunner(cfg, model.weights, device, attention=attention, num_gpu_blocks=blocks, block_size=BLOCK_SIZE)
    config = ReplicaConfig(blocks, BLOCK_SIZE, max_num_batched_tokens=max(4096, cfg.max_position))
    run = serve(build_live_replica(config, runner, [cfg.eos_token_id], seed=seed), requests, realtime=False)
    out = []
    for g in sorted(run.groups, key=lambda g: g.group_id):
        p = g.request.prompt_len
        if g.group_id in run.beam_results:
            outputs = [toks for toks, _ in run.beam_results[g.group_id]]
        else:
            outputs = [s.token_ids[p:] for s in sorted(g.finished_seqs, key=lambda s: s.seq_id)]
        out.append(Completions(prompts[g.group_id], g.request.prompt_token_ids, outputs))
    return out
