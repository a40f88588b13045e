"""Contiguous KV allocation, as in the vLLM paper's Orca baselines.

Each sequence reserves one contiguous chunk of token slots for its prompt plus its output, sized by
the variant: `max` (prompt + max output tokens), `pow2` (prompt + the next power of two of the true
output length, capped at max output tokens), `oracle` (prompt + the true output length). Chunks are placed by a buddy allocator
in units of `block_size` slots (1 = token granularity), so external fragmentation is real.
"""

from __future__ import annotations

from policies.block_manager import AllocStatus
from policies.buddy import BuddyAllocator, next_pow2
from policies.memory import MemoryBreakdown
from policies.request import Sequence, SequenceGroup

VARIANTS = ("max", "pow2", "oracle")


class ContiguousAllocator:
    """Per-sequence contiguous reservations on a `BuddyAllocator`.

    Invariant: each running sequence owns exactly one chunk of at least its reservation, and its
    tokens never exceed the reservation.
    """

    def __init__(self, num_slots: int, variant: str = "max", block_size: int = 1) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_slots < block_size:
            raise ValueError(f"num_slots must be >= block_size ({block_size}), got {num_slots}")
        self.variant = variant
        self.block_size = block_size
        self.buddy = BuddyAllocator(num_slots // block_size)
        self.num_slots = self.buddy.capacity * block_size
        self.chunks: dict[int, tuple[int, int]] = {}  # seq id -> (offset unit, reserved slots)
        self.seqs: dict[int, Sequence] = {}

    def reservation(self, group: SequenceGroup) -> int:
        """Token slots one sequence of the group reserves."""
        req = group.request
        if self.variant == "max":
            out = req.sampling.max_tokens
        else:
            if req.output_len is None:
                raise ValueError(f"request {req.request_id}: orca-{self.variant} needs the true output length")
            # pow2 never reserves more than the request may generate (its max_tokens)
            out = req.max_output if self.variant == "oracle" else min(next_pow2(req.max_output),
                                                                    req.sampling.max_tokens)
        return req.prompt_len + out

    def _units(self, slots: int) -> int:
        return -(-slots // self.block_size)

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        units = next_pow2(self._units(self.reservation(group)))
        width = group.request.sampling.width
        if units > self.buddy.max_chunk or width * units > self.buddy.capacity:
            return AllocStatus.NEVER
        if width == 1:
            return AllocStatus.OK if self.buddy.can_allocate(units) else AllocStatus.LATER
        placed = [self.buddy.allocate(units) for _ in range(width)]  # try, then undo
        for off in placed:
            if off is not None:
                self.buddy.free(off)
        return AllocStatus.OK if None not in placed else AllocStatus.LATER

    def allocate(self, group: SequenceGroup, seq: Sequence) -> None:
        slots = self.reservation(group)
        off = self.buddy.allocate(self._units(slots))
        if off is None:
            raise AssertionError(f"sequence {seq.seq_id}: no chunk of {slots} slots (check can_allocate)")
        self.chunks[seq.seq_id] = (off, slots)
        self.seqs[seq.seq_id] = seq

    def free(self, seq: Sequence) -> None:
        chunk = self.chunks.pop(seq.seq_id, None)
        self.seqs.pop(seq.seq_id, None)
        if chunk is not None:
            self.buddy.free(chunk[0])

    def block_table(self, seq_id: int) -> range:
        off, slots = self.chunks[seq_id]
        return range(off, off + self._units(slots))

    def memory(self, pending_slots: int | None = None) -> MemoryBreakdown:
        """Slots by category. Free chunks too small for the pending request (the waiting queue's
        head, if any) count as external fragmentation."""
        bs = self.block_size
        states = reserved = internal = 0
        for sid, (off, slots) in self.chunks.items():
            seq = self.seqs[sid]
            chunk = self.buddy.allocated[off] * bs
            used = min(seq.num_computed, slots)
            true_out = seq.group.request.output_len
            eventual = slots if true_out is None else min(slots, seq.prompt_len + true_out)
            eventual = max(eventual, used)
            states += used
            reserved += eventual - used
            internal += chunk - eventual
        external = 0
        if pending_slots is not None:
            want = next_pow2(self._units(pending_slots))
            external = sum(s for _, s in self.buddy.free_chunks() if s < want) * bs
        free = self.buddy.num_free * bs - external
        return MemoryBreakdown(states, reserved, internal, external, free)

    def check_invariants(self) -> None:
        self.buddy.check_invariants()
        assert set(self.chunks) == set(self.seqs)
        for sid, (off, slots) in self.chunks.items():
            assert self.buddy.allocated[off] * self.block_size >= slots
            assert self.seqs[sid].num_tokens <= slots + 1, f"seq {sid} outgrew its reservation"
