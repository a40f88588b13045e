"""The emulated executor and its real-time clock: the simulator's pricing and token decisions behind
a live serving loop (`pagesim serve --emulate`), with no model.

`EmulatedExecutor` executes a StepPlan as the simulator does (sim.executor.SimulatedExecutor prices
it with the cost model and decides finishes, forks and beams) and adds what a server must send:
a token id for every sampled token, from a fixed output vocabulary (`output_ids`, in order; the
composition root picks ids whose text re-tokenizes to the same ids, so a client that counts tokens
in the text agrees with the server's usage).

Output lengths (decided when a request arrives, `register`):
- `ignore_eos`: exactly `max_tokens` (finish reason "length");
- otherwise a seeded draw from `OutputLengthModel` (geometric with mean `mean`: every token is the
  last with probability 1 / mean, as a model whose end-of-sequence probability is flat), capped at
  `max_tokens`; a request that stops before its cap finishes with reason "stop". The drawn length
  is the request's `output_len`, as a trace's is in simulation (oracle policies see it there too).
- parallel samples (n > 1): with ignore_eos each runs to `max_tokens`; otherwise the first keeps
  the request's length and the others draw theirs below it (sim/executor.py's rule).
Token choice: each sequence walks the vocabulary STRIDE ids at a time from a start made of its
request's seeded base and its id's offset from the request's first sequence (0 for a request of
one sequence; a forked sample's first token comes from its parent's walk); the seed
is the request's own `seed` when it gives one (the same request and seed give the same text), else
(run seed, request id).

`PacedClock` is the loop's clock: engine time is wall time since `start()` times `time_scale`. An
iteration starts when the previous one ended on the plan (back to back: the loop's own bookkeeping
between iterations costs no engine time), or when the newest request it may include arrived,
whichever is later (never later than now; after an iteration that ran nothing, now); it ends its priced duration later, and its tokens are released when the wall
clock gets there (`wait`). How late each release was (wall seconds) is the clock's lag: reported
to `on_lag`, and when it exceeds `behind_s` or `behind_fraction` of the step's wall time the clock
is behind (`behind`): it catches up by releasing at once, never by stretching the plan. `until`
sleeps to a point inside an iteration (a fractional output lag, backend/async_engine.py) and
counts nothing: the release measured is the iteration's end.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from policies.plan import SeqOutcome, StepComposition, StepPlan, StepResult
from policies.request import Request
from policies.step import StopCheck
from sim.cost_model import CostModel
from sim.executor import SimulatedExecutor

STRIDE = 7919  # a prime: a sequence's walk over the vocabulary visits every id before repeating


@dataclass(frozen=True)
class OutputLengthModel:
    """Output lengths of requests that may stop early: geometric with mean `mean` (>= 1)."""

    mean: float = 128.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and self.mean >= 1):
            raise ValueError(f"output length mean (--output-len-mean): must be a finite number >= 1, got {self.mean!r}")

    def draw(self, rng: np.random.Generator, cap: int) -> int:
        return int(min(rng.geometric(1.0 / self.mean), cap))


class EmulatedExecutor:
    """Prices plans and decides outcomes as the simulator does; gives every sampled token an id.
    It holds no scheduler (a plan's sequences are all it reads; a replica is built with
    policies.replica_config.build_replica) and is a policies.step.ServedExecutor.
    Invariant: every sampling sequence of a plan gets an outcome with its token (others_continue
    is off), so the scheduler's token lists hold what the server sends."""

    def __init__(self, cost_model: CostModel, output_ids: Sequence[int], seed: int = 0,
                 lengths: OutputLengthModel = OutputLengthModel()) -> None:
        if not output_ids:
            raise ValueError("output_ids: the output vocabulary is empty")
        self.inner = SimulatedExecutor(cost_model, seed=seed)
        self.output_ids = list(output_ids)
        self.seed = seed
        self.lengths = lengths
        self._stops: dict[int, StopCheck] = {}  # group id -> its stop check
        # group id -> (where its sequences' walks start, seeded; the id of its first sequence)
        self._base: dict[int, tuple[int, int | None]] = {}
        # group id -> its sequences that may hold an entry in inner.targets (n > 1 only: a single
        # sample's target is its trace length, never stored), dropped with them at `release`
        self._forked: dict[int, set[int]] = {}

    # ---------------------------------------------------------------- the engine's hooks
    def register(self, request: Request, seed: int | None = None, stop: StopCheck | None = None) -> None:
        """Decide the request's output length (module docstring) before the scheduler sees it, and
        keep its stop check. ValueError (naming the seed) for a seed numpy cannot take."""
        try:
            rng = np.random.default_rng([self.seed, 1, seed] if seed is not None else [self.seed, 0, request.request_id])
        except (ValueError, TypeError, OverflowError) as e:
            raise ValueError(f"invalid seed {seed}: {e}") from None
        self._base[request.request_id] = (int(rng.integers(len(self.output_ids))), None)
        if stop is not None:
            self._stops[request.request_id] = stop
        sp = request.sampling
        if not sp.ignore_eos and request.output_len is None:
            request.output_len = self.lengths.draw(rng, sp.max_tokens)

    def release(self, group_id: int) -> None:
        """Drop what a finished, aborted or rejected request held (its seed, stop check and its
        parallel samples' output lengths), so a long-running server holds nothing per past request."""
        self._base.pop(group_id, None)
        self._stops.pop(group_id, None)
        seqs = self._forked.pop(group_id, None)
        if seqs:
            targets = self.inner.targets
            for seq_id in seqs:
                targets.pop(seq_id, None)

    def price(self, comp: StepComposition) -> float:
        return self.inner.price(comp)

    # ---------------------------------------------------------------- execution
    def execute(self, plan: StepPlan, comp: StepComposition | None = None) -> StepResult:
        targets = self.inner.targets
        for ss in plan.seqs:  # ignore_eos: every parallel sample runs to max_tokens (no drawn length)
            if ss.samples and ss.seq_id not in targets:
                seq = ss.seq
                sp = seq.group.request.sampling
                if sp.n > 1:  # inner.execute stores a drawn length for a fork: `release` drops it
                    self._forked.setdefault(seq.group.group_id, set()).add(ss.seq_id)
                    if sp.ignore_eos:
                        targets[ss.seq_id] = seq.target_len
        result = self.inner.execute(plan, comp)
        result.others_continue = False
        outcomes = result.outcomes
        for ss in plan.seqs:
            if not ss.samples:
                continue
            seq = ss.seq
            out = outcomes.get(ss.seq_id)
            if out is None:
                out = outcomes[ss.seq_id] = SeqOutcome(ss.seq_id)
            if out.keep:
                out.token = self._token(seq.group.group_id, seq.seq_id, seq.output_len)
                stop = self._stops.get(seq.group.group_id)
                if not out.finished and stop is not None and stop(seq, out.token):
                    out.finished = True
            if out.children:  # the j-th fork's first token: its parent's walk, shifted by j + 1
                gid, sid = seq.group.group_id, seq.seq_id
                out.children = [self._token(gid, sid, seq.output_len, j + 1) for j in range(len(out.children))]
        return result

    def _token(self, group_id: int, seq_id: int, position: int, shift: int = 0) -> int:
        base, first = self._base.get(group_id) or (None, None)
        if base is None:  # a request not registered (a replay, a test): seeded by its id
            base = int(np.random.default_rng([self.seed, 0, group_id]).integers(len(self.output_ids)))
        if first is None:  # the first sequence to sample is the request's own (forks come after)
            first = seq_id
            self._base[group_id] = (base, first)
        rank = seq_id - first
        return self.output_ids[(base + 104729 * rank + STRIDE * position + shift) % len(self.output_ids)]


@dataclass
class LagStats:
    """Every token-release lag so far (wall seconds, 8 bytes a release: less than the iteration
    table's row), and how many releases were behind."""

    lags: array = field(default_factory=lambda: array("d"))
    behind: int = 0

    def add(self, lag: float, behind: bool) -> None:
        self.lags.append(lag)
        self.behind += behind

    def to_dict(self) -> dict[str, float]:
        if not self.lags:
            return {"releases": 0, "behind": 0, "mean_s": 0.0, "p50_s": 0.0, "p99_s": 0.0, "max_s": 0.0}
        x = np.frombuffer(self.lags, dtype=np.float64)
        p50, p99 = np.percentile(x, [50, 99])
        return {"releases": len(x), "behind": self.behind, "mean_s": float(x.mean()), "p50_s": float(p50),
                "p99_s": float(p99), "max_s": float(x.max())}


class PacedClock:
    """The serving loop's clock under emulation; see the module docstring. Engine times are seconds
    of emulated time; lags are wall seconds. `on_lag(lag, step_wall_s, behind)` is called on the
    engine thread after every release."""

    def __init__(self, time_scale: float = 1.0, behind_s: float = 5e-3, behind_fraction: float = 0.1,
                 on_lag: Callable[[float, float, bool], None] | None = None) -> None:
        if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale > 0):
            raise ValueError(f"--time-scale: must be a finite number > 0, got {time_scale!r}")
        self.time_scale = float(time_scale)
        self.behind_s, self.behind_fraction = behind_s, behind_fraction
        self.on_lag = on_lag
        self.stats = LagStats()
        self._t0 = time.perf_counter()
        self._last_end: float | None = 0.0  # the previous iteration's planned end (None: it ran nothing)

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._last_end = 0.0

    def now(self) -> float:
        return (time.perf_counter() - self._t0) * self.time_scale

    def begin(self, now: float, newest_arrival: float) -> float:
        """When the iteration about to be planned starts (see the module docstring)."""
        if self._last_end is None:
            return now
        return min(now, max(self._last_end, newest_arrival))

    def end(self, start: float, result: StepResult) -> float:
        """The iteration's planned end: its priced duration after its start."""
        end = start + result.duration
        self._last_end = end
        return end

    def idle(self) -> None:
        """Nothing ran: the next iteration starts when it is planned, not back to back."""
        self._last_end = None

    def until(self, t: float) -> float:
        """Sleep until the wall clock reaches engine time `t`; how late it woke (wall seconds, >= 0)."""
        target = self._t0 + t / self.time_scale
        delay = target - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return max(0.0, time.perf_counter() - target)

    def wait(self, end: float, step: float) -> float:
        """Sleep until the wall clock reaches engine time `end` (an iteration of `step` engine
        seconds ends there); returns the release's lag in wall seconds, counted in `stats`."""
        lag = self.until(end)
        step_wall = step / self.time_scale
        behind = lag > self.behind_s or lag > self.behind_fraction * step_wall
        self.stats.add(lag, behind)
        if self.on_lag is not None:
            self.on_lag(lag, step_wall, behind)
        return lag

