"""Paged KV-cache block management (PagedAttention): blocks, a free queue, and per-sequence tables.

Physical GPU blocks live in a `BlockPool`. A sequence's `block table` maps its logical blocks to
physical ones; a new physical block is taken only when the last one is full, so a sequence wastes
at most one partly filled block. Blocks are reference counted: `fork` shares all of a parent's
blocks, and writing into a shared partly filled block copies it first (copy-on-write). With prefix
caching, full blocks are named by a hash chained on the parent block's hash and the block's
content; equal prefixes map to the same physical blocks, and freed cached blocks stay reusable
until they are evicted, least recently used first.

Only the pools (`BlockPool`, `CpuBlockPool`) change reference counts and the free queue: take,
share, touch, release. Conservation (checked by `check_invariants`): every physical block is either in use
(ref_count > 0) or in the free queue, never both; free + used = total; cached blocks are a subset
of free + used.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from policies.kv_listener import KvCacheListener
from policies.memory import MemoryBreakdown
from policies.request import Request, Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    OK = "ok"          # can be allocated now
    LATER = "later"    # does not fit now, will when memory frees up
    NEVER = "never"    # larger than the whole cache: reject


class Block:
    """A physical KV block. `filled` counts the token slots written in it; `hash` names its
    content once full (prefix caching), else None."""

    __slots__ = ("block_id", "filled", "hash", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.filled = 0


class BlockPool:
    """A fixed set of blocks and an LRU free queue.

    The free queue holds blocks with ref_count 0 in eviction order: never-cached blocks at the
    front, cached ones behind them in the order they were freed. Taking a block from the front
    evicts its hash, if any. It is kept in two parts, as a block's hash says which it is in: the
    never-cached blocks (a stack whose top is the queue's front: a freed one is reused first)
    and the idle cached ones (least recently freed first); only a take clears a hash, so no block
    moves between them while free.

    Blocks are made when first taken: `blocks` holds blocks 0 .. len(blocks) - 1 (block i at index
    i), and the ids from len(blocks) to num_blocks - 1, never taken, lie under the never-cached
    stack in id order (the lowest taken first, as if the stack had started full). A small model on
    a large GPU has millions of blocks and a run may touch a few hundred. `num_free` is kept:
    _top + len(_idle) + the blocks not made yet, always.

    The never-cached stack is `_fresh[:_top]` (its top at _top - 1); the list is not shortened as
    blocks are taken (the slots from _top on are spare, their ids stale), so that taking and
    freeing blocks writes into it instead of popping and extending a list that shrinks and
    regrows (each a reallocation, at saturation where the stack stays near empty).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks: list[Block] = []  # the blocks taken at least once, by id
        self._fresh: list[int] = []  # [:_top]: made, free, hash None; the front is _fresh[_top - 1]
        self._top = 0
        self._idle: OrderedDict[int, None] = OrderedDict()  # hashed, least recently freed first
        self.cached: dict[int, int] = {}  # content hash -> block id
        self.evictions = 0
        self.used_filled = 0  # sum of `filled` over blocks in use: the token states, kept O(1)
        self.num_free = num_blocks  # the free queue's length, kept (asked at every iteration)
        # told of hashes stored, evicted, cleared (a typed attribute: compiled code checks what is assigned)
        self.listener: KvCacheListener | None = None

    @property
    def free(self) -> list[int]:
        """The free queue's block ids, front first (a copy: for checks and tests)."""
        return [*reversed(self._fresh[:self._top]), *range(len(self.blocks), self.num_blocks), *self._idle]

    def _make(self, n: int) -> None:
        """Make the next `n` never-taken blocks, under the never-cached stack (after every block
        freed there, in the free queue's order)."""
        first = len(self.blocks)
        self.blocks.extend([Block(i) for i in range(first, first + n)])
        self._fresh[:0] = range(first + n - 1, first - 1, -1)
        self._top += n

    def take(self) -> Block:
        return self.blocks[self.take_ids(1)[0]]

    def take_ids(self, n: int, filled: int = 0) -> list[int]:
        """`take()` n times (the caller has counted them against the free blocks); their ids, in
        the order taken, each block's fill level set to `filled` (0: empty, as take() leaves it;
        the caller counts the token states). One loop for the many blocks a window of decodes
        opens."""
        fresh, blocks = self._fresh, self.blocks
        if n > self._top and len(blocks) < self.num_blocks:
            self._make(min(n - self._top, self.num_blocks - len(blocks)))
        top = self._top
        if n <= top:  # the common case: never-cached blocks only, taken from the stack's top
            ids = fresh[top - n:top]  # the stack's own int objects (none boxed again), top first:
            ids.reverse()
            self._top = top - n
            self.num_free -= n
            for i in range(n):
                block = blocks[ids[i]]
                block.ref_count = 1
                block.filled = filled
            return ids
        if n > self.num_free:
            raise KeyError("take from an empty free queue")
        self.num_free -= n
        ids = []
        for _ in range(n):
            if self._top:
                self._top -= 1
                block_id = fresh[self._top]
                block = blocks[block_id]
            else:  # the least recently freed cached block: evicted
                block_id, _ = self._idle.popitem(last=False)
                block = blocks[block_id]
                del self.cached[block.hash]  # type: ignore[arg-type]  # an idle block is hashed
                if self.listener is not None:
                    self.listener.removed(block.hash)  # type: ignore[arg-type]  # an idle block is hashed
                block.hash = None
                self.evictions += 1
            block.ref_count = 1
            block.filled = filled
            ids.append(block_id)
        return ids

    def share(self, block: Block) -> None:
        """One more reference on a block in use (a fork, or a block shared again after a swap)."""
        if block.ref_count < 1:
            raise AssertionError(f"block {block.block_id} shared while free")
        block.ref_count += 1

    def touch(self, block: Block) -> None:
        """Take a reference on a block found by hash (removing it from the free queue if idle)."""
        if block.ref_count == 0:
            del self._idle[block.block_id]
            self.num_free -= 1
            self.used_filled += block.filled
        block.ref_count += 1

    def release(self, block: Block) -> None:
        self.release_ids([block.block_id])

    def release_ids(self, block_ids: list[int], backwards: bool = False) -> None:
        """`release()` each block, in order (last first when `backwards`): one loop for a whole
        table freed at once (a list walked by index: compiled, no iterator object per table)."""
        blocks, idle = self.blocks, self._idle
        freed_states = freed = 0
        n = len(block_ids)
        # while every block so far went to the never-cached stack (the common case: a sequence's
        # own blocks, nothing cached), they are pushed at the end as one slice of `block_ids` (the
        # same order, and the list's own int objects: no int boxed again per block); from the
        # first block that does not, each is pushed as it comes
        run = True
        for i in range(n):
            block_id = block_ids[n - 1 - i if backwards else i]
            block = blocks[block_id]
            refs = block.ref_count - 1
            block.ref_count = refs
            if refs <= 0:
                if refs < 0:
                    self._push_fresh_run(block_ids, i, backwards, run)
                    self.used_filled -= freed_states
                    self.num_free += freed
                    raise AssertionError(f"block {block_id} freed twice")
                freed_states += block.filled
                freed += 1
                if block.hash is None:  # nothing worth keeping: reuse it first
                    if not run:
                        self._push_fresh(block_id)
                    continue
                self._push_fresh_run(block_ids, i, backwards, run)
                run = False
                idle[block_id] = None
            elif run:  # still in use (shared): the run ends before it
                self._push_fresh_run(block_ids, i, backwards, run)
                run = False
        self._push_fresh_run(block_ids, n, backwards, run)
        self.used_filled -= freed_states
        self.num_free += freed

    def _push_fresh_run(self, block_ids: list[int], i: int, backwards: bool, run: bool) -> None:
        """release_ids: push its first `i` blocks (in its order) onto the never-cached stack when
        they are still an unbroken run of blocks bound there (`run`)."""
        if run and i:
            if backwards:
                run_ids = block_ids[len(block_ids) - i:]
                run_ids.reverse()  # not a [::-1] slice: a generic call compiled
            else:
                run_ids = block_ids[:i]
            top = self._top
            # over the spare slots (the list grows only by what they lack): one slice assignment
            self._fresh[top:top + i] = run_ids
            self._top = top + i

    def _push_fresh(self, block_id: int) -> None:
        """Push one block onto the never-cached stack."""
        top = self._top
        if top < len(self._fresh):
            self._fresh[top] = block_id
        else:
            self._fresh.append(block_id)
        self._top = top + 1

    def release_table(self, table: list[int]) -> None:
        """`release_ids(table, backwards=True)`: a whole table freed, last block first. Its own
        never-cached blocks at the end (ref_count 1, no hash: usually the whole table) are released
        in one pass and pushed in one extend; `release_ids` takes whatever precedes them."""
        blocks = self.blocks
        j = len(table)
        states = 0
        while j:
            block = blocks[table[j - 1]]
            if block.ref_count != 1 or block.hash is not None:
                break  # shared, cached or freed twice: the general path
            block.ref_count = 0
            states += block.filled
            j -= 1
        if j < len(table):
            self._push_fresh_run(table, len(table) - j, True, True)
            self.used_filled -= states
            self.num_free += len(table) - j
        if j:
            self.release_ids(table[:j], backwards=True)

    def set_filled(self, block: Block, filled: int) -> None:
        """Record how many slots of an in-use block hold tokens."""
        self.used_filled += filled - block.filled
        block.filled = filled

    def register(self, block: Block, content_hash: int) -> None:
        if block.hash is None and content_hash not in self.cached:
            block.hash = content_hash
            self.cached[content_hash] = block.block_id
            if self.listener is not None:
                self.listener.stored(block, content_hash)

    def clear_cache(self) -> bool:
        """Forget every cached hash (vLLM's reset_prefix_cache): only while no block is in use
        (else False, nothing changes); the idle cached blocks become never-cached free blocks."""
        if self.num_free != self.num_blocks:
            return False
        for block_id in self._idle:
            self.blocks[block_id].hash = None
            self._push_fresh(block_id)
        self._idle.clear()
        self.cached.clear()
        if self.listener is not None:
            self.listener.cleared()
        return True

    def check_invariants(self, refs: list[int]) -> None:
        """Raise AssertionError unless each made block's reference count is `refs[block id]` (the
        block tables' count, one per made block), the free queue holds exactly the blocks with no
        reference, once, and every cache entry names a block with its hash."""
        made = len(self.blocks)
        assert len(refs) == made, f"{len(refs)} reference counts for {made} blocks"
        free = self._fresh[:self._top] + list(self._idle)
        free_ids = set(free)
        assert len(free_ids) == len(free), "a block is in the free queue twice"
        assert self.num_free == len(free) + self.num_blocks - made, \
            f"kept free count {self.num_free} != {len(free) + self.num_blocks - made}"
        assert all(b < made for b in free_ids), "the free queue holds a block never taken"
        for blk in self.blocks:
            assert blk.ref_count == refs[blk.block_id], f"block {blk.block_id}: ref {blk.ref_count} != {refs[blk.block_id]}"
            assert (blk.ref_count == 0) == (blk.block_id in free_ids), f"block {blk.block_id}: free-queue mismatch"
        for h, bid in self.cached.items():
            assert self.blocks[bid].hash == h, f"cache entry {h} points at block {bid} with other hash"


class CpuBlockPool:
    """The CPU swap space: a bounded set of block ids with reference counts."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def take(self) -> int:
        b = self.free_ids.pop()
        self.ref[b] = 1
        return b

    def share(self, b: int) -> None:
        """One more reference on a CPU block in use (a block shared within a swapped group)."""
        if self.ref[b] < 1:
            raise AssertionError(f"cpu block {b} shared while free")
        self.ref[b] += 1

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] < 0:
            raise AssertionError(f"cpu block {b} freed twice")
        if self.ref[b] == 0:
            self.free_ids.append(b)


def table_of(seq: Sequence) -> list[int]:
    """The sequence's device block table (it must hold one)."""
    table = seq.block_table
    if table is None:
        raise KeyError(f"sequence {seq.seq_id} has no block table")
    return table


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_content(seq: Sequence, start: int, end: int) -> tuple[object, ...] | None:
    """What names the tokens at positions [start, end) of `seq` (the full block's content, hashed
    with its parent's hash), or None when the prompt part cannot be named (prefix hashes that
    stop short of it).

    Token ids, when the sequence keeps them, name the block, unless output positions hold
    simulated tokens (-1): those, like every output of a sequence without ids, are named by who
    generated them (`Sequence.output_origins`) after the prompt part (its ids, or the chained
    prefix hash of the hash block holding the prompt's last token and that token's offset in it:
    every prompt token; a prompt with neither, by its request: it shares nothing). A prompt-only
    block is named by its prompt part alone."""
    p = seq.prompt_len
    ids = seq.token_ids
    prompt_part: tuple[object, ...]
    if ids is not None:
        block = tuple(ids[start:end])
        if end <= p or -1 not in block[max(p - start, 0):]:  # a prompt block, or real output ids
            return block
        prompt_part = block[:max(p - start, 0)]
    elif start < p:
        request = seq.group.request
        ph = request.prefix_hashes
        hbs = request.hash_block_size
        last = min(end, p)
        if ph is None:
            # a prompt known by its length only shares nothing (as a benchmark's random prompt):
            # private to its request, so that only the request itself, readmitted after a
            # recompute, finds its blocks, as vLLM finds a random prompt's
            prompt_part = ("r", request.request_id, last)
        else:
            # the chained hash of the hash block holding the block's last prompt token names
            # every token up to there, so (it, end offset) names the prompt part even when block
            # and hash-block boundaries do not line up
            k = (last - 1) // hbs
            if k >= len(ph):
                return None
            prompt_part = ("h", ph[k], last - k * hbs)
        if end <= p:
            return prompt_part
    else:
        prompt_part = ()
    # (prompt part, output runs): a pair whose second item is a tuple of runs, which no block of
    # ids (ints) or prompt-only prefix-hash block equals
    return (prompt_part, seq.output_origins(max(start, p), end))


class PagedBlockManager:
    """Per-sequence block tables over a `BlockPool`, with fork, copy-on-write, swap and prefix caching.

    A sequence holding device blocks keeps its own table and slot count (`Sequence.block_table`,
    `Sequence.num_slots`: read and written here without a lookup by seq id, several per sequence
    per admission); the manager keeps who holds one (`holders`), and `tables` / `slots` give them
    by seq id to readers. Invariant per holder: `num_slots` is the number of token positions its
    table covers with written (or being written) slots, and len(table) == ceil(num_slots /
    block_size); a sequence not in `holders` has no table (None) and no slots (0).
    """

    def __init__(self, num_gpu_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0,
                 watermark: float = 0.01, enable_prefix_caching: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_gpu_blocks}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.pool = BlockPool(num_gpu_blocks)
        self.cpu = CpuBlockPool(num_cpu_blocks)
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.holders: dict[int, Sequence] = {}  # the sequences with a device table, by seq id
        self.cpu_tables: dict[int, list[int]] = {}
        self.cpu_slots: dict[int, int] = {}
        self.prefix_queries = 0  # full prompt blocks looked up
        self.prefix_hits = 0     # of which found cached

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def tables(self) -> dict[int, list[int]]:
        """Every device table by seq id (a new dict of the holders' own lists, for readers)."""
        return {sid: table_of(s) for sid, s in self.holders.items()}

    @property
    def slots(self) -> dict[int, int]:
        """Every holder's slot count by seq id (a new dict, for readers)."""
        return {sid: s.num_slots for sid, s in self.holders.items()}

    def block_table(self, seq_id: int) -> list[int]:
        return table_of(self.holders[seq_id])

    def blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def max_blocks_needed(self, group: SequenceGroup) -> int:
        """Upper bound on blocks the group holds at its largest: shared prompt plus each sequence's
        own output blocks (one more each for a copied partial prompt block)."""
        req = group.request
        width = req.sampling.width
        if width == 1:
            return self.blocks_for(req.prompt_len + req.max_output)
        return self.blocks_for(req.prompt_len) + width * (self.blocks_for(req.max_output) + 1)

    def can_allocate(self, group: SequenceGroup, num_new_tokens: int | None = None) -> AllocStatus:
        """Whether the group's waiting sequences can get blocks for their next `num_new_tokens`
        tokens (default: all their tokens), keeping the watermark free."""
        if self.max_blocks_needed(group) > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        needed = sum(self._new_blocks_for_admission(s, num_new_tokens) for s in group.seqs)
        if self.pool.num_free - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def fits_now(self, seq: Sequence, num_new_tokens: int | None = None) -> bool:
        """`can_allocate(...) is AllocStatus.OK` for a waiting group, given its one sequence (waiting
        groups hold one), that the caller knows is not NEVER (it checked the same bound,
        `max_blocks_needed`, already): the scheduler's hot paths ask this of the same waiting head
        again and again."""
        return self.pool.num_free - self._new_blocks_for_admission(seq, num_new_tokens) >= self.watermark_blocks

    def _new_blocks_for_admission(self, seq: Sequence, num_new_tokens: int | None) -> int:
        hits, idle_hits = self._lookup_prefix(seq) if self.enable_prefix_caching else (0, 0)
        computed = hits * self.block_size
        upto = seq.num_tokens if num_new_tokens is None else min(seq.num_tokens, computed + num_new_tokens)
        # idle cached blocks leave the free queue when hit, so they cost a free block too
        return self.blocks_for(upto) - hits + idle_hits

    # ---------------------------------------------------------------- prefix caching
    def _block_hash(self, seq: Sequence, i: int) -> int | None:
        """Chained content hash of the sequence's full logical block i, or None when unknown (the
        block is not full, or its prompt part has no content: no ids and no prefix hashes). Every
        full block is named, output included, as vLLM V1 hashes every full block of a request:
        simulated output tokens by `Sequence.output_origins`, so that only the sequence itself
        (after a recompute) or a fork sharing the position finds them."""
        hashes = seq.block_hashes
        if i < len(hashes):
            return hashes[i]
        bs = self.block_size
        while len(hashes) <= i:
            j = len(hashes)
            end = (j + 1) * bs
            if end > seq.num_tokens:
                return None
            content = _block_content(seq, j * bs, end)
            if content is None:
                return None
            hashes.append(hash((hashes[j - 1] if j else 0, content)))
        return hashes[i]

    def cached_prefix_blocks(self, request: Request) -> int:
        """How many of the request's leading full blocks the prefix cache holds now (0 with prefix
        caching off). A pure query: nothing is taken, touched or counted."""
        if not self.enable_prefix_caching:
            return 0
        probe = SequenceGroup(request, -1).seqs[0]
        return self._lookup_prefix(probe)[0]

    def inject_prefix(self, request: Request) -> int:
        """Hold the KV of the request's prompt as cached idle blocks, as a transfer from another
        replica delivers it (disaggregated prefill): for each full block of the prompt that
        `cached_prefix_blocks` would count, a block already cached is refreshed (most recently
        used), else a free block is taken (evicting the least recently used idle one), named by the
        block's hash and released idle. Stops at the first block it cannot name or place; returns
        how many leading blocks the cache now holds. Prefix caching must be on."""
        if not self.enable_prefix_caching:
            raise ValueError("inject_prefix needs prefix caching (injected blocks are found by hash)")
        probe = SequenceGroup(request, -1).seqs[0]
        held = []
        for i in range((probe.num_tokens - 1) // self.block_size):
            h = self._block_hash(probe, i)
            if h is None:
                break
            bid = self.pool.cached.get(h)
            if bid is not None:
                block = self.pool.blocks[bid]
                self.pool.touch(block)
            elif self.pool.num_free:
                block = self.pool.take()
                self.pool.set_filled(block, self.block_size)
                self.pool.register(block, h)
            else:
                break
            held.append(block)  # held until all are placed, so that none evicts another
        for block in reversed(held):  # as free(): the leading blocks are evicted last
            self.pool.release(block)
        return len(held)

    def prefix_hit_tokens(self, seq: Sequence) -> int:
        """Tokens of a waiting sequence that `allocate` would find cached now (0 with prefix caching
        off). A pure query: nothing is taken, touched or counted."""
        return self._lookup_prefix(seq)[0] * self.block_size if self.enable_prefix_caching else 0

    def _lookup_prefix(self, seq: Sequence) -> tuple[int, int]:
        """(cached full blocks at the start of the sequence, how many of them are idle). The last
        token is always left to compute, so at most (num_tokens - 1) // block_size blocks hit."""
        hits = idle = 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = self._block_hash(seq, i)
            bid = self.pool.cached.get(h) if h is not None else None
            if bid is None:
                break
            hits += 1
            idle += self.pool.blocks[bid].ref_count == 0
        return hits, idle

    def _take_prefix(self, seq: Sequence) -> int:
        hits, _ = self._lookup_prefix(seq)
        table = table_of(seq)
        for i in range(hits):
            block = self.pool.blocks[self.pool.cached[seq.block_hashes[i]]]
            self.pool.touch(block)
            table.append(block.block_id)
        self.prefix_queries += max((seq.num_tokens - 1) // self.block_size, 0)
        self.prefix_hits += hits
        return hits * self.block_size

    # ---------------------------------------------------------------- allocation
    def allocate(self, seq: Sequence) -> int:
        """Start a table for a waiting sequence; with prefix caching, map its longest cached prefix.
        Returns the number of tokens found cached (already computed)."""
        if seq.block_table is not None:
            raise AssertionError(f"sequence {seq.seq_id} already has a block table")
        seq.block_table = []
        self.holders[seq.seq_id] = seq
        cached = self._take_prefix(seq) if self.enable_prefix_caching else 0
        seq.num_slots = cached
        return cached

    def can_append(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks the sequence needs to cover `num_new_tokens` more positions."""
        cur = seq.num_slots
        new_total = seq.num_computed + num_new_tokens
        if new_total <= cur:
            return 0
        table = table_of(seq)
        need = _cdiv(new_total, self.block_size) - len(table)
        if cur % self.block_size and self.pool.blocks[table[-1]].ref_count > 1:
            need += 1
        return need

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Cover positions [0, num_computed + num_new_tokens) with slots. Returns the copy-on-write
        copies (src, dst) to perform first, or None (and changes nothing) if blocks ran out."""
        cur = seq.num_slots
        new_total = seq.num_computed + num_new_tokens
        if new_total <= cur:
            return []
        bs = self.block_size
        table = table_of(seq)
        blocks = self.pool.blocks
        if cur % bs and new_total <= len(table) * bs and blocks[table[-1]].ref_count == 1:
            # the common decode case: the token lands in the sequence's own partly filled block
            self.extend_own_block(seq, new_total, cur, table)
            if self.enable_prefix_caching and new_total % bs == 0:
                self._register_full_blocks(seq, len(table) - 1, len(table))
            return []
        cow = cur % bs != 0 and blocks[table[-1]].ref_count > 1
        need = _cdiv(new_total, bs) - len(table)
        if need + cow > self.pool.num_free:
            return None
        copies: list[tuple[int, int]] = []
        if cow:
            old = blocks[table[-1]]
            new = self.pool.take()
            self.pool.set_filled(new, old.filled)
            copies.append((old.block_id, new.block_id))
            self.pool.release(old)
            table[-1] = new.block_id
        held = len(table)
        if need:
            table.extend(self.pool.take_ids(need, bs))  # taken full: all but the last are
        # blocks first.. now hold positions [first * bs, new_total): all full but the last. They
        # held [first * bs, cur) before (a partly filled own or copied block, then fresh ones),
        # so the token states grow by new_total - cur
        first = cur // bs
        last = len(table) - 1
        for i in range(first, held if held < last else last):  # those held before (the fresh ones are full)
            blocks[table[i]].filled = bs
        blocks[table[last]].filled = new_total - last * bs
        self.pool.used_filled += new_total - cur
        seq.num_slots = new_total
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, first, new_total // bs)
        return copies

    def extend_own_block(self, seq: Sequence, new_total: int, cur: int, table: list[int]) -> None:
        """`append_slots`' common decode case without its checks, for a scheduler's inner loop: the
        caller knows the sequence's last block is partly filled, its own (ref_count 1), and holds
        positions up to `new_total` (and that no full block needs registering for prefix caching).
        `cur` and `table`: the sequence's slots and table (read already)."""
        self.pool.used_filled += new_total - cur
        self.pool.blocks[table[-1]].filled += new_total - cur
        seq.num_slots = new_total

    # ---------------------------------------------- decodes applied in bulk (simulator skip-ahead)
    # A window of certain decode steps is applied at once: the blocks the running sequences open are
    # taken up front, in the order stepping would take them, and the token states counted; each
    # sequence's slots and its blocks' fill levels are owed until `settle_decodes`. In between a
    # table may run ahead of its slots (the class invariant is owed too), and nothing but the bulk
    # methods may touch those sequences.
    def open_decode_blocks(self, seq_ids: Iterable[int]) -> None:
        """Append one fresh block to each sequence's table, in order (the caller has counted them
        against the free blocks)."""
        holders = self.holders
        self.open_blocks([table_of(holders[sid]) for sid in seq_ids])

    def open_blocks(self, tables: list[list[int]]) -> None:
        """`open_decode_blocks` given the tables themselves (the sequences' `block_table`, as a
        running batch holds its members'): no lookup by seq id per block."""
        ids = self.take_opening_ids(len(tables))
        for i in range(len(tables)):  # by index: compiled, no zip tuple per block
            tables[i].append(ids[i])

    def take_opening_ids(self, n: int) -> list[Any]:
        """The ids of `n` blocks taken for decodes that open them (counted against the free blocks
        by the caller), in the order taken: the caller appends each to its opener's table, as
        `open_blocks` does for tables given (RunningBatch.open_within for a window's openers).
        Typed Any so that compiled code moves the pool's int objects as they are (an item read as
        an int is boxed again when stored: an allocation for every id above 256)."""
        return self.pool.take_ids(n)

    def add_token_states(self, n: int) -> None:
        """Count `n` token states decoded into the owed sequences' blocks (settled later)."""
        self.pool.used_filled += n

    def settle_decodes(self, seqs: Iterable[Sequence], k: int) -> None:
        """Sequences whose tables cover `k` decoded tokens beyond `num_computed` (single sequences
        that own their blocks): fill those blocks and move their slots on by k. The caller then
        moves the sequences' own counters."""
        for s in seqs:
            self.settle_decode(s, table_of(s), k)

    def settle_decode(self, seq: Sequence, table: list[int], k: int) -> None:
        """`settle_decodes` for one sequence, given its table (`seq.block_table`)."""
        bs = self.block_size
        blocks = self.pool.blocks
        c = seq.num_computed
        if -c % bs < k:  # blocks were opened: all but the last are full
            last = len(table) - 1
            for i in range(c // bs, last):
                blocks[table[i]].filled = bs
            blocks[table[last]].filled = c + k - last * bs
        else:
            blocks[table[-1]].filled += k
        seq.num_slots = c + k

    def register_decoded(self, seq: Sequence, before: int) -> None:
        """Name (prefix caching) the full blocks a sequence filled in decode steps applied in bulk,
        since it had `before` tokens computed: as append_slots would have, one step at a time."""
        bs = self.block_size
        self._register_full_blocks(seq, before // bs, seq.num_computed // bs)

    def _register_full_blocks(self, seq: Sequence, start: int, stop: int) -> None:
        table = table_of(seq)
        for i in range(start, stop):
            h = self._block_hash(seq, i)
            if h is None:
                return
            self.pool.register(self.pool.blocks[table[i]], h)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (reference counts rise)."""
        table = table_of(parent)
        if child.block_table is not None:
            raise AssertionError(f"sequence {child.seq_id} already has a block table")
        share, blocks = self.pool.share, self.pool.blocks
        for b in table:
            share(blocks[b])
        child.block_table, child.num_slots = list(table), parent.num_slots
        self.holders[child.seq_id] = child
        child.block_hashes = list(parent.block_hashes)  # the blocks before the fork point: shared content
        child.fork_origins(parent)

    def free(self, seq: Sequence) -> None:
        """Drop everything the sequence holds: its device table (blocks whose count reaches zero
        return to the free queue, last block first so that a prompt's leading, most shared blocks
        are evicted last) and, when it is swapped out, its CPU table (an aborted swapped group)."""
        self._free_device(seq)
        cpu_table = self.cpu_tables.get(seq.seq_id) if self.cpu_tables else None  # not pop(sid, None): generic
        if cpu_table is not None:
            del self.cpu_tables[seq.seq_id]
            self.cpu_slots.pop(seq.seq_id, None)
            for c in cpu_table:
                self.cpu.release(c)

    def _free_device(self, seq: Sequence) -> None:
        table = seq.block_table
        if table is not None:
            seq.block_table, seq.num_slots = None, 0
            del self.holders[seq.seq_id]
            self.pool.release_table(table)

    def free_group(self, group: SequenceGroup) -> None:
        for s in group.seqs:
            self.free(s)

    # ---------------------------------------------------------------- swapping
    def _group_gpu_blocks(self, group: SequenceGroup) -> list[int]:
        seen: dict[int, None] = {}
        for s in group.seqs:
            for b in s.block_table or ():
                seen[b] = None
        return list(seen)

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return len(self._group_gpu_blocks(group)) <= self.cpu.num_free

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks to CPU, keeping shared blocks shared. Returns (gpu, cpu) pairs."""
        mapping: dict[int, int] = {}
        for s in group.seqs:
            cpu_table = []
            for b in table_of(s):
                if b not in mapping:
                    mapping[b] = self.cpu.take()
                else:
                    self.cpu.share(mapping[b])
                cpu_table.append(mapping[b])
            self.cpu_tables[s.seq_id] = cpu_table
            self.cpu_slots[s.seq_id] = s.num_slots
            self._free_device(s)
        return list(mapping.items())

    def can_swap_in(self, group: SequenceGroup) -> bool:
        """Whether the group's blocks fit back on the GPU together with the blocks its next step
        needs (its uncomputed tokens: one for a decode, the rest of a prompt after a preemption in
        the middle of a chunked prefill, plus a copy of a shared partial last block), keeping the
        watermark free."""
        bs = self.block_size
        seen: set[int] = set()
        need = 0
        for s in group.seqs:
            table = self.cpu_tables[s.seq_id]
            seen.update(table)
            slots = self.cpu_slots[s.seq_id]
            need += max(self.blocks_for(s.num_tokens) - len(table), 0)
            if s.num_tokens > slots and slots % bs and self.cpu.ref[table[-1]] > 1:
                need += 1
        return self.pool.num_free - len(seen) - need >= self.watermark_blocks

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Bring a swapped group back. Returns (cpu, gpu) pairs."""
        mapping: dict[int, int] = {}
        for s in group.seqs:
            table = []
            for c in self.cpu_tables.pop(s.seq_id):
                if c not in mapping:
                    blk = self.pool.take()
                    mapping[c] = blk.block_id
                else:
                    self.pool.share(self.pool.blocks[mapping[c]])
                table.append(mapping[c])
                self.cpu.release(c)
            n = self.cpu_slots.pop(s.seq_id)
            for i, b in enumerate(table):
                self.pool.set_filled(self.pool.blocks[b], min(self.block_size, n - i * self.block_size))
            s.block_table, s.num_slots = table, n
            self.holders[s.seq_id] = s
        return list(mapping.items())

    # ---------------------------------------------------------------- accounting
    def memory(self) -> MemoryBreakdown:
        bs = self.block_size
        used = self.num_gpu_blocks - self.pool.num_free
        states = self.pool.used_filled
        return MemoryBreakdown(token_states=states, reserved=0, internal_frag=used * bs - states,
                               external_frag=0, free=self.pool.num_free * bs)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_gpu_blocks

    def check_invariants(self, owed: dict[int, int] | None = None) -> None:
        """Raise AssertionError if any block is leaked, double counted or miscounted. `owed`: decode
        steps counted in the pool's token states and tables but not yet in the sequences' slots
        and fill levels (a scheduler's running batch), by seq id."""
        owed = owed or {}
        made = len(self.pool.blocks)
        refs = [0] * made  # blocks never taken have none, and the pool checks they are free
        for sid, s in self.holders.items():
            table = s.block_table
            assert s.seq_id == sid and table is not None, f"seq {sid}: held without a table"
            assert len(table) == _cdiv(s.num_slots + owed.get(sid, 0), self.block_size), \
                f"seq {sid}: table/slots mismatch"
            for b in table:
                assert 0 <= b < made, f"seq {sid}: block {b} in its table was never taken"
                refs[b] += 1
        self.pool.check_invariants(refs)
        filled = sum(b.filled for b in self.pool.blocks if b.ref_count > 0) + sum(owed.values())
        assert filled == self.pool.used_filled, f"token-state count {self.pool.used_filled} != {filled}"
        cpu_refs = [0] * self.cpu.num_blocks
        for t in self.cpu_tables.values():
            for c in t:
                cpu_refs[c] += 1
        assert cpu_refs == self.cpu.ref, "cpu block reference counts mismatch"
        assert self.cpu.num_free == sum(r == 0 for r in cpu_refs), "cpu free list mismatch"

    def assert_empty(self) -> None:
        """At the end of a run: no table left, every block free (cached blocks may remain)."""
        self.check_invariants()
        assert not self.holders and not self.cpu_tables, f"leaked tables: {list(self.holders)[:5]}"
        assert self.pool.num_free == self.num_gpu_blocks, "blocks leaked"

    def used_blocks(self, seqs: Iterable[Sequence]) -> int:
        return len({b for s in seqs for b in s.block_table or ()})
