"""Token selection from logits: greedy, temperature / top-k / top-p sampling with a seeded
generator, log-softmax helpers, and `BeamSearcher`, which reproduces HF transformers'
`generate(num_beams=k, do_sample=False)` selection and finishing rules.

Logits are [N, vocab]; computations are in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] argmax token ids."""
    return logits.argmax(dim=-1)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N, V] float32 log-probabilities."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of `tokens` [N] under `logits` [N, V] -> [N]."""
    return log_softmax(logits).gather(-1, tokens[:, None].long())[:, 0]


@dataclass
class SamplingParams:
    """temperature 0 means greedy; top_k 0 means no cut; top_p 1.0 means no nucleus cut."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


class Sampler:
    """Samples one token per row with per-row parameters and a seeded `torch.Generator`."""

    def __init__(self, seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
        """logits [N, V], one `SamplingParams` per row -> tokens [N] (int64). A row with its own
        generator (a request's seed) draws from that one, so that its samples do not depend on
        what else is in the batch; the other rows share the sampler's."""
        logits = logits.float()
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], device=dev)
        out = greedy(logits)
        rows = (temps > 0).nonzero()[:, 0]
        if rows.numel():
            sub = [params[i] for i in rows.tolist()]
            probs = filtered_probs(logits[rows] / temps[rows, None], [p.top_k for p in sub], [p.top_p for p in sub])
            if generators is None:
                out[rows] = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
            else:
                self._sample_own(out, rows, probs, [generators[i] for i in rows.tolist()])
        return out

    def _sample_own(self, out: torch.Tensor, rows: torch.Tensor, probs: torch.Tensor,
                    gens: list[torch.Generator | None]) -> None:
        by_gen: dict[int, list[int]] = {}
        for j, g in enumerate(gens):
            by_gen.setdefault(id(g), []).append(j)
        for js in by_gen.values():
            g = gens[js[0]] if gens[js[0]] is not None else self.generator
            out[rows[js]] = torch.multinomial(probs[js], 1, generator=g)[:, 0]


def filtered_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Softmax of `logits` [N, V] after per-row top-k then top-p (nucleus) filtering.

    Top-p keeps the smallest prefix of the descending-probability order whose mass reaches top_p
    (always at least one token).
    """
    vocab = logits.shape[1]
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k], device=dev)
    ranks = torch.arange(vocab, device=dev)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    p = torch.tensor(top_p, device=dev, dtype=probs.dtype)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= p[:, None], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


# ---- beam search ----------------------------------------------------------------------------------
class BeamCandidate(NamedTuple):
    parent: int     # index of the running beam it extends
    token: int
    score: float    # cumulative log-probability (about -1e9 for a beam that cannot continue)


@dataclass
class BeamSearcher:
    """HF-compatible beam search bookkeeping for one prompt.

    Call `step(logprobs)` with next-token log-probabilities [num_running, V] of the running beams
    (one beam, the prompt, at the start). It returns the k running beams for the next step as
    (parent, token, score), and records finished hypotheses (EOS, or the max_new_tokens-th token)
    with score = sum_logprobs / generated_len ** length_penalty, keeping the best k. As in HF:
    each step takes the top 2k continuations; only those of them among the top k may finish; the
    search stops when all 2k hit a stop or (early_stopping=False) when k hypotheses are finished
    and the best running beam, scored at the current length, cannot beat the worst of them
    (early_stopping=True: as soon as k are finished; "never": scored at max length when the
    penalty is positive).
    """

    num_beams: int
    eos_token_ids: list[int]
    max_new_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    running: list[tuple[list[int], float]] = field(default_factory=lambda: [([], 0.0)])
    finished: list[tuple[float, list[int]]] = field(default_factory=list)  # (score, tokens), best first
    generated: int = 0
    done: bool = False
    _improvable: bool = True

    def step(self, logprobs: torch.Tensor) -> list[BeamCandidate]:
        """logprobs [len(self.running), V] -> next running beams (k of them, best first)."""
        if self.done:
            raise RuntimeError("beam search is already done")
        k = self.num_beams
        scores = torch.tensor([s for _, s in self.running], dtype=torch.float32, device=logprobs.device)
        acc = (logprobs.float() + scores[:, None]).reshape(-1)
        vocab = logprobs.shape[-1]
        top_scores, top_idx = torch.topk(acc, min(2 * k, acc.numel()))
        parents = (top_idx // vocab).tolist()
        tokens = (top_idx % vocab).tolist()
        top = top_scores.tolist()
        length = self.generated + 1
        hits = [t in self.eos_token_ids or length >= self.max_new_tokens for t in tokens]
        self._add_finished(parents, tokens, top, hits, length)
        masked = torch.tensor([s - 1e9 * h for s, h in zip(top, hits)])
        nxt = torch.topk(masked, min(k, len(top))).indices.tolist()
        cands = [BeamCandidate(parents[i], tokens[i], float(masked[i])) for i in nxt]
        self.running = [(self.running[c.parent][0] + [c.token], c.score) for c in cands]
        self.generated = length
        self._update_done(all(hits))
        return cands

    def _add_finished(self, parents: list[int], tokens: list[int], top: list[float], hits: list[bool],
                      length: int) -> None:
        if not self._improvable or (self.early_stopping is True and len(self.finished) >= self.num_beams):
            return
        for i in range(min(self.num_beams, len(top))):
            if hits[i]:
                score = top[i] / length ** self.length_penalty
                self.finished.append((score, self.running[parents[i]][0] + [tokens[i]]))
        self.finished.sort(key=lambda x: -x[0])
        del self.finished[self.num_beams:]

    def _update_done(self, all_hit: bool) -> None:
        full = len(self.finished) >= self.num_beams
        if full:
            length = self.generated
            if self.early_stopping == "never" and self.length_penalty > 0:
                length = self.max_new_tokens
            best_running = self.running[0][1] / length ** self.length_penalty
            if not best_running > self.finished[-1][0]:
                self._improvable = False
        self.done = all_hit or not self._improvable or (self.early_stopping is True and full)

    def best(self, n: int = 1) -> list[tuple[list[int], float]]:
        """The n best finished hypotheses as (generated tokens, score), best first."""
        return [(toks, score) for score, toks in self.finished[:n]]
