"""`ModelRunner`: one model, its paged KV cache, and `execute(batch) -> logits`.

A `Batch` is what a live executor derives from a `StepPlan`: per scheduled sequence the token ids
to feed, the number of tokens already cached (`start`), its block table and whether it samples;
plus block swaps and copies. `execute` runs swap_out, swap_in, copies, then one forward pass over
all sequences' tokens flattened together, and returns float32 logits for the sampling sequences
(one row each, in batch order).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from backend.attention import AttentionMetadata, get_attention
from backend.config import ModelConfig
from backend.kv_cache import PagedKVCache
from backend.models import build_model
from backend.models.layers import ForwardContext, prepack_linears


class SeqInput(NamedTuple):
    """One sequence's work: feed `token_ids` at positions [start, start + len(token_ids))."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    samples: bool = True


@dataclass
class Batch:
    seqs: list[SeqInput]
    copies: list[tuple[int, int]] = field(default_factory=list)     # (src device block, dst device block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu block, device block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, cpu block)


def default_dtype(device: str | torch.device) -> torch.dtype:
    """float32 on CPU, bfloat16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class ModelRunner:
    """Runs `config`'s model with `weights` (HF names) over a paged KV cache.

    `num_gpu_blocks` is the device cache size in blocks; None sizes it from `memory_budget`
    (bytes, or on CUDA a fraction of free memory after the weights are loaded).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, num_gpu_blocks: int | None = 256, num_cpu_blocks: int = 0,
                 block_size: int = 16, attention: str | None = None,
                 memory_budget: float | None = None, prepack: bool | None = None) -> None:
        self.config, self.device = config, torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():  # else torch's AssertionError, mid-load
            raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) sees no CUDA device; "
                             "use --device cpu")
        self.dtype = dtype or default_dtype(self.device)
        self.block_size = block_size
        self.model = self._load(config, weights)
        if prepack is None:  # oneDNN-prepacked linears on CPU float32 (see prepack_linears)
            cpu32 = self.device.type == "cpu" and self.dtype == torch.float32
            if cpu32 and torch.backends.mkldnn.is_available():
                try:
                    prepack_linears(self.model)
                except (ImportError, AttributeError, RuntimeError) as exc:  # a torch without it: stay dense
                    warnings.warn(f"prepacked linears unavailable ({exc}); using dense ones", stacklevel=2)
        elif prepack:
            prepack_linears(self.model)
        if num_gpu_blocks is None and memory_budget is None:
            memory_budget = 0.9 if self.device.type == "cuda" else 1 << 30
        self.kv_cache = PagedKVCache.for_model(
            config, block_size=block_size, num_blocks=num_gpu_blocks, memory_budget=memory_budget,
            num_cpu_blocks=num_cpu_blocks, dtype=self.dtype, device=self.device)
        self.attention = get_attention(self.device, attention)

    def with_cache(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> ModelRunner:
        """The same model (shared, not copied) over a new KV cache of `block_size`-token blocks."""
        other = copy.copy(self)
        other.block_size = block_size
        other.kv_cache = PagedKVCache.for_model(self.config, block_size=block_size, num_blocks=num_gpu_blocks,
                                                num_cpu_blocks=num_cpu_blocks, dtype=self.dtype, device=self.device)
        return other

    def warm_up(self) -> None:
        """One decode step of two one-token sequences in block 0, so that one-time costs (compiling
        the decode attention, first-touch allocations) are paid before a clock starts. Call it
        before serving: it overwrites block 0."""
        self.execute(Batch([SeqInput([0], 0, [0], True), SeqInput([0], 0, [0], True)]))

    def _load(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        """Build on the meta device, allocate once in the target dtype, then copy the weights in."""
        with torch.device("meta"):
            model = build_model(config).to(self.dtype)
        model = model.to_empty(device=self.device)
        for m in model.modules():
            if hasattr(m, "reset_buffers"):
                m.reset_buffers()
        model.load_weights(weights)
        return model.eval()

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        """Swaps and copies, then the forward pass. Returns [num sampling seqs, vocab] float32."""
        self.kv_cache.swap_out(batch.swap_out)
        self.kv_cache.swap_in(batch.swap_in)
        self.kv_cache.copy_blocks(batch.copies)
        if not batch.seqs:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        input_ids, positions, meta = self.prepare(batch.seqs)
        ctx = ForwardContext(meta=meta, kv_cache=self.kv_cache, attention=self.attention)
        return self.model(input_ids, positions, ctx).float()

    def prepare(self, seqs: list[SeqInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten `seqs` (prefill chunks first, then single-token decodes) into model inputs."""
        bs = self.block_size
        prefills = [i for i, s in enumerate(seqs) if len(s.token_ids) > 1]
        decodes = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        if len(prefills) + len(decodes) != len(seqs):
            raise ValueError("every sequence in a batch must feed at least one token")
        ids, pos, slots, last_row = [], [], [], {}
        row = 0
        for i in prefills + decodes:
            s = seqs[i]
            p = np.arange(s.start, s.start + len(s.token_ids))
            self._check(s, int(p[-1]) + 1)
            bt = np.asarray(s.block_table, dtype=np.int64)
            slots.append(bt[p // bs] * bs + p % bs)
            ids.append(np.asarray(s.token_ids, dtype=np.int64))
            pos.append(p)
            row += len(p)
            last_row[i] = row - 1
        sample_rows = [last_row[i] for i, s in enumerate(seqs) if s.samples]
        dev = self.device
        t = lambda a, dt=torch.int64: torch.from_numpy(np.ascontiguousarray(a)).to(dev, dt)
        pf = [seqs[i] for i in prefills]
        dc = [seqs[i] for i in decodes]
        qstart = np.cumsum([0] + [len(s.token_ids) for s in pf]).tolist()
        dec_lens = [s.start + 1 for s in dc]
        meta = AttentionMetadata(
            slot_mapping=t(np.concatenate(slots)), sample_rows=t(np.asarray(sample_rows, dtype=np.int64)),
            block_size=bs, num_prefills=len(pf), num_prefill_tokens=qstart[-1], prefill_query_start=qstart,
            prefill_starts=[s.start for s in pf], prefill_cu_q=t(np.asarray(qstart), torch.int32),
            prefill_starts_t=t(np.asarray([s.start for s in pf]), torch.int32),
            prefill_block_tables=t(_pad_tables(pf, bs), torch.int32),
            max_prefill_len=max((len(s.token_ids) for s in pf), default=0),
            num_decodes=len(dc), decode_context_lens=dec_lens,
            decode_context_lens_t=t(np.asarray(dec_lens), torch.int32),
            decode_block_tables=t(_pad_tables(dc, bs), torch.int32),
            max_decode_context=max(dec_lens, default=0),
        )
        return t(np.concatenate(ids)), t(np.concatenate(pos)), meta

    def _check(self, s: SeqInput, end: int) -> None:
        if s.start < 0:
            raise ValueError(f"start: must be >= 0, got {s.start}")
        if end > self.config.max_position:
            raise ValueError(f"sequence of {end} tokens exceeds max_position {self.config.max_position}")
        if len(s.block_table) * self.block_size < end:
            raise ValueError(f"block_table: {len(s.block_table)} blocks of {self.block_size} cannot hold "
                             f"{end} tokens")


def _pad_tables(seqs: list[SeqInput], block_size: int) -> np.ndarray:
    """[S, max_blocks] block tables (only the blocks covering each sequence's tokens), zero padded."""
    need = [-(-(s.start + len(s.token_ids)) // block_size) for s in seqs]
    out = np.zeros((len(seqs), max(need, default=0) or 1), dtype=np.int64)
    for r, (s, n) in enumerate(zip(seqs, need)):
        out[r, :n] = s.block_table[:n]
    return out
