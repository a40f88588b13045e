"""Synthetic workload generators (seeded, length-only: arrivals come from ``apply_arrivals``).

``sharegpt_like`` and ``alpaca_like`` imitate the two workloads of the vLLM paper (SOSP'23,
Sec. 6.1), which published only their mean lengths with the OPT tokenizer:

    ShareGPT: mean input 161, mean output 338 tokens;  Alpaca: mean input 19, mean output 58.

The fit, and what is assumed beyond the published means:

- Distribution: prompt and output lengths are independent lognormals, rounded to the nearest
  integer and clipped: prompt to [1, PROMPT_CAP], output to [1, TOTAL_CAP - prompt]. TOTAL_CAP =
  2048 is the OPT models' context (prompt + output must fit); PROMPT_CAP = 1024 is the prompt
  filter of vLLM's benchmark script that produced the paper's workloads, which also guarantees
  every request at least 1024 tokens of output room.
- Spread (sigma of the underlying normal) is an assumption, chosen to give the long right tails
  of the paper's Figure 11 histograms: sigma 1.0 for ShareGPT prompts and outputs, 0.6 for Alpaca
  prompts (short, similar instructions) and 1.0 for Alpaca outputs.
- mu is *solved*, not set: rounding and clipping move the mean away from the lognormal's
  exp(mu + sigma^2/2), so ``fit_mu`` computes the exact mean of the rounded, clipped
  distribution (output mean averaged over the prompt distribution, because the output cap
  depends on the prompt) and bisects on mu until it equals the published mean.

``shared_prefix`` builds prefix-caching workloads, ``grouped_prefix`` the recurring shared prompts
of load generators (inference-perf's shared_prefix data); ``fixed`` gives identical requests.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from traces.trace import Trace

PROMPT_CAP = 1024
TOTAL_CAP = 2048


@dataclass(frozen=True)
class LengthModel:
    """Target means (published) and assumed lognormal spreads for one workload."""

    name: str
    prompt_mean: float
    output_mean: float
    prompt_sigma: float
    output_sigma: float
    prompt_cap: int = PROMPT_CAP
    total_cap: int = TOTAL_CAP


SHAREGPT = LengthModel("sharegpt-like", prompt_mean=161, output_mean=338, prompt_sigma=1.0, output_sigma=1.0)
ALPACA = LengthModel("alpaca-like", prompt_mean=19, output_mean=58, prompt_sigma=0.6, output_sigma=1.0)


def _lognormal_sf(x: np.ndarray, mu: float, sigma: float) -> np.ndarray:
    """P(X >= x) for X = exp(N(mu, sigma^2)), x > 0."""
    z = (np.log(x) - mu) / (sigma * math.sqrt(2.0))
    return np.array([0.5 * math.erfc(v) for v in z])


def _capped_means(mu: float, sigma: float, max_cap: int) -> np.ndarray:
    """m[c] = E[clip(rint(X), 1, c)] for c = 0..max_cap (m[0] unused).

    E[clip(rint(X), 1, c)] = 1 + sum_{k=2..c} P(rint(X) >= k) = 1 + sum_{k=2..c} P(X >= k - 1/2).
    """
    tail = _lognormal_sf(np.arange(2, max_cap + 1) - 0.5, mu, sigma)
    return np.concatenate([[0.0, 1.0], 1.0 + np.cumsum(tail)])


def _prompt_pmf(mu: float, sigma: float, cap: int) -> np.ndarray:
    """pmf[k] = P(clip(rint(X), 1, cap) = k) for k = 0..cap."""
    sf = np.concatenate([[1.0, 1.0], _lognormal_sf(np.arange(2, cap + 1) - 0.5, mu, sigma), [0.0]])
    # sf[k] = P(Z >= k) for k = 0..cap+1, so P(Z = k) = sf[k] - sf[k+1].
    return sf[:-1] - sf[1:]


def _bisect(mean_of: Callable[[float], float], target: float, sigma: float, cap: int) -> float:
    """The mu at which the increasing function ``mean_of`` equals ``target``."""
    lo, hi = -5.0 * sigma, math.log(cap) + 5.0 * sigma
    for _ in range(60):  # interval width shrinks 2^60-fold: far below any visible effect
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mean_of(mid) < target else (lo, mid)
    return 0.5 * (lo + hi)


@cache
def fit_mu(model: LengthModel) -> tuple[float, float]:
    """(mu_prompt, mu_output) such that the rounded, clipped lengths have the model's means."""
    mu_p = _bisect(
        lambda mu: _capped_means(mu, model.prompt_sigma, model.prompt_cap)[model.prompt_cap],
        model.prompt_mean, model.prompt_sigma, model.prompt_cap,
    )
    pmf = _prompt_pmf(mu_p, model.prompt_sigma, model.prompt_cap)
    caps = model.total_cap - np.arange(model.prompt_cap + 1)  # output cap for each prompt length

    def output_mean(mu: float) -> float:
        means = _capped_means(mu, model.output_sigma, model.total_cap - 1)
        return float(np.dot(pmf, means[caps.clip(0, model.total_cap - 1)]))

    mu_o = _bisect(output_mean, model.output_mean, model.output_sigma, model.total_cap)
    return mu_p, mu_o


def _sample_lengths(model: LengthModel, n: int, seed: int) -> Trace:
    mu_p, mu_o = fit_mu(model)
    rng = np.random.default_rng(seed)
    prompt = np.clip(np.rint(rng.lognormal(mu_p, model.prompt_sigma, n)), 1, model.prompt_cap).astype(np.int64)
    output = np.rint(rng.lognormal(mu_o, model.output_sigma, n))
    output = np.clip(output, 1, model.total_cap - prompt).astype(np.int64)
    return _length_only(prompt, output, model.name, f"synthetic:{model.name} seed={seed}")


def _length_only(prompt: np.ndarray, output: np.ndarray, name: str, source: str, **extra: Any) -> Trace:
    return Trace(
        arrival=np.zeros(len(prompt)),
        prompt_len=prompt,
        output_len=output,
        name=name,
        source=source,
        has_timestamps=False,
        **extra,
    )


def sharegpt_like(n: int, seed: int = 0) -> Trace:
    """ShareGPT-like lengths (vLLM paper: means 161/338, prompt+output <= 2048)."""
    return _sample_lengths(SHAREGPT, n, seed)


def alpaca_like(n: int, seed: int = 0) -> Trace:
    """Alpaca-like lengths (vLLM paper: means 19/58, prompt+output <= 2048)."""
    return _sample_lengths(ALPACA, n, seed)


def fixed(n: int, seed: int = 0, prompt_len: int = 512, output_len: int = 128) -> Trace:
    """n identical requests (``seed`` is accepted for a uniform signature and unused)."""
    prompt = np.full(n, prompt_len, np.int64)
    return _length_only(prompt, np.full(n, output_len, np.int64), "fixed", f"synthetic:fixed {prompt_len}/{output_len}")


def _block_hash(parent: int, kind: int, a: int, b: int) -> int:
    """Chained hash of one block: equal iff parent hash and block content are equal.

    blake2b rather than hash() so that values are stable across processes and platforms; 63 bits
    so they fit int64 columns.
    """
    digest = hashlib.blake2b(struct.pack("<qqqq", parent, kind, a, b), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_PREFIX, _PRIVATE = 1, 2  # block content kinds: shared prefix content, or request-private content


def _prompt_hashes(prefix_id: int, request: int, prefix_len: int, prompt_len: int, block: int) -> tuple[int, ...]:
    """Hashes of every block of a prompt (the last may be partial): blocks lying wholly in the
    prefix have content (prefix_id, j); any block touching the suffix is private to the request."""
    hashes, parent = [], 0
    for j in range(-(-prompt_len // block)):
        shared = (j + 1) * block <= prefix_len
        parent = _block_hash(parent, *((_PREFIX, prefix_id, j) if shared else (_PRIVATE, request, j)))
        hashes.append(parent)
    return tuple(hashes)


def shared_prefix(n: int, seed: int = 0, num_prefixes: int = 4, prefix_len: int = 512, suffix_len: int = 64,
                  output_len: int = 128, hash_block_size: int = 16) -> Trace:
    """Requests that each start with one of ``num_prefixes`` shared prefixes (chosen uniformly at
    random, seeded) followed by a private suffix.

    Every request has prompt_len = prefix_len + suffix_len; prefix_hashes name all
    ceil(prompt_len / hash_block_size) blocks, chained, so requests with the same prefix share
    exactly the first prefix_len // hash_block_size hashes and nothing else.
    """
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise ValueError("shared_prefix needs num_prefixes >= 1, prefix_len, suffix_len >= 0 and a non-empty prompt")
    if hash_block_size < 1:
        raise ValueError(f"hash_block_size must be >= 1, got {hash_block_size}")
    choice = np.random.default_rng(seed).integers(num_prefixes, size=n)
    plen = prefix_len + suffix_len
    hashes = [_prompt_hashes(int(k), i, prefix_len, plen, hash_block_size) for i, k in enumerate(choice)]
    return _length_only(
        np.full(n, plen, np.int64),
        np.full(n, output_len, np.int64),
        "shared-prefix",
        f"synthetic:shared-prefix k={num_prefixes} {prefix_len}+{suffix_len} seed={seed}",
        prefix_hashes=hashes,
        hash_block_size=hash_block_size,
    )


def grouped_prefix(
    n: int,
    seed: int = 0,
    num_groups: int = 10,
    prompts_per_group: int = 10,
    system_prompt_len: int = 100,
    question_len: int = 447,
    output_len: int = 248,
    hash_block_size: int = 16,
) -> Trace:
    """Recurring shared prompts, as inference-perf's ``shared_prefix`` data (the defaults are the
    vllm-h100 measurements' "general" workload).

    Group g has one system prompt of ``system_prompt_len`` tokens; prompt (g, p) is that system
    prompt followed by its own question of ``question_len`` tokens. The G*P prompts are shuffled
    once (seeded) and cycled over the n requests, so request i repeats the prompt of request
    i - G*P exactly. Every request generates ``output_len`` tokens (ignore EOS).

    Hashes: identical prompts have identical hash sequences (the last, partial block included);
    prompts of one group share the hashes of the blocks lying wholly in the system prompt, the first
    system_prompt_len // hash_block_size, and nothing else.
    """
    if min(num_groups, prompts_per_group) < 1 or min(system_prompt_len, question_len) < 0:
        raise ValueError("grouped_prefix needs num_groups, prompts_per_group >= 1 and lengths >= 0")
    if system_prompt_len + question_len < 1 or output_len < 1:
        raise ValueError("grouped_prefix needs a non-empty prompt and output_len >= 1")
    if hash_block_size < 1:
        raise ValueError(f"hash_block_size must be >= 1, got {hash_block_size}")
    plen = system_prompt_len + question_len
    # prompt k = g * P + p; its private blocks are keyed by k, so a repeat of k hashes the same
    prompts = [_prompt_hashes(k // prompts_per_group, k, system_prompt_len, plen, hash_block_size)
               for k in range(num_groups * prompts_per_group)]
    order = np.random.default_rng(seed).permutation(len(prompts))
    hashes = [prompts[order[i % len(order)]] for i in range(n)]
    return _length_only(
        np.full(n, plen, np.int64),
        np.full(n, output_len, np.int64),
        "grouped-prefix",
        f"synthetic:grouped-prefix {num_groups}x{prompts_per_group} {system_prompt_len}+{question_len} "
        f"out={output_len} seed={seed}",
        prefix_hashes=hashes,
        hash_block_size=hash_block_size,
    )


LENGTH_WORKLOADS: dict[str, Callable[..., Trace]] = {
    "sharegpt-like": sharegpt_like,
    "alpaca-like": alpaca_like,
    "fixed": fixed,
    "shared-prefix": shared_prefix,
    "grouped-prefix": grouped_prefix,
}
"""The single-stream synthetic workloads (traces.workloads adds the multi-client mix built on them)."""
