"""The policy axes a research policy replaces one at a time: queue order, admission, preemption victim.

A `QueuePolicy` plugs into the paged scheduler (`VllmScheduler(policy=...)`) in simulation and live
alike. The scheduler keeps its one token-budget rule, its block manager and its skip-ahead; the
policy only answers questions. Its contract is about its decisions and when they may change:

- `key(group)`: the order of the waiting queue and of the running batch (smallest first: the first
  gets its tokens first, the last is preempted first).
- `admit(group, now)`: ADMIT (memory and budgets permitting), DEFER (head of line: nothing further is
  admitted this step), or a rejection reason (str).
- `victim(running)`: the running group to preempt when blocks run out; default the last in key order.
- hooks: `on_queued` (a group joins the queue, before its key is read), `on_admitted`, `on_served`
  (tokens computed for a group: after each step, or once for several iterations at a time; a
  batch's decodes come through `on_decoded`, which calls it per group unless a policy takes them
  at once), `on_finished`. A hook only records; overriding one changes nothing else.
- What any of these reads of a group's sequences is exact at the call through
  `Sequence.exact_output_len`, `exact_num_computed`, `exact_num_tokens`, `exact_token_ids` and
  `SequenceGroup.output_len`; the stored fields (`output_len`, `num_computed`, ...) are the
  scheduler's own, behind while skip-ahead owes a running sequence decode steps (--debug raises
  on such a read, naming it). `on_served` is told before the served tokens are counted, as
  stepping tells it: a window's k decode steps come as one call that reads as stepping's first.
- When its answers may change, besides arrivals, admissions and finishes:
  - `wake_time(waiting, now)`: the earliest time after `now` at which `admit` may answer differently
    with nothing else changed (a deadline passing, a token bucket refilling); math.inf when never.
  - `reads`: what `key`, `admit` and `on_queued` read, one of READS:
      "request"            (the default) the group's request and the policy's fixed parameters: a
                           key is fixed from queueing on;
      "state-when-queued"  also the policy's own state (what it learned from finished or served
                           requests) as it is when the group is queued; the key is then fixed;
      "state"              the policy's own state, at every read: keys change while groups wait
                           (fair-share counters). The running batch is then kept in arrival order.
    A class that defines `key` declares `reads` in its own body (else TypeError).

What the simulator needs to skip iterations and still match stepping bit for bit, it derives from
these: the waiting queue is a FIFO when `key` is the base one (arrival order: an arrival queues
behind everyone waiting), a heap on the key for "request" and "state-when-queued", the policy's
`new_queue()` for "state" (by default a queue that finds the smallest key at each read); which
groups could come first while the batch decodes is the queue's to say (`candidates()`, else every
waiting group); arrivals must see the policy's state as stepping leaves it unless `reads` is
"request"; a window applies a preempting iteration itself only under the base `victim` (the
running tail; a policy's own victim gets that iteration stepped, with the same result). A policy
that breaks this contract (say a key that reads state without declaring it) may give results that
differ from stepping without a word: run it once with `--debug` (SimConfig.debug), which simulates
with and without skip-ahead and names the class and the decision that differed.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from policies.keyed_queue import KeyedQueue
from policies.per_client import ClientQueues, ClientTokens
from policies.request import SequenceGroup

ADMIT = "admit"
DEFER = "defer"

# what a policy's key, admit and on_queued read (QueuePolicy.reads)
REQUEST = "request"
STATE_WHEN_QUEUED = "state-when-queued"
STATE = "state"
READS = (REQUEST, STATE_WHEN_QUEUED, STATE)

# window bookkeeping the contract no longer asks of a policy: each name, and what replaced it
_REMOVED = {
    "arrival_order": "derived: the queue is a FIFO when key is the base one",
    "dynamic_order": "declare reads = 'state'",
    "head_candidates": "the waiting queue's candidates() (new_queue)",
    "queues_by_state": "declare reads = 'state-when-queued' (or 'state')",
    "overrides_victim": "derived by the scheduler",
}


def check_reads(owner: str, reads: object) -> None:
    """A ValueError naming the class unless `reads` is one of READS."""
    if reads not in READS:
        raise ValueError(f"{owner}.reads = {reads!r}: must be one of {', '.join(map(repr, READS))} "
                         "(what key, admit and on_queued read; see policies.queue_policy)")


class QueuePolicy:
    """First come, first served (vLLM's default): arrival order, admit whatever fits, preempt the
    most recently arrived."""

    name: ClassVar[str] = "fcfs"
    reads: str = REQUEST  # a class attribute, or set per instance in __init__ (see ShortestFirstPolicy)
    # whether the scheduler calls on_served: derived (a policy that defines on_served gets it called)
    tracks_service: ClassVar[bool] = False

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        for old, instead in _REMOVED.items():
            if old in cls.__dict__:
                raise TypeError(f"{cls.__name__}.{old}: no longer part of the QueuePolicy contract ({instead}; "
                                "see policies.queue_policy)")
        if "key" in cls.__dict__ and "reads" not in cls.__dict__:
            raise TypeError(f"{cls.__name__} defines key(): declare what it reads in the class, reads = "
                            f"{' | '.join(map(repr, READS))} (see policies.queue_policy)")
        if "reads" in cls.__dict__:
            check_reads(cls.__name__, cls.__dict__["reads"])
        if "tracks_service" not in cls.__dict__:  # calling the base no-op would change nothing
            cls.tracks_service = (cls.on_served is not QueuePolicy.on_served
                                  or cls.on_decoded is not QueuePolicy.on_decoded)

    def key(self, group: SequenceGroup) -> tuple:
        return (group.request.arrival, group.group_id)

    def running_key(self, group: SequenceGroup) -> tuple:
        """The running batch's order (derived, not overridden): the key, or arrival when keys
        change while groups wait (reads "state")."""
        return self.key(group) if self.reads != STATE else (group.request.arrival, group.group_id)

    def new_queue(self) -> Any:
        """The waiting queue: a deque in arrival order under the base key (kept by the scheduler:
        arrivals at the back, preempted groups at the front), else a queue with the methods the
        scheduler uses (len, iter, [0], popleft, push(group, front), remove(group) when a waiting request is
        aborted, and optionally candidates()):
        a heap on a key fixed at queueing, or for reads "state" one that finds the smallest key at
        each read (a policy may give a faster one of its own here)."""
        if type(self).key is QueuePolicy.key:
            return deque()
        return ReorderingQueue(self.key) if self.reads == STATE else KeyedQueue(self.key)

    def admit(self, group: SequenceGroup, now: float) -> str:
        return ADMIT

    def wake_time(self, waiting: Iterable[SequenceGroup], now: float) -> float:
        return math.inf

    def victim(self, running: Sequence[SequenceGroup]) -> SequenceGroup:
        return running[-1]

    def on_queued(self, group: SequenceGroup) -> None:
        """A group arrives (or is preempted back to the queue), before its key is read."""

    def on_admitted(self, group: SequenceGroup, now: float) -> None:
        """A group's first chunk was scheduled."""

    def on_served(self, group: SequenceGroup, prefill_tokens: int, decode_tokens: int) -> None:
        """Tokens computed for the group: after a step, or summed over several iterations."""

    def on_decoded(self, groups: Sequence[SequenceGroup], decode_tokens: int) -> None:
        """Each of `groups` (the running batch, in its order) decoded `decode_tokens` tokens: the
        same as `on_served(g, 0, decode_tokens)` for each, in order, which is what this does. A
        policy may take them at once instead (VtcPolicy), with the same result."""
        served = self.on_served
        for g in groups:
            served(g, 0, decode_tokens)

    def on_finished(self, group: SequenceGroup) -> None:
        """A group finished (its true output length is now known)."""


class PriorityPolicy(QueuePolicy):
    """vLLM's priority scheduling: the request's `priority` (lower first, from the trace), then
    arrival; the lowest-priority running group is preempted first."""

    name = "priority"
    reads = REQUEST

    def key(self, group: SequenceGroup) -> tuple:
        return (group.request.priority, group.request.arrival, group.group_id)


# ------------------------------------------------------------------ output-length predictors
class OutputLengthPredictor:
    """Predicts a request's output length at arrival; learns from finished requests (`observe`)."""

    name: ClassVar[str] = "base"
    learns: ClassVar[bool] = False  # whether predictions depend on what `observe` saw

    def predict(self, group: SequenceGroup) -> float:
        raise NotImplementedError

    def observe(self, group: SequenceGroup) -> None:
        pass


class OraclePredictor(OutputLengthPredictor):
    """The true output length (from the trace; an upper bound on what any predictor can do)."""

    name = "oracle"

    def predict(self, group: SequenceGroup) -> float:
        true = group.request.output_len
        if true is None:
            raise ValueError(f"request {group.request.request_id}: the oracle predictor needs the true output "
                             "length (a trace with output lengths)")
        return float(true)


class NoisyOraclePredictor(OraclePredictor):
    """The true length times a log-normal error of standard deviation `error` (in log space),
    drawn from a generator seeded by (seed, request id): the same request gets the same guess."""

    name = "noisy"

    def __init__(self, error: float = 0.5, seed: int = 0) -> None:
        if not (error >= 0 and math.isfinite(error)):  # inf made every prediction inf or 0
            raise ValueError(f"predictor error must be a finite number >= 0, got {error}")
        if seed < 0:  # numpy's own error did not say which seed
            raise ValueError(f"predictor seed must be >= 0, got {seed}")
        self.error, self.seed = error, seed

    def predict(self, group: SequenceGroup) -> float:
        rng = np.random.default_rng([self.seed, group.request.request_id])
        return super().predict(group) * float(np.exp(self.error * rng.standard_normal()))


class BucketMeanPredictor(OutputLengthPredictor):
    """A simple learned predictor: the mean output length of finished requests whose prompt length
    fell in the same power-of-two bucket (the global mean while a bucket is empty; `prior` before
    anything finished). Fitted online on the part of the trace already served."""

    name = "fitted"
    learns = True

    def __init__(self, prior: float = 256.0) -> None:
        self.prior = prior
        self.sums: dict[int, list[float]] = {}
        self.total = [0.0, 0]

    @staticmethod
    def _bucket(prompt_len: int) -> int:
        return max(prompt_len, 1).bit_length()

    def predict(self, group: SequenceGroup) -> float:
        s = self.sums.get(self._bucket(group.request.prompt_len))
        if s is not None and s[1]:
            return s[0] / s[1]
        return self.total[0] / self.total[1] if self.total[1] else self.prior

    def observe(self, group: SequenceGroup) -> None:
        out = sum(s.exact_output_len for s in group.finished_seqs) / max(len(group.finished_seqs), 1)
        s = self.sums.setdefault(self._bucket(group.request.prompt_len), [0.0, 0])
        s[0] += out
        s[1] += 1
        self.total[0] += out
        self.total[1] += 1


PREDICTORS = {"oracle": OraclePredictor, "noisy": NoisyOraclePredictor, "fitted": BucketMeanPredictor}


def make_predictor(name: str, error: float = 0.5, seed: int = 0) -> OutputLengthPredictor:
    if name == "noisy":
        return NoisyOraclePredictor(error, seed)
    if name not in PREDICTORS:
        raise ValueError(f"unknown predictor {name!r}; known: {', '.join(PREDICTORS)}")
    return PREDICTORS[name]()


_QUEUE_KEY = operator.attrgetter("queue_key")


class ShortestFirstPolicy(QueuePolicy):
    """Shortest job first by predicted output length, with aging against starvation: the key is
    predicted tokens minus `aging` tokens per second waited, i.e. prediction + aging * arrival
    (every waiting request ages at the same rate, so the order is fixed at queueing). With
    `remaining` (SRPT), a preempted group requeues by its predicted tokens still to generate."""

    name = "sjf"
    # what on_queued reads: a predictor that learns from finished requests is the policy's state
    # (set per instance in __init__: oracle and noisy guesses read the request only)
    reads = STATE_WHEN_QUEUED

    def __init__(self, predictor: str = "oracle", error: float = 0.5, aging: float = 0.0, seed: int = 0,
                 remaining: bool = False) -> None:
        if not (aging >= 0 and math.isfinite(aging)):  # inf keyed an arrival at 0 s as inf * 0 = NaN
            raise ValueError(f"aging must be a finite number >= 0 tokens per second, got {aging}")
        self.predictor = make_predictor(predictor, error, seed)
        self.reads = STATE_WHEN_QUEUED if self.predictor.learns else REQUEST
        self.aging = aging
        self.remaining = remaining
        self._guess: dict[SequenceGroup, float] = {}
        if type(self).key is ShortestFirstPolicy.key:
            # the key fixed at queueing is the group's queue_key: read by a C getter, so that the
            # waiting heap and the running order (a few reads an insertion) run no interpreted
            # frame and no lookup (a subclass's own key is left as it is)
            self.key = _QUEUE_KEY  # type: ignore[method-assign]

    def on_queued(self, group: SequenceGroup) -> None:
        guess = self._guess.get(group)
        if guess is None:
            guess = self._guess[group] = self.predictor.predict(group)
        done = max((s.exact_output_len for s in group.seqs), default=0) if self.remaining else 0
        group.queue_key = (max(guess - done, 0.0) + self.aging * group.request.arrival, group.group_id)

    def key(self, group: SequenceGroup) -> tuple:
        return group.queue_key

    def on_finished(self, group: SequenceGroup) -> None:
        if group.rejected is None:
            self.predictor.observe(group)
        self._guess.pop(group, None)


class SrptPolicy(ShortestFirstPolicy):
    """Shortest remaining predicted processing time (see ShortestFirstPolicy, remaining=True)."""

    name = "srpt"

    def __init__(self, predictor: str = "oracle", error: float = 0.5, aging: float = 0.0, seed: int = 0) -> None:
        super().__init__(predictor, error, aging, seed, remaining=True)


class VtcPolicy(QueuePolicy):
    """Fair sharing across clients by Virtual Token Counter (Sheng et al., OSDI 2024): each client's
    counter grows by `input_weight` per prompt token (charged when a request is admitted) and
    `output_weight` per generated token served; the next request is the oldest of the client with
    the smallest counter. A client that becomes active again is lifted to the smallest counter among
    active clients, so idle time does not bank service. Tokens are counted as integers and the
    counter computed from them, so a skipped window (k tokens at once) and k stepped iterations give
    the same float. The waiting queue is one FIFO per client (`ClientQueues`)."""

    name = "vtc"
    reads = STATE  # counters grow with service while groups wait

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0) -> None:
        # an infinite weight made counters inf and a returning client's lift inf - inf = NaN
        if not all(w >= 0 and math.isfinite(w) for w in (input_weight, output_weight)):
            raise ValueError(f"vtc: weights must be finite numbers >= 0, got {input_weight}, {output_weight}")
        self.w_in, self.w_out = input_weight, output_weight
        self.counts = ClientTokens(input_weight, output_weight)
        self.tokens = self.counts.tokens  # client -> [input tokens, output tokens] served
        self.lift = self.counts.lift      # client -> counter added when it came back active
        self.active: dict[str, int] = {}  # client -> its requests queued or running
        # the hooks told at every step and window, and the counter the queue reads at every
        # admission: the compiled counts' own methods where this class's are (no interpreted
        # frame a call); a subclass's own are left as they are
        cls = type(self)
        if cls.counter is VtcPolicy.counter:
            self.counter = self.counts.counter  # type: ignore[method-assign]
        if cls.on_admitted is VtcPolicy.on_admitted:
            self.on_admitted = self.counts.admitted  # type: ignore[method-assign]
        if cls.on_served is VtcPolicy.on_served:
            self.on_served = self.counts.served  # type: ignore[method-assign]
            if cls.on_decoded is VtcPolicy.on_decoded:
                self.on_decoded = self.counts.decoded  # type: ignore[method-assign]

    def counter(self, client: str) -> float:
        return self.counts.counter(client)

    def key(self, group: SequenceGroup) -> tuple:
        return (self.counter(group.request.client), group.request.arrival, group.group_id)

    def new_queue(self) -> ClientQueues:
        return ClientQueues(self.counter)

    def on_queued(self, group: SequenceGroup) -> None:
        if group.num_preemptions:  # back from a preemption: still active
            return
        c = group.request.client
        if not self.active.get(c):
            floor = min((self.counter(k) for k, n in self.active.items() if n), default=None)
            if floor is not None and self.counter(c) < floor:
                self.lift[c] = self.lift.get(c, 0.0) + floor - self.counter(c)
        self.active[c] = self.active.get(c, 0) + 1

    def on_admitted(self, group: SequenceGroup, now: float) -> None:
        self.counts.admitted(group, now)

    def on_served(self, group: SequenceGroup, prefill_tokens: int, decode_tokens: int) -> None:
        self.counts.served(group, prefill_tokens, decode_tokens)

    def on_decoded(self, groups: Sequence[SequenceGroup], decode_tokens: int) -> None:
        # the batch's groups counted by client in one compiled call; a window's batch is ~30
        # groups of a few clients, told at every window and decode step
        if type(self).on_served is not VtcPolicy.on_served:  # a subclass's own on_served sees each group
            super().on_decoded(groups, decode_tokens)
            return
        self.counts.decoded(groups, decode_tokens)

    def on_finished(self, group: SequenceGroup) -> None:
        c = group.request.client
        self.active[c] = self.active.get(c, 1) - 1


class ReorderingQueue:
    """A waiting queue for keys that change while groups wait (reads "state"): `[0]` is the group
    whose key is smallest now, found in O(n) at each read. Keys must be unique (end with the group id)."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.groups: list[SequenceGroup] = []

    def push(self, group: SequenceGroup, front: bool = False) -> None:
        self.groups.append(group)

    def _best(self) -> int:
        if not self.groups:
            raise IndexError("the waiting queue is empty")
        key = self.key
        return min(range(len(self.groups)), key=lambda i: key(self.groups[i]))

    def __getitem__(self, i: int) -> SequenceGroup:
        if i != 0:
            raise IndexError("ReorderingQueue gives only its head, [0]")
        return self.groups[self._best()]

    def popleft(self) -> SequenceGroup:
        return self.groups.pop(self._best())

    def remove(self, group: SequenceGroup) -> None:
        """Take `group` out (Scheduler.abort of a waiting request)."""
        self.groups.remove(group)

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[SequenceGroup]:
        return iter(self.groups)

    def candidates(self) -> list[SequenceGroup]:
        """Any waiting group could come first as keys change."""
        return list(self.groups)


class EdfPolicy(QueuePolicy):
    """SLO-aware earliest deadline first: the deadline is arrival + the request's TTFT SLO (its own
    `slo_ttft`, else `slo_ttft` here, which make_scheduler sets to the run's `--slo-ttft` unless
    given). Admission rejects a request whose deadline can no longer be met: when now + its
    uncached prompt tokens / `prefill_tokens_per_s` is past the deadline (the default rate,
    infinite, rejects once the deadline has passed while it waited)."""

    name = "edf"
    reads = REQUEST  # admit also reads `now`: wake_time says when its answer changes

    def __init__(self, slo_ttft: float = 1.0, prefill_tokens_per_s: float = math.inf) -> None:
        if not (slo_ttft > 0 and math.isfinite(slo_ttft)):
            raise ValueError(f"edf: slo_ttft must be a finite number of seconds > 0, got {slo_ttft}")
        if not prefill_tokens_per_s > 0:
            raise ValueError(f"edf: prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s}")
        self.slo_ttft, self.rate = slo_ttft, prefill_tokens_per_s

    def deadline(self, group: SequenceGroup) -> float:
        slo = group.request.slo_ttft
        return group.request.arrival + (slo if slo is not None else self.slo_ttft)

    def _latest_start(self, group: SequenceGroup) -> float:
        return self.deadline(group) - group.request.prompt_len / self.rate

    def key(self, group: SequenceGroup) -> tuple:
        return (self.deadline(group), group.group_id)

    def admit(self, group: SequenceGroup, now: float) -> str:
        if group.first_scheduled is None and now > self._latest_start(group):
            return (f"TTFT deadline {self.deadline(group):.6g} s cannot be met (now {now:.6g} s, "
                    f"{group.request.prompt_len} prompt tokens)")
        return ADMIT

    def wake_time(self, waiting: Iterable[SequenceGroup], now: float) -> float:
        t = min((self._latest_start(g) for g in waiting if g.first_scheduled is None), default=math.inf)
        return t if t >= now else now  # already due: the next step rejects it


BUILTIN: dict[str, type[QueuePolicy]] = {
    "fcfs": QueuePolicy, "priority": PriorityPolicy, "sjf": ShortestFirstPolicy, "srpt": SrptPolicy,
    "vtc": VtcPolicy, "edf": EdfPolicy,
}

