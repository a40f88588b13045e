"""The simulated executor: prices a StepPlan with a cost model and decides token outcomes from the
workload instead of running a model.

Decoding rules (seeded, documented here because they shape memory sharing):
- One sequence: it samples until its target length (the trace's output length) and finishes.
- Parallel sampling (n > 1): at the first token the sequence forks into n. Sample 0 keeps the
  trace's length L; every other sample i draws its length as round(L * exp(0.5 * z_i)),
  z_i ~ N(0, 1), clipped to [min(2, L), L]: samples of one prompt vary below the observed length,
  which is the longest (so oracle reservations and rejection bounds hold), and a forked sample,
  born holding one token, samples at least once more. With a one-token output (L = 1) every sample
  ends with its first token: the children are born finished.
- Beam search (width k): all beams end at the trace's length (as with ignore_eos). At every step the
  k new beams pick their parents among the current beams in rank order with probability
  proportional to q^rank (the best beams are extended most often, as in real beam search); a
  parent picked m times continues once and forks m - 1 children; a parent never picked is pruned.
  q (`beam_rank_decay`, default 0.5) can be measured on a real model: `pagesim beams` counts the
  parent ranks of live beam search and `fit_beam_rank_decay` fits q by maximum likelihood.
  Measured beams spread over more parents per step than independent picks do (a real step cannot
  take the same continuation twice), so a measured *pick table* can replace the rule: for width k,
  the observed vectors of children per parent rank and their frequencies (`beam_picks`, loaded
  from `pagesim beams --out` by `load_beam_picks`); each step draws one vector from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from policies.plan import DecodeStepPlan, RepeatPlan, SeqOutcome, StepComposition, StepPlan, StepResult
from sim.cost_model import CostModel


@dataclass(frozen=True)
class BeamPicks:
    """A measured pick table for one beam width k: vectors[i][r] new beams from the parent of rank
    r (each vector sums to k), drawn with probability probs[i]."""

    vectors: np.ndarray
    probs: np.ndarray

    @classmethod
    def from_counts(cls, width: int, pick_vectors: dict[str, int]) -> BeamPicks:
        """From counted steps: "c0,c1,...,c{k-1}" (children per parent rank) -> number of steps."""
        vectors, freq = [], []
        for key, n in pick_vectors.items():
            v = [int(x) for x in key.split(",")]
            if len(v) != width or sum(v) != width or min(v) < 0 or n <= 0:
                raise ValueError(f"pick_vectors[{key!r}]: expected {width} counts summing to {width}")
            vectors.append(v)
            freq.append(float(n))
        p = np.asarray(freq)
        return cls(np.asarray(vectors, dtype=np.int64), p / p.sum())


def load_beam_picks(path: str | Path) -> dict[int, BeamPicks]:
    """Pick tables by width from a `pagesim beams --out` file; errors name the file and field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        widths = data["widths"]
    except FileNotFoundError:
        raise
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a `pagesim beams` file ({exc!r})") from exc
    if not isinstance(widths, list) or not all(isinstance(w, dict) for w in widths):  # was AttributeError
        raise ValueError(f"{path}: widths: expected a list of objects (one per beam width), got {widths!r:.80}")
    tables = {}
    for i, w in enumerate(widths):
        k = w.get("width")
        counts = w.get("pick_vectors")
        if not isinstance(k, int) or k < 2 or not isinstance(counts, dict) or not counts:
            raise ValueError(f"{path}: widths[{i}] needs an integer 'width' >= 2 and a non-empty 'pick_vectors'")
        try:
            tables[k] = BeamPicks.from_counts(k, counts)
        except ValueError as exc:
            raise ValueError(f"{path}: widths[{i}].{exc}") from exc
    return tables


class SimulatedExecutor:
    """Prices plans with `cost_model` and decides outcomes by the rules above; it holds no
    scheduler: a plan's sequences (and a RepeatPlan's) are all it reads."""

    def __init__(self, cost_model: CostModel, seed: int | np.random.SeedSequence = 0,
                 beam_rank_decay: float = 0.5, beam_picks: dict[int, BeamPicks] | None = None) -> None:
        if not 0 < beam_rank_decay <= 1:
            raise ValueError(f"beam_rank_decay: must be in (0, 1], got {beam_rank_decay}")
        self.cost = cost_model
        self.rng = np.random.default_rng(seed)
        self.beam_rank_decay = beam_rank_decay
        self.beam_picks = beam_picks or {}
        self.targets: dict[int, int] = {}   # seq id -> output length it finishes at

    def price(self, c: StepComposition) -> float:
        # cost models price a pure-decode step identically through step_time and the vectorised
        # decode_step_times (tests/test_cost_model.py), so skipping ahead reproduces these times
        return self.cost.step_time(c)

    def price_repeat(self, plan: RepeatPlan) -> np.ndarray | list[float]:
        """Durations of the plan's `steps` pure-decode iterations of `num_seqs` sequences whose
        contexts sum to context_tokens + num_seqs * j at iteration j = 1..steps, in one call. Windows
        shorter than the cost model's `series_steps()` are priced one by one (decode_step_series:
        numpy's per-call cost dominates there), longer ones vectorised; both are identical."""
        num_seqs, context0, k = plan.num_seqs, plan.context_tokens, plan.steps
        if k < self.cost.series_steps():
            return self.cost.decode_step_series(num_seqs, context0, k)
        contexts = context0 + num_seqs * np.arange(1, k + 1, dtype=np.int64)
        return self.cost.decode_step_times(np.full(k, num_seqs, dtype=np.int64), contexts)

    def execute(self, plan: StepPlan, composition: StepComposition | None = None) -> StepResult:
        # a single sample that just continues goes unreported (StepResult.others_continue)
        result = StepResult(duration=self.price(composition or plan.composition()), others_continue=True)
        outcomes = result.outcomes
        groups_done: set[int] = set()
        for ss in plan.seqs:
            if not ss.samples:
                continue
            seq = ss.seq
            assert seq is not None, "an executed plan's sequences come with their Sequence"
            group = seq.group
            sp = group.request.sampling
            if sp.n == 1 and sp.beam_width == 1:  # the common case
                if seq.output_len + 1 >= seq.target_len:
                    outcomes[ss.seq_id] = SeqOutcome(ss.seq_id, None, True, [], True)
            elif sp.beam_width > 1:
                if group.group_id not in groups_done:
                    groups_done.add(group.group_id)
                    self._beam_step(group, result)
            else:
                out = SeqOutcome(ss.seq_id)
                out.finished = seq.output_len + 1 >= self.target(seq)
                if seq.output_len == 0 and len(group.seqs) == 1 and not group.finished_seqs:
                    out.children = [None] * (sp.n - 1)
                    if out.finished:  # a one-token output: every sample ends with its first token
                        out.children_finished = (True,) * (sp.n - 1)
                outcomes[ss.seq_id] = out
        return result

    def sample_lengths(self, base: int, count: int) -> list[int]:
        z = self.rng.standard_normal(count)
        return np.clip(np.rint(base * np.exp(0.5 * z)), min(2, base), base).astype(int).tolist()

    def target(self, seq) -> int:
        """The output length a sequence finishes at: the trace's for a group's first sequence,
        drawn once (seeded) for each forked parallel sample."""
        t = self.targets.get(seq.seq_id)
        if t is None:
            sp = seq.group.request.sampling
            forked = sp.n > 1 and seq is not seq.group.seqs[0]
            t = self.sample_lengths(seq.target_len, 1)[0] if forked else seq.target_len
            if forked:
                self.targets[seq.seq_id] = t
        return t

    def remaining(self, plan: RepeatPlan | DecodeStepPlan) -> list[int]:
        """How many more tokens each sequence of the plan's batch samples before it finishes, as
        `target` decides: the trace's length, or a forked sample's drawn one (drawn at its first
        step, before any window can contain it)."""
        targets = self.targets
        if not targets:  # no forked samples: every target is the trace's
            return [s.target_len - s.output_len for s in plan.seqs]
        return [targets.get(s.seq_id, s.target_len) - s.output_len for s in plan.seqs]

    def _beam_step(self, group, result: StepResult) -> None:
        k = group.request.sampling.beam_width
        beams = group.seqs
        finished = beams[0].output_len + 1 >= beams[0].target_len
        table = self.beam_picks.get(k)
        if len(beams) == 1 and beams[0].output_len == 0:
            picks = np.array([k])
        elif table is not None and len(beams) == k:
            picks = table.vectors[self.rng.choice(len(table.probs), p=table.probs)]
        else:
            p = self.beam_rank_decay ** np.arange(len(beams))
            picks = self.rng.multinomial(k, p / p.sum())
        for seq, m in zip(beams, picks.tolist()):
            if finished:
                result.outcomes[seq.seq_id] = SeqOutcome(seq.seq_id, None, m > 0, [], True)
            else:
                result.outcomes[seq.seq_id] = SeqOutcome(seq.seq_id, None, m > 0, [None] * max(m - 1, 0))


def fit_beam_rank_decay(rank_counts: list[int] | np.ndarray) -> float:
    """Maximum-likelihood q of the beam rule from how often each parent rank was picked, counted
    over steps with k current beams: picks ~ Multinomial(k, q^r / sum_j q^j), r = 0..k-1."""
    n = np.asarray(rank_counts, dtype=np.float64)
    if n.ndim != 1 or len(n) < 2 or (n < 0).any() or n.sum() == 0:
        raise ValueError(f"rank_counts: need non-negative counts for at least 2 ranks, got {rank_counts!r}")
    from scipy.optimize import minimize_scalar

    r = np.arange(len(n))

    def nll(q: float) -> float:
        return -float((n * (r * np.log(q))).sum() - n.sum() * np.log((q ** r).sum()))

    res = minimize_scalar(nll, bounds=(1e-6, 1.0), method="bounded", options={"xatol": 1e-10})
    return float(res.x)


def expected_distinct_parents(width: int, q: float) -> float:
    """Under the beam rule, the expected number of current beams picked at least once in a step."""
    p = q ** np.arange(width)
    p = p / p.sum()
    return float((1 - (1 - p) ** width).sum())
