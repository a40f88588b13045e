"""How live beam search picks parents, and the simulator's beam rule fitted to it (`pagesim beams`).

Beam search runs on a real model (EOS ignored) over a set of prompts at each beam width; every new
beam's parent rank is counted, q of the simulator's rule (parents picked with probability
proportional to q^rank, sim.executor) is fitted to the counts, and the memory saved by sharing is
compared: measured live, simulated with the fitted rule, and simulated with the measured picks.
torch is imported when the study runs (backend), not when this module is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from analysis.sharing import SharingMeter, sharing_saving
from sim.executor import BeamPicks, expected_distinct_parents, fit_beam_rank_decay
from sim.run import SimConfig
from traces.trace import Trace


@dataclass
class BeamsStudy:
    """A beams study's configuration: the loaded model (backend.live_executor.LoadedModel) and the tokenized
    prompts, the beam widths, the tokens per beam, the device and attention backend, the seed, and
    the simulator configuration each width's runs start from. `longest` is the longest prompt plus
    max_tokens."""

    model: Any  # backend.live_executor.LoadedModel
    prompts: list[list[int]]
    widths: list[int]
    max_tokens: int
    base: SimConfig
    device: str = "cpu"
    attention: str | None = None
    seed: int = 0

    @property
    def longest(self) -> int:
        return max(len(p) for p in self.prompts) + self.max_tokens


def run_beams(study: BeamsStudy, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Each beam width measured live and simulated on the same prompts, one row per width (rank
    counts, q, distinct parents, savings, pick vectors); `on_row(row)` after each."""
    # deferred: the backend imports torch
    from backend.beam_calibration import measure_parent_ranks
    from backend.model_runner import ModelRunner

    model, prompts = study.model, study.prompts
    # the same workload for the simulator: these prompt lengths, max_tokens each, all at once
    lengths = np.array([len(p) for p in prompts])
    same = Trace(arrival=np.zeros(len(prompts)), prompt_len=lengths, output_len=np.full(len(prompts), study.max_tokens),
                 name="beam prompts", source="pagesim beams", has_timestamps=False)
    results = []
    for width in study.widths:
        blocks = len(prompts) * width * (-(-study.longest // 16) + 2)
        runner = ModelRunner(model.config, model.weights, study.device, attention=study.attention,
                             num_gpu_blocks=blocks, block_size=16)
        meter = SharingMeter()
        ranks = measure_parent_ranks(runner, prompts, width, study.max_tokens, model.config.eos_token_id, study.seed,
                                     observer=meter)
        q = fit_beam_rank_decay(ranks.counts)
        cfg = dataclasses.replace(study.base, num_gpu_blocks=blocks, beam_width=width, beam_rank_decay=q)
        sim_rule, _ = sharing_saving(same, cfg)
        sim_picks, _ = sharing_saving(same, cfg, beam_picks={width: BeamPicks.from_counts(width, ranks.pick_vectors)})
        row = {"width": width, "steps": ranks.steps, "rank_counts": ranks.counts, "q": q,
               "mean_distinct_parents": sum(ranks.distinct_parents) / len(ranks.distinct_parents),
               "rule_distinct_parents": expected_distinct_parents(width, q),
               "saving_live": meter.saving, "saving_sim_rule": sim_rule, "saving_sim_picks": sim_picks,
               "pick_vectors": dict(sorted(ranks.pick_vectors.items(), key=lambda kv: -kv[1]))}
        results.append(row)
        if on_row is not None:
            on_row(row)
    return results
