"""`pagesim generate`: completions for prompts on a real model (wiring; backend.generate serves them)."""

from __future__ import annotations

import argparse
import json

from pagesim.argtypes import fraction, non_negative_float, non_negative_int, positive_int, seed
from pagesim.cli_args import add_device_args, require_backend
from policies.request import SamplingParams


def add_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate completions for prompts on a real model")
    gen.add_argument("--model", default="smollm2-135m")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    gen.add_argument("--max-tokens", type=positive_int, default=64)
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    mode.add_argument("--temperature", type=non_negative_float, help="sample at this temperature")
    gen.add_argument("--top-p", type=fraction, default=1.0)
    gen.add_argument("--top-k", type=non_negative_int, default=0)
    gen.add_argument("--seed", type=seed, default=0)
    width = gen.add_mutually_exclusive_group()
    width.add_argument("--n", type=positive_int, default=1, help="parallel samples per prompt")
    width.add_argument("--beam-width", type=positive_int, default=1)
    gen.add_argument("--ignore-eos", action="store_true")
    add_device_args(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=command)


def run(args: argparse.Namespace):
    """Each prompt's completions (backend.generate.Completions), in prompt order."""
    live = require_backend()
    from backend.generate import generate  # deferred: the backend imports torch

    model = live.load_model(args.model, seed=args.seed)
    if model.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer; generate needs one (use smollm2-135m)")
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, n=args.n,
                        beam_width=args.beam_width, temperature=args.temperature or 0.0, top_p=args.top_p,
                        top_k=args.top_k, seed=args.seed)
    return model.tokenizer, generate(model, args.prompt, sp, args.device, args.attention, args.seed)


def command(args: argparse.Namespace) -> int:
    tok, completions = run(args)
    for i, c in enumerate(completions):
        if args.json:
            print(json.dumps({"prompt": c.prompt, "prompt_token_ids": c.prompt_token_ids,
                              "completions": [{"token_ids": o, "text": tok.decode(o)} for o in c.outputs]}))
            continue
        for j, o in enumerate(c.outputs):
            label = f"[{i}]" + (f"[{j}]" if len(c.outputs) > 1 else "")
            print(f"{label} {c.prompt}{tok.decode(o)}")
    return 0
