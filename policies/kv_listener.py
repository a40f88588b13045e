"""What a KV-cache event stream (vLLM's KV events, for cache-aware routers) needs from the block
pool: `BlockPool.listener`, when set, is told of every content hash the prefix cache gains, every
hash it evicts and a clear, in the order they happen, on the thread that runs the scheduler.

With no listener set the pool pays one `is not None` test on its hash-registering and evicting
paths, none on the decode hot loop; a listener must not call back into the pool.
"""

from __future__ import annotations

from typing import Protocol


class KvCacheListener(Protocol):
    def stored(self, block, content_hash: int) -> None: ...  # a full block was named (block: its Block)

    def removed(self, content_hash: int) -> None: ...  # an idle cached block was taken: its hash is gone

    def cleared(self) -> None: ...  # every hash is gone (BlockPool.clear_cache)
