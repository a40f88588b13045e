"""How real beam search picks parents: the measurement behind the simulator's beam rule.

The simulated executor lets the k new beams of a step pick parents by rank with probability
proportional to q^rank (sim/executor.py). Here the live engine runs beam search on real prompts
(EOS ignored, as the simulator assumes) and counts, at every step with k current beams, how many new
beams each parent rank received. `sim.executor.fit_beam_rank_decay` turns the counts into q.

The built-in prompts are short instructions written for this project in the style of the Alpaca
dataset the vLLM paper used for its beam-search study (its prompts average 19 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.live_executor import build_live_replica
from backend.model_runner import ModelRunner
from backend.replay import serve
from policies.replica_config import ReplicaConfig
from policies.request import Request, SamplingParams

INSTRUCTIONS = (
    "Give three tips for keeping a houseplant alive.",
    "Explain why the sky looks blue during the day.",
    "Write a short poem about a lighthouse.",
    "List five fruits that are high in vitamin C.",
    "Describe how a bicycle gear system works.",
    "Suggest a name for a bakery that sells only bread.",
    "Summarize the water cycle in two sentences.",
    "What are the main causes of inflation?",
    "Translate 'good morning, how are you?' into French.",
    "Write a haiku about autumn leaves.",
    "Explain the difference between weather and climate.",
    "Give an example of a metaphor and explain it.",
    "How do vaccines help the immune system?",
    "Write an opening line for a mystery novel.",
    "List three ways to reduce household energy use.",
    "Describe the taste of a ripe mango to someone who has never had one.",
    "Why do cats purr?",
    "Explain what a prime number is to a ten-year-old.",
    "Write a polite email declining a meeting invitation.",
    "What should I pack for a weekend hiking trip?",
    "Compare trains and planes for a 500 km journey.",
    "Give two arguments for learning a second language.",
    "Describe a sunset over the ocean in one paragraph.",
    "How does a refrigerator keep food cold?",
)


@dataclass
class ParentRanks:
    """counts[r]: new beams whose parent had rank r, over `steps` steps that had `width` current beams.
    `distinct_parents` checks the rule beyond these shares: how many beams survive each step."""

    width: int
    counts: list[int]
    steps: int = 0
    per_group_steps: dict[int, int] = field(default_factory=dict)
    distinct_parents: list[int] = field(default_factory=list)  # per counted step: how many parents were picked
    pick_vectors: dict[str, int] = field(default_factory=dict)  # "c0,c1,..." (children per rank) -> steps


def measure_parent_ranks(runner: ModelRunner, prompts: list[list[int]], width: int, max_tokens: int,
                         eos_token_id: int, seed: int = 0, observer=None) -> ParentRanks:
    """Beam-search every prompt (token ids) to `max_tokens` tokens, EOS ignored, all in one served
    batch, and count parent ranks. The first step of each search (one beam, the prompt) is left
    out: all k beams descend from it. `observer` is handed to `serve` (e.g. a sharing meter)."""
    if width < 2:
        raise ValueError(f"width: beam search needs a width >= 2, got {width}")
    ranks = ParentRanks(width, [0] * width)

    def observe(gid: int, current: int, parents: list[int]) -> None:
        if current != width:
            return
        ranks.steps += 1
        ranks.per_group_steps[gid] = ranks.per_group_steps.get(gid, 0) + 1
        for p in parents:
            ranks.counts[p] += 1
        ranks.distinct_parents.append(len(set(parents)))
        key = ",".join(str(parents.count(r)) for r in range(width))
        ranks.pick_vectors[key] = ranks.pick_vectors.get(key, 0) + 1

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, beam_width=width)
    requests = [Request(i, 0.0, len(ids), sp, prompt_token_ids=list(ids)) for i, ids in enumerate(prompts)]
    replica = build_live_replica(ReplicaConfig(runner.num_gpu_blocks, runner.block_size), runner, [eos_token_id],
                                 seed=seed, beam_observer=observe)
    serve(replica, requests, realtime=False, observer=observer)
    return ranks
