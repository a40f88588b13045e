"""Requests, sequences and sequence groups: the units the schedulers and block managers move.

A `Request` is what arrives. When admitted to a scheduler it becomes a `SequenceGroup` holding one
`Sequence` at first; parallel sampling (n > 1) and beam search fork more sequences after the first
token. Sequences count tokens; token ids are optional (the simulator has none, the live backend has
them all).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class SamplingParams:
    """How a request decodes. `max_tokens` bounds the output; with `ignore_eos` it is exact."""

    max_tokens: int = 256
    ignore_eos: bool = False
    n: int = 1
    beam_width: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    length_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.n >= 1, f"n must be >= 1, got {self.n}")
        _check(self.beam_width >= 1, f"beam_width must be >= 1, got {self.beam_width}")
        _check(self.n == 1 or self.beam_width == 1,
               f"use either n > 1 (parallel sampling) or beam_width > 1, not both (n={self.n}, "
               f"beam_width={self.beam_width})")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def width(self) -> int:
        """How many sequences the group runs at once after its first token."""
        return max(self.n, self.beam_width)


@dataclass(slots=True)  # slots: a million-request run holds a million of them
class Request:
    """One incoming request.

    `output_len` is the true output length: known to the simulator and to oracle policies only
    (None in live serving without a trace). `prefix_hashes` name the prompt's blocks of
    `hash_block_size` tokens by content, chained (equal prefix => equal hashes), as Mooncake traces
    supply them; `prompt_token_ids`, when given, are used instead. `reject_reason`, when set, says
    why the request can never be served (e.g. a trace row with zero tokens): schedulers reject it
    on arrival with that reason, and its lengths need only be >= 0.
    """

    request_id: int
    arrival: float
    prompt_len: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output_len: int | None = None
    prompt_token_ids: list[int] | None = None
    prefix_hashes: tuple[int, ...] | None = None
    hash_block_size: int = 16
    priority: int = 0
    reject_reason: str | None = None
    client: str = ""                  # who sent it (fair-share policies, per-client tables)
    slo_ttft: float | None = None     # its own SLO class: TTFT / TPOT targets, seconds (None: the run's)
    slo_tpot: float | None = None

    def __post_init__(self) -> None:
        least = 1 if self.reject_reason is None else 0
        _check(self.prompt_len >= least,
               f"request {self.request_id}: prompt_len must be >= {least}, got {self.prompt_len}")
        _check(self.output_len is None or self.output_len >= least,
               f"request {self.request_id}: output_len must be >= {least}, got {self.output_len}")
        if self.prompt_token_ids is not None:
            _check(len(self.prompt_token_ids) == self.prompt_len,
                   f"request {self.request_id}: prompt_token_ids has {len(self.prompt_token_ids)} ids "
                   f"but prompt_len is {self.prompt_len}")

    @property
    def max_output(self) -> int:
        """The most tokens any of its sequences will generate: the true output length when known,
        never more than `max_tokens` (which bounds every output, ignore_eos or not)."""
        if self.output_len is not None and self.output_len < self.sampling.max_tokens:
            return self.output_len
        return self.sampling.max_tokens


class DecodeClock(Protocol):
    """What a sequence knows of the running batch it is a member of (policies.running_batch
    .RunningBatch, not imported: it imports this module): the batch's decode clock."""

    clock: int


class SeqStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED = 3


class Sequence:
    """One stream of tokens: the prompt followed by what it has generated.

    Invariant: 0 <= num_computed <= num_tokens; the tokens in [num_computed, num_tokens) still need
    a forward pass (one in steady decode, the whole sequence after a recompute preemption).

    Exact reads (issue 23). While a member of a scheduler's running batch (`batch` set, policies/
    running_batch.py) its stored counters (`num_computed`, `output_len`, `num_tokens`, `token_ids`)
    are those of the batch's clock at `anchor`: `owed` decode steps behind. They are the
    scheduler's own. Anyone else reads the `exact_*` properties (stored + owed, pure, O(1) but
    `exact_token_ids`), or the stored fields after the scheduler's `materialise()` / `settle()`
    (routers that read the scheduler are handed it materialised). Under --debug a read of an owed
    stored field from outside the scheduler's modules raises StaleReadError (`guard_owed_reads`).
    """

    __slots__ = (
        "anchor",
        "batch",
        "block_hashes",
        "cum_logprob",
        "finish_at",
        "group",
        "num_computed",
        "origins",
        "output_len",
        "prompt_len",
        "seq_id",
        "status",
        "target_len",
        "token_ids",
    )

    def __init__(self, seq_id: int, group: SequenceGroup, prompt_len: int, target_len: int,
                 token_ids: list[int] | None = None, output_len: int = 0) -> None:
        self.seq_id = seq_id
        self.group = group
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.num_computed = 0
        self.token_ids = token_ids
        self.status = SeqStatus.WAITING
        self.target_len = target_len      # outputs it will reach (trace length or max_tokens)
        self.block_hashes: list[int] = []  # chained content hashes of full blocks, filled lazily
        # who generated the simulated output tokens (`output_origins`): (first position, seq id,
        # restart epoch) per run of positions, in order; a fork appends the child's own run. None
        # stands for the one run [(prompt_len, seq_id, 0)] (a million-request run keeps no list)
        self.origins: list[tuple[int, int, int]] | None = None
        self.cum_logprob = 0.0
        # skip-ahead's running batch (policies/running_batch.py): the decode clock this
        # sequence's counters are exact at (-1: not a member, exact now) and the clock of its
        # last token (-1: unknown)
        self.anchor = -1
        self.finish_at = -1
        self.batch: DecodeClock | None = None  # the running batch it is a member of (anchor >= 0)

    @property
    def num_tokens(self) -> int:
        """Stored: prompt_len + output_len (the scheduler's; others read `exact_num_tokens`)."""
        return self.prompt_len + self.output_len

    # ---------------------------------------------------------------- exact reads (anyone)
    @property
    def owed(self) -> int:
        """Decode steps the stored counters are behind (0 unless a member of a running batch)."""
        batch = self.batch
        return batch.clock - self.anchor if batch is not None else 0

    @property
    def exact_num_computed(self) -> int:
        """Tokens whose KV is computed, at the scheduler's clock."""
        return self.num_computed + self.owed

    @property
    def exact_output_len(self) -> int:
        """Tokens generated, at the scheduler's clock."""
        return self.output_len + self.owed

    @property
    def exact_num_tokens(self) -> int:
        """Prompt plus generated tokens, at the scheduler's clock."""
        return self.prompt_len + self.output_len + self.owed

    @property
    def exact_token_ids(self) -> list[int] | None:
        """The token ids at the scheduler's clock (a new list when owed: simulated tokens are -1),
        or None when the sequence keeps none."""
        ids, k = self.token_ids, self.owed
        return ids if ids is None or not k else ids + [-1] * k

    def output_origins(self, start: int, end: int) -> tuple[tuple[int, int, int], ...]:
        """The content of simulated output positions [start, end) (start >= prompt_len): the runs of
        `origins` they overlap, each clipped to start there. A simulated token carries no id, so it
        is named by who generated it and where: only this sequence (after a recompute) or a fork
        that inherited the position names it so, never another request. Invariant: `origins`
        starts at prompt_len, its positions rise, and a run's origin is unique to its lineage
        (None: the sequence's own single run)."""
        runs = self.origins if self.origins is not None else [(self.prompt_len, self.seq_id, 0)]
        out = []
        for i, (first, seq_id, epoch) in enumerate(runs):
            lo = max(first, start)
            hi = min(runs[i + 1][0], end) if i + 1 < len(runs) else end
            if lo < hi:  # a run that ends where it starts (a fork at its first token) names nothing
                out.append((lo, seq_id, epoch))
        return tuple(out)

    def fork_origins(self, parent: Sequence) -> None:
        """Inherit the parent's output origins up to this child's length (the fork point) and
        name the child's own tokens from there by its seq id."""
        runs = parent.origins if parent.origins is not None else [(parent.prompt_len, parent.seq_id, 0)]
        self.origins = [*runs, (self.num_tokens, self.seq_id, 0)]

    def restart_origins(self, epoch: int) -> None:
        """After a restart from the prompt the outputs are sampled anew: a new epoch names them
        (`epoch` must differ from every earlier one of this sequence)."""
        self.origins = [(self.prompt_len, self.seq_id, epoch)]

    def append(self, token: int | None) -> None:
        self.output_len += 1
        if self.token_ids is not None:
            self.token_ids.append(-1 if token is None else token)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.exact_num_tokens}, computed={self.exact_num_computed}, "
                f"{self.status.name})")


class SequenceGroup:
    """A request's sequences and its life story (timestamps, preemptions, outcome)."""

    __slots__ = (  # a million-request run keeps a million of them to build its request table
        "aborted",
        "finish_time",
        "finished_seqs",
        "first_scheduled",
        "first_token_time",
        "group_id",
        "num_preemptions",
        "num_swaps",
        "prefix_hit_tokens",
        "rejected",
        "request",
        "seqs",
        "status",
    )

    def __init__(self, request: Request, first_seq_id: int) -> None:
        self.request = request
        self.group_id = request.request_id
        ids = list(request.prompt_token_ids) if request.prompt_token_ids is not None else None
        self.seqs: list[Sequence] = [Sequence(first_seq_id, self, request.prompt_len, request.max_output, ids)]
        self.finished_seqs: list[Sequence] = []
        self.status = SeqStatus.WAITING
        self.num_preemptions = 0
        self.num_swaps = 0
        self.first_scheduled: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.rejected: str | None = None   # why it ended unfinished (rejected, or aborted: see `aborted`)
        self.aborted = False               # ended from outside (Scheduler.abort), not by the scheduler
        self.prefix_hit_tokens = 0

    @property
    def arrival(self) -> float:
        return self.request.arrival

    @property
    def live_seqs(self) -> list[Sequence]:
        return self.seqs

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def output_len(self) -> int:
        """Tokens generated by the group's longest sequence (the request's output length), exact."""
        return max((s.exact_output_len for s in self.seqs + self.finished_seqs), default=0)

    def __repr__(self) -> str:
        return f"SequenceGroup(id={self.group_id}, seqs={self.seqs}, {self.status.name})"
