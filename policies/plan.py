"""What one engine iteration does (`StepPlan`) and what came of it (`StepResult`).

The scheduler writes a `StepPlan`; an executor (simulated or live) carries it out and returns a
`StepResult`; the scheduler then applies the result. Plans speak of sequences, block ids and token
counts, never of tensors. A plan is all an executor is given: each scheduled sequence comes with its
`Sequence` (token ids, its group's sampling parameters, its sibling beams), which the executor reads
and never changes, so that no executor holds a scheduler.

Skip-ahead is the same contract over many iterations: a scheduler may offer a `RepeatPlan` ("this
batch repeats k times unless something changes"), the executor prices its iterations in one call,
the replica step (policies/step.py) narrows it to what is certain, and the scheduler applies it at
once, reporting a `RepeatResult`.

The classes built at every iteration or window write their `__init__` out (the dataclass decorator
keeps it and still adds repr, eq and fields): the compiled kernel (build_compiled.py) runs a
generated `__init__` as interpreted code called with a keyword dict, ten times the cost of a
written one compiled; interpreted, the two cost the same. A frozen class sets its fields through
`object.__setattr__`, as the generated one does, called by that name at each field: mypyc compiles
`object.__setattr__(self, "field", value)` into a direct store (through a local alias it stays a
generic call, ~850 instructions a field), and the class stays frozen for every other writer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policies.request import Sequence, SequenceGroup


@dataclass(frozen=True)
class StepComposition:
    """The numbers a cost model needs to price one iteration.

    Prefill covers every chunk that computes more than the next single token: first prefills,
    chunked-prefill pieces and recomputation after preemption. Decode covers sequences that
    compute exactly one new token over an already cached context.
    """

    num_prefill_seqs: int = 0
    prefill_tokens: int = 0          # new tokens computed in prefill chunks
    prefill_attn_pairs: int = 0      # query-key pairs scored in prefill chunks (causal, incl. cached prefix)
    prefill_context_tokens: int = 0  # cached-prefix tokens read by prefill chunks
    num_decode_seqs: int = 0
    decode_context_tokens: int = 0   # sum over decode sequences of their context length (incl. new token)
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    copy_blocks: int = 0
    block_size: int = 16

    def __init__(self, num_prefill_seqs: int = 0, prefill_tokens: int = 0, prefill_attn_pairs: int = 0,
                 prefill_context_tokens: int = 0, num_decode_seqs: int = 0, decode_context_tokens: int = 0,
                 swap_in_blocks: int = 0, swap_out_blocks: int = 0, copy_blocks: int = 0,
                 block_size: int = 16) -> None:
        # object.__setattr__ written out at each field (frozen): the compiled kernel makes each a direct
        # store (mypyc specialises the literal call; through a local alias it is a generic call)
        object.__setattr__(self, "num_prefill_seqs", num_prefill_seqs)
        object.__setattr__(self, "prefill_tokens", prefill_tokens)
        object.__setattr__(self, "prefill_attn_pairs", prefill_attn_pairs)
        object.__setattr__(self, "prefill_context_tokens", prefill_context_tokens)
        object.__setattr__(self, "num_decode_seqs", num_decode_seqs)
        object.__setattr__(self, "decode_context_tokens", decode_context_tokens)
        object.__setattr__(self, "swap_in_blocks", swap_in_blocks)
        object.__setattr__(self, "swap_out_blocks", swap_out_blocks)
        object.__setattr__(self, "copy_blocks", copy_blocks)
        object.__setattr__(self, "block_size", block_size)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.num_decode_seqs

    @property
    def is_empty(self) -> bool:
        return self.num_tokens == 0 and self.swap_in_blocks == 0 and self.swap_out_blocks == 0

    def counts(self) -> dict[str, int]:
        """The work counts (every field but block_size), as profile measurements record them."""
        return {f: getattr(self, f) for f in COMPOSITION_COUNTS}


COMPOSITION_COUNTS: tuple[str, ...] = tuple(f.name for f in fields(StepComposition) if f.name != "block_size")


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work in an iteration: compute `num_new_tokens` tokens starting at
    position `start` (its number of already computed tokens). `seq` is the sequence itself, for
    the executor to read (its tokens `seq.token_ids[start:start + num_new_tokens]`, its group's
    sampling parameters); None only in a plan built to be priced, never executed (the profiler's)."""

    seq_id: int
    group_id: int
    start: int
    num_new_tokens: int
    block_table: list[int] | range  # a contiguous allocator's region is a range (compiled code checks the type)
    samples: bool  # True when this chunk reaches the end of the known tokens, so a token is sampled
    seq: Sequence | None

    def __init__(self, seq_id: int, group_id: int, start: int, num_new_tokens: int, block_table: list[int] | range,
                 samples: bool, seq: Sequence | None) -> None:
        self.seq_id = seq_id
        self.group_id = group_id
        self.start = start
        self.num_new_tokens = num_new_tokens
        self.block_table = block_table
        self.samples = samples
        self.seq = seq


@dataclass
class StepPlan:
    """The scheduler's decision for one iteration.

    A plan is valid until the next `schedule()`: block tables are the block manager's own lists
    (copying them every iteration would double the bookkeeping cost), so an executor that keeps a
    plan must copy what it needs.

    Invariants: every block id in `seqs[i].block_table` is allocated to that sequence and covers
    positions [0, start + num_new_tokens); `copies` must run before the forward pass (copy-on-write
    sources into fresh destinations); `swap_out` runs before `swap_in`; preempted groups are not in
    `seqs`.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)        # (src gpu block, dst gpu block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)      # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)       # (cpu block, gpu block)
    preempted: list[tuple[int, str]] = field(default_factory=list)     # (group id, "recompute" | "swap")
    rejected: list[tuple[int, str]] = field(default_factory=list)      # (group id, reason)
    block_size: int = 16

    def __init__(self, seqs: list[ScheduledSeq] | None = None, copies: list[tuple[int, int]] | None = None,
                 swap_out: list[tuple[int, int]] | None = None, swap_in: list[tuple[int, int]] | None = None,
                 preempted: list[tuple[int, str]] | None = None, rejected: list[tuple[int, str]] | None = None,
                 block_size: int = 16) -> None:
        # None: a new empty list (the fields' default_factory)
        self.seqs = [] if seqs is None else seqs
        self.copies = [] if copies is None else copies
        self.swap_out = [] if swap_out is None else swap_out
        self.swap_in = [] if swap_in is None else swap_in
        self.preempted = [] if preempted is None else preempted
        self.rejected = [] if rejected is None else rejected
        self.block_size = block_size

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.swap_in and not self.swap_out

    def composition(self, more_decodes: int = 0, more_decode_context: int = 0) -> StepComposition:
        """The numbers to price the plan by; plus `more_decodes` decoding sequences not listed in
        it, whose contexts (with the new token) sum to `more_decode_context`."""
        pf_seqs = pf_tok = pf_pairs = pf_ctx = 0
        dec, dec_ctx = more_decodes, more_decode_context
        for s in self.seqs:
            n = s.num_new_tokens
            if n == 1 and s.start > 0:
                dec += 1
                dec_ctx += s.start + 1
            else:
                pf_seqs += 1
                pf_tok += n
                pf_ctx += s.start
                pf_pairs += n * s.start + n * (n + 1) // 2
        return StepComposition(
            num_prefill_seqs=pf_seqs, prefill_tokens=pf_tok, prefill_attn_pairs=pf_pairs,
            prefill_context_tokens=pf_ctx, num_decode_seqs=dec, decode_context_tokens=dec_ctx,
            swap_in_blocks=len(self.swap_in), swap_out_blocks=len(self.swap_out),
            copy_blocks=len(self.copies), block_size=self.block_size,
        )


@dataclass(slots=True)
class SeqOutcome:
    """What one sampling sequence produced. `children` is used by parallel sampling and beam
    search: each entry (token) is a new sequence forked from this one that continues with that
    token; `token` continues this sequence itself (None when this sequence is dropped, as a pruned
    beam). Token ids are None in simulation. `children_finished[j]` says child j ends with the
    token it is born with (its output limit is one token, or that token is EOS)."""

    seq_id: int
    token: int | None = None
    keep: bool = True
    children: list[int | None] | tuple[int | None, ...] = ()  # a tuple default: no list per outcome
    finished: bool = False
    logprob: float = 0.0
    children_finished: list[bool] | tuple[bool, ...] = ()

    def __init__(self, seq_id: int, token: int | None = None, keep: bool = True,
                 children: list[int | None] | tuple[int | None, ...] = (), finished: bool = False,
                 logprob: float = 0.0, children_finished: list[bool] | tuple[bool, ...] = ()) -> None:
        self.seq_id = seq_id
        self.token = token
        self.keep = keep
        self.children = children
        self.finished = finished
        self.logprob = logprob
        self.children_finished = children_finished


@dataclass
class StepResult:
    """An executor's report of one iteration: its duration (simulated or measured wall time) and
    the outcome of each sequence that sampled.

    With `others_continue`, only the outcomes that matter are reported (sequences that finish,
    fork or are dropped): every other sampling sequence continued with one unknown token, as
    `SeqOutcome(seq_id)` would say. The simulated executor reports this way, as building an
    outcome per sequence per step was a large part of its cost; without the flag (the live
    executor) a sampling sequence without an outcome is an error."""

    duration: float
    outcomes: dict[int, SeqOutcome] = field(default_factory=dict)
    others_continue: bool = False

    def __init__(self, duration: float, outcomes: dict[int, SeqOutcome] | None = None,
                 others_continue: bool = False) -> None:
        self.duration = duration
        self.outcomes = {} if outcomes is None else outcomes  # None: a new empty dict (default_factory)
        self.others_continue = others_continue


@dataclass(slots=True, eq=False)
class RepeatPlan:
    """A scheduler's offer: "this batch repeats `steps` times unless something changes".

    The batch is `num_seqs` single sequences, each computing exactly one decode token per
    iteration and nothing else happening (no prefill, admission, rejection, swap or preemption);
    their computed tokens sum to `context_tokens` before the first iteration. The scheduler's
    memory suffices for `steps` iterations; with `exhausts`, it runs out in the iteration after
    them, which then preempts and admits nothing, and which the scheduler applies too.

    What the scheduler cannot know, the others decide before it applies the plan: the executor
    says how many tokens each of `seqs` samples before it finishes (`remaining`: the sequences
    whose finish the scheduler does not know yet, often none; `first_known` is how many iterations
    away the first finish it knows is), and the replica step narrows `steps` (never up) and
    `exhausts` (only to False) to the window that is certain: a finish ends it (the finishing
    iteration included), as does an arrival that could be admitted, the policy's wake time or,
    behind a router, any arrival. Valid until the scheduler next changes other than through its
    `apply_repeat`.
    """

    num_seqs: int
    context_tokens: int
    steps: int
    exhausts: bool
    # the batch's sequences whose finish the scheduler does not know, for the executor's `remaining`
    seqs: list[Sequence] = field(default_factory=list)
    remaining: list[int] | None = None
    first_known: float = math.inf

    def __init__(self, num_seqs: int, context_tokens: int, steps: int, exhausts: bool,
                 seqs: list[Sequence] | None = None, remaining: list[int] | None = None,
                 first_known: float = math.inf) -> None:
        self.num_seqs = num_seqs
        self.context_tokens = context_tokens
        self.steps = steps
        self.exhausts = exhausts
        self.seqs = [] if seqs is None else seqs  # None: a new empty list (default_factory)
        self.remaining = remaining
        self.first_known = first_known

    def first_finish(self) -> float:
        """Iterations until the first finish in the batch (its last token's iteration), once the
        executor has given `remaining`."""
        remaining = self.remaining
        if not remaining:
            return self.first_known
        told = remaining[0]
        for r in remaining:  # a loop, not min(): a generic call compiled
            if r < told:
                told = r
        return told if told < self.first_known else self.first_known


@dataclass(slots=True, eq=False)
class DecodeStepPlan:
    """A scheduler's offer to apply its next iteration at once, without a plan per sequence: the
    running batch, `seqs` (single sequences, in batch order), decodes one token each with blocks
    enough for all (nothing is preempted or swapped), while waiting groups are admitted or rejected
    by the scheduler's own admission rule, as stepping would. The executor says how many tokens
    each of `seqs` (the batch's sequences whose finish the scheduler does not know yet) samples
    before it finishes (`remaining`, as for a RepeatPlan) before the scheduler applies it. Valid
    until the scheduler next changes."""

    seqs: list[Sequence]
    remaining: list[int] | None = None

    def __init__(self, seqs: list[Sequence], remaining: list[int] | None = None) -> None:
        self.seqs = seqs
        self.remaining = remaining


@dataclass(slots=True, eq=False)
class DecodeStepResult:
    """A DecodeStepPlan's iteration, applied in two halves as stepping applies one: its start
    (`apply_decode_step`: what schedule() and the executor do) gives the composition, the
    executor's `result` (its duration; outcomes of the sequences it sampled and could not assume
    continued) and what its end needs: `step`, the partial plan (the finishing sequences, then the
    admitted ones), `batch_groups`, the running groups at its start when the policy is told the
    service (else None), `num_finishing`, how many of `step.seqs` are the batch's finishing
    sequences; its end (`complete_decode_step`: what on_step_done does) fills `finished`, the
    groups that finished."""

    comp: StepComposition
    result: StepResult
    step: StepPlan
    batch_groups: list[SequenceGroup] | None
    num_finishing: int
    finished: list[SequenceGroup]

    def __init__(self, comp: StepComposition, result: StepResult, step: StepPlan,
                 batch_groups: list[SequenceGroup] | None, num_finishing: int) -> None:
        self.comp = comp
        self.result = result
        self.step = step
        self.batch_groups = batch_groups
        self.num_finishing = num_finishing
        self.finished = []


@dataclass(slots=True, eq=False)
class RepeatResult:
    """What applying a RepeatPlan did: what the iteration log needs to derive the repeated
    iterations' rows (IterationLog.add_window), a few numbers instead of a list per column.

    Before the first iteration the batch was `num_seqs` single sequences holding
    `context_tokens` (the plan's), the cache `states0` token states in `allocated0` allocated
    slots with `free0` free slots (blocks of `block_size` slots); iteration j (1-based) adds
    `num_seqs` token states and opens `opened[j - 1]` blocks, so after it the cache holds
    states0 + j * num_seqs token states, internal_frag allocated0 + taken_j * block_size - token
    states and free0 - taken_j * block_size free slots (taken_j: opened[0] + ... + opened[j - 1]),
    with num_seqs running, no reserved slots and no external fragmentation; except after the last
    one, whose finishes freed blocks: then `last_running`, `last_states`, `last_internal`,
    `last_free`, read from the cache. `opened` is empty when the window was only the preempting
    iteration (nothing to log but that iteration).

    When the plan exhausted blocks, the preempting iteration after them: its composition, duration
    and preemptions (`exhaustion` None when that iteration ran nothing: every sequence of the
    batch was preempted, so no time passed)."""

    opened: list[int]
    num_seqs: int
    context_tokens: int
    states0: int
    allocated0: int
    free0: int
    block_size: int
    last_running: int = 0
    last_states: int = 0
    last_internal: int = 0
    last_free: int = 0
    exhaustion: StepComposition | None = None
    exhaustion_duration: float = 0.0
    num_preempted: int = 0

    def __init__(self, opened: list[int], num_seqs: int, context_tokens: int, states0: int, allocated0: int,
                 free0: int, block_size: int) -> None:
        """The repeated iterations' record, its last iteration's figures (and any preempting
        iteration) still to be set."""
        self.opened = opened
        self.num_seqs = num_seqs
        self.context_tokens = context_tokens
        self.states0 = states0
        self.allocated0 = allocated0
        self.free0 = free0
        self.block_size = block_size
        self.last_running = self.last_states = self.last_internal = self.last_free = 0
        self.exhaustion = None
        self.exhaustion_duration = 0.0
        self.num_preempted = 0
