"""`AttentionMetadata`: what the attention kernels need to know about one flat batch.

Layout of the flat batch of T tokens: the prefill chunks come first (tokens
[0, num_prefill_tokens)), then the decodes, one token each. A prefill chunk of sequence i has
`start_i` tokens already cached and computes `n_i` new ones at positions [start_i, start_i + n_i);
a decode computes one token at position `context_len - 1`. The K/V of every token in the batch is
stored into the cache (via `slot_mapping`) before attention runs, so attention reads all keys of a
sequence, new ones included, through its block table.

Host-side lists serve the torch path (loops, chunking); device tensors serve the Triton kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [T] int64, cache slot of each token
    sample_rows: torch.Tensor             # [N] int64, rows of the batch whose logits are wanted
    block_size: int
    # prefill chunks (P sequences, tokens [0, num_prefill_tokens))
    num_prefills: int
    num_prefill_tokens: int
    prefill_query_start: list[int]        # P + 1 cumulative query offsets
    prefill_starts: list[int]             # P cached-prefix lengths
    prefill_cu_q: torch.Tensor            # [P + 1] int32 on device
    prefill_starts_t: torch.Tensor        # [P] int32 on device
    prefill_block_tables: torch.Tensor    # [P, max_blocks] int32 on device, padded with 0
    max_prefill_len: int
    # decodes (D sequences, tokens [num_prefill_tokens, T))
    num_decodes: int
    decode_context_lens: list[int]        # D context lengths, new token included
    decode_context_lens_t: torch.Tensor   # [D] int32 on device
    decode_block_tables: torch.Tensor     # [D, max_blocks] int32 on device, padded with 0
    max_decode_context: int
    # per-step work that every layer would otherwise redo (the torch path's slot split and decode
    # chunk plan), filled on first use; the batch is the same for all layers of a step
    per_step: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def once_per_step(per_step: dict[str, Any] | None, key: str, make: Callable[[], T]) -> T:
    """`make()`, computed once per step when the step's `AttentionMetadata.per_step` dict is given
    (the first layer computes it, the others reuse it), else every call."""
    if per_step is None:
        return make()
    if key not in per_step:
        per_step[key] = make()
    return per_step[key]
