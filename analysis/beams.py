"""How live beam search picks parents, and the simulator's beam rule fitted to it (`pagesim beams`).

Beam search runs on a real model (EOS ignored) over a set of prompts at each beam width; every new
beam's parent rank is counted, q of the simulator's rule (parents picked with probability
proportional to q^rank, sim.executor) is fitted to the counts, and the memory saved by sharing is
compared: measured live, simulated with the fitted rule, and simulated with the measured picks.
torch is imported when the study runs (backend), not when its arguments are parsed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.cli_args import add_device_args, require_backend, sim_config
from pagesim.argtypes import out_file, positive_int, seed


def add_parser(sub: argparse._SubParsersAction) -> None:
    bm = sub.add_parser("beams", help="measure how live beam search picks parents; fit the simulator's beam rule",
                        description="Run beam search on a real model (EOS ignored), count the parent rank of "
                                    "every new beam, and fit q of the simulator's rule (parents picked with "
                                    "probability proportional to q^rank; `simulate`/`sharing --beam-decay`).")
    bm.add_argument("--model", default="smollm2-135m")
    add_device_args(bm)
    bm.add_argument("--beam-width", type=positive_int, nargs="+", default=[2, 4, 6])
    bm.add_argument("--max-tokens", type=positive_int, default=58, help="tokens per beam (default 58, Alpaca's mean output)")
    bm.add_argument("--prompts-file", help="one prompt per line (default: 24 built-in short instructions)")
    bm.add_argument("--seed", type=seed, default=0)
    bm.add_argument("--out", type=out_file, help="write the counts and fits here (.json)")  # checked before the run
    bm.set_defaults(func=command)


@dataclass
class BeamsStudy:
    """The loaded model and the tokenized prompts; `longest` is the longest prompt plus --max-tokens."""

    model: Any  # backend.live_executor.LoadedModel
    prompts: list[list[int]]
    longest: int


@dataclass
class BeamsResult:
    study: BeamsStudy
    widths: list[dict]  # one per beam width: rank counts, q, distinct parents, savings, pick vectors


def prepare(args: argparse.Namespace) -> BeamsStudy:
    live = require_backend()
    from backend.beam_calibration import INSTRUCTIONS

    model = live.load_model(args.model, seed=args.seed)
    if model.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; beams needs one (use smollm2-135m)")
    texts = INSTRUCTIONS
    if args.prompts_file:
        texts = [t for t in Path(args.prompts_file).read_text().splitlines() if t.strip()]
        if not texts:
            raise ValueError(f"{args.prompts_file}: no prompts (one per line)")
    prompts = [model.tokenizer.encode(t) for t in texts]
    longest = max(len(p) for p in prompts) + args.max_tokens
    if longest > model.config.max_position:
        raise ValueError(f"a prompt plus --max-tokens {args.max_tokens} exceeds the model's context "
                         f"({model.config.max_position})")
    return BeamsStudy(model, prompts, longest)


def run(args: argparse.Namespace, study: BeamsStudy | None = None,
        on_row: Callable[[dict], None] | None = None) -> BeamsResult:
    """Each --beam-width measured live and simulated on the same prompts; `on_row(row)` after each."""
    import numpy as np

    from analysis.sharing import SharingMeter, sharing_saving
    from backend.beam_calibration import measure_parent_ranks
    from backend.model_runner import ModelRunner
    from sim.executor import BeamPicks, expected_distinct_parents, fit_beam_rank_decay
    from traces.trace import Trace

    study = study or prepare(args)
    model, prompts = study.model, study.prompts
    # the same workload for the simulator: these prompt lengths, max_tokens each, all at once
    lengths = np.array([len(p) for p in prompts])
    same = Trace(arrival=np.zeros(len(prompts)), prompt_len=lengths, output_len=np.full(len(prompts), args.max_tokens),
                 name="beam prompts", source="pagesim beams", has_timestamps=False)
    results = []
    for width in args.beam_width:
        blocks = len(prompts) * width * (-(-study.longest // 16) + 2)
        runner = ModelRunner(model.config, model.weights, args.device, attention=args.attention,
                             num_gpu_blocks=blocks, block_size=16)
        meter = SharingMeter()
        ranks = measure_parent_ranks(runner, prompts, width, args.max_tokens, model.config.eos_token_id, args.seed,
                                     observer=meter)
        q = fit_beam_rank_decay(ranks.counts)
        cfg = sim_config(args, num_gpu_blocks=blocks, beam_width=width, beam_rank_decay=q)
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
    return BeamsResult(study, results)


def command(args: argparse.Namespace) -> int:
    study = prepare(args)
    print_header(args, study)
    write_report(args, run(args, study, on_row=print_row))
    return 0


def print_header(args: argparse.Namespace, study: BeamsStudy) -> None:
    prompts = study.prompts
    print(f"beams: {len(prompts)} prompts (mean {sum(map(len, prompts)) / len(prompts):.1f} tokens), "
          f"{args.max_tokens} tokens per beam, EOS ignored, {args.model}")
    print(f"{'width':>5} {'steps':>6} {'q':>7} {'parents/step':>13} {'saving live':>12} {'sim rule':>9} "
          f"{'sim picks':>10}   parent-rank share: observed (rule with q)")


def print_row(r: dict) -> None:
    width, q, counts = r["width"], r["q"], r["rank_counts"]
    total = sum(counts)
    rule = [q ** k for k in range(width)]
    shares = "  ".join(f"{c / total:.3f} ({w / sum(rule):.3f})" for c, w in zip(counts, rule))
    print(f"{width:>5} {r['steps']:>6} {q:>7.3f} {r['mean_distinct_parents']:>6.2f} ({r['rule_distinct_parents']:.2f}) "
          f"{r['saving_live']:>12.1%} {r['saving_sim_rule']:>9.1%} {r['saving_sim_picks']:>10.1%}   {shares}",
          flush=True)


def write_report(args: argparse.Namespace, result: BeamsResult) -> None:
    """The counts and fits as JSON, when --out is given."""
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens,
                                              "num_prompts": len(result.study.prompts), "widths": result.widths},
                                             indent=1) + "\n")
        print(f"wrote {args.out}")
