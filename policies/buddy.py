"""A binary buddy allocator over a line of `capacity` units.

Chunks are powers of two, aligned to their size; freeing a chunk merges it with its free buddy, so
external fragmentation arises (and heals) as in a real allocator. A capacity that is not a power of
two is split into aligned power-of-two roots, largest first.
"""

from __future__ import annotations


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class BuddyAllocator:
    """Invariant: the free chunks and the allocated chunks tile [0, capacity) exactly."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.roots: list[tuple[int, int]] = []  # (start, size)
        self.free_lists: dict[int, set[int]] = {}  # size -> offsets of free chunks
        start = 0
        for bit in range(capacity.bit_length() - 1, -1, -1):
            size = 1 << bit
            if capacity & size:
                self.roots.append((start, size))
                self.free_lists.setdefault(size, set()).add(start)
                start += size
        self.allocated: dict[int, int] = {}  # offset -> size
        self.num_free = capacity

    @property
    def max_chunk(self) -> int:
        return self.roots[0][1]

    def largest_free(self) -> int:
        return max((s for s, offs in self.free_lists.items() if offs), default=0)

    def free_chunks(self) -> list[tuple[int, int]]:
        return sorted((o, s) for s, offs in self.free_lists.items() for o in offs)

    def can_allocate(self, size: int) -> bool:
        return self.largest_free() >= next_pow2(size)

    def allocate(self, size: int) -> int | None:
        """Place a chunk of next_pow2(size) units; its offset, or None if no free chunk is large enough."""
        want = next_pow2(size)
        candidates = [s for s, offs in self.free_lists.items() if s >= want and offs]
        if not candidates:
            return None
        s = min(candidates)
        offset = min(self.free_lists[s])  # lowest address first keeps placement deterministic
        self.free_lists[s].discard(offset)
        while s > want:  # split, keeping the low half
            s //= 2
            self.free_lists.setdefault(s, set()).add(offset + s)
        self.allocated[offset] = want
        self.num_free -= want
        return offset

    def free(self, offset: int) -> None:
        size = self.allocated.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not an allocated chunk")
        self.num_free += size
        root_size = next(s for start, s in self.roots if start <= offset < start + s)
        while size < root_size:
            buddy = offset ^ size
            peers = self.free_lists.get(size)
            if not peers or buddy not in peers:
                break
            peers.discard(buddy)
            offset = min(offset, buddy)
            size *= 2
        self.free_lists.setdefault(size, set()).add(offset)

    def check_invariants(self) -> None:
        spans = sorted([(o, s) for o, s in self.allocated.items()] + self.free_chunks())
        pos = 0
        for o, s in spans:
            assert o == pos, f"gap or overlap at {pos} (next chunk at {o})"
            assert o % s == 0 or any(st <= o < st + rs for st, rs in self.roots), "misaligned chunk"
            pos = o + s
        assert pos == self.capacity, f"chunks cover {pos} of {self.capacity}"
        assert self.num_free == sum(s for _, s in self.free_chunks())
