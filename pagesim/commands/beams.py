"""`pagesim beams`: how live beam search picks parents, and the simulator's beam rule fitted to it
(analysis.beams). torch is imported when the command runs, not when its arguments are parsed."""

from __future__ import annotations

import argparse
from pathlib import Path

from analysis.beams import BeamsStudy, run_beams
from pagesim.argtypes import out_file, positive_int, seed
from pagesim.cli_args import add_device_args, require_backend, sim_config
from pagesim.report_writer import write_json


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


def study(args: argparse.Namespace) -> BeamsStudy:
    live = require_backend()
    from backend.beam_calibration import INSTRUCTIONS  # deferred: the backend imports torch

    model = live.load_model(args.model, seed=args.seed)
    if model.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; beams needs one (use smollm2-135m)")
    texts = INSTRUCTIONS
    if args.prompts_file:
        texts = [t for t in Path(args.prompts_file).read_text().splitlines() if t.strip()]
        if not texts:
            raise ValueError(f"{args.prompts_file}: no prompts (one per line)")
    prompts = [model.tokenizer.encode(t) for t in texts]
    # --beam-width is a list of widths here, not the config's per-request override
    s = BeamsStudy(model, prompts, args.beam_width, args.max_tokens, sim_config(args, beam_width=None), args.device,
                   args.attention, args.seed)
    if s.longest > model.config.max_position:
        raise ValueError(f"a prompt plus --max-tokens {args.max_tokens} exceeds the model's context "
                         f"({model.config.max_position})")
    return s


def command(args: argparse.Namespace) -> int:
    s = study(args)
    prompts = s.prompts
    print(f"beams: {len(prompts)} prompts (mean {sum(map(len, prompts)) / len(prompts):.1f} tokens), "
          f"{args.max_tokens} tokens per beam, EOS ignored, {args.model}")
    print(f"{'width':>5} {'steps':>6} {'q':>7} {'parents/step':>13} {'saving live':>12} {'sim rule':>9} "
          f"{'sim picks':>10}   parent-rank share: observed (rule with q)")
    widths = run_beams(s, on_row=print_row)
    if args.out:  # the counts and fits
        write_json(args.out, {"model": args.model, "max_tokens": args.max_tokens, "num_prompts": len(prompts),
                              "widths": widths})
    return 0


def print_row(r: dict) -> None:
    width, q, counts = r["width"], r["q"], r["rank_counts"]
    total = sum(counts)
    rule = [q ** k for k in range(width)]
    shares = "  ".join(f"{c / total:.3f} ({w / sum(rule):.3f})" for c, w in zip(counts, rule))
    print(f"{width:>5} {r['steps']:>6} {q:>7.3f} {r['mean_distinct_parents']:>6.2f} ({r['rule_distinct_parents']:.2f}) "
          f"{r['saving_live']:>12.1%} {r['saving_sim_rule']:>9.1%} {r['saving_sim_picks']:>10.1%}   {shares}",
          flush=True)
