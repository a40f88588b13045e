"""`PagedKVCache`: the KV-cache tensors that block ids index.

Storage is one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` on the
device (block-major, so one block across all layers is contiguous: a swap or copy of a block is one
memcpy), plus a CPU swap pool of the same layout (pinned when CUDA is used). Per layer, the key and
value caches are strided views `[num_blocks, block_size, num_kv_heads, head_dim]`.

A slot is `block_id * block_size + offset`; token position p of a sequence with block table `bt`
lives in slot `bt[p // block_size] * block_size + p % block_size`.

Nothing here allocates per step beyond small index tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backend.attention.metadata import once_per_step
from backend.config import ModelConfig

Pairs = Sequence[tuple[int, int]]


class PagedKVCache:
    """Paged K/V storage for all layers plus a CPU swap pool.

    Give exactly one of `num_blocks` or `memory_budget`. `memory_budget` is bytes (int) on any
    device, or on CUDA a fraction (float in (0, 1]) of the currently free device memory.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16,
                 num_blocks: int | None = None, memory_budget: float | None = None,
                 num_cpu_blocks: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        self.block_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.block_bytes = block_bytes(num_layers, num_kv_heads, head_dim, block_size, dtype)
        self.num_blocks = self._resolve_num_blocks(num_blocks, memory_budget)
        self.gpu = self._allocate("num_gpu_blocks", self.num_blocks, self.device)
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu = self._allocate("num_cpu_blocks", num_cpu_blocks, torch.device("cpu"),
                                  pin=self.device.type == "cuda")
        self._keys = [self.gpu[:, layer, 0] for layer in range(num_layers)]
        self._values = [self.gpu[:, layer, 1] for layer in range(num_layers)]

    @classmethod
    def for_model(cls, config: ModelConfig, **kwargs) -> PagedKVCache:
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, **kwargs)

    def _allocate(self, field: str, n: int, device: torch.device, pin: bool = False) -> torch.Tensor:
        """The zeroed blocks; an allocation the device cannot hold is a ValueError naming the field
        and the size asked for, not an allocator traceback."""
        try:
            return torch.zeros((n, *self.block_shape), dtype=self.dtype, device=device, pin_memory=pin)
        except (RuntimeError, MemoryError) as e:
            if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
                raise
            raise ValueError(f"{field}: {n:,} blocks of {self.block_bytes:,} bytes "
                             f"({n * self.block_bytes / 2**30:,.1f} GiB) do not fit in {device.type} memory") from None

    def _resolve_num_blocks(self, num_blocks: int | None, budget: float | None) -> int:
        if (num_blocks is None) == (budget is None):
            raise ValueError("num_blocks: give exactly one of num_blocks and memory_budget")
        if num_blocks is not None:
            if num_blocks <= 0:
                raise ValueError(f"num_blocks: must be positive, got {num_blocks}")
            return num_blocks
        if isinstance(budget, float):
            if self.device.type != "cuda" or not 0 < budget <= 1:
                raise ValueError("memory_budget: a float is a fraction in (0, 1] of free CUDA memory; "
                                 "give bytes (int) on CPU")
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * budget)
        n = int(budget) // self.block_bytes
        if n < 1:
            raise ValueError(f"memory_budget: {budget} bytes is less than one block ({self.block_bytes} bytes)")
        return n

    # ---- views -----------------------------------------------------------------------------------
    def key_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] view of layer `layer`'s keys."""
        return self._keys[layer]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self._values[layer]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    # ---- ops -------------------------------------------------------------------------------------
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              per_step: dict | None = None) -> None:
        """Write k, v [T, num_kv_heads, head_dim] into their slots (slot_mapping [T] int64, -1 = skip).
        `per_step`, a dict kept for one step, lets the layers share the slot arithmetic."""
        if self.device.type == "cuda":
            from backend.attention.triton_kernels import store_kv
            store_kv(k, v, self._keys[layer], self._values[layer], slot_mapping)
            return
        bs = self.block_size
        where = once_per_step(per_step, "slot_split",
                              lambda: (torch.div(slot_mapping, bs, rounding_mode="floor"), slot_mapping % bs))
        self._keys[layer].index_put_(where, k.to(self.dtype))
        self._values[layer].index_put_(where, v.to(self.dtype))

    def copy_blocks(self, pairs: Pairs) -> None:
        """Copy (src, dst) device blocks, all layers, K and V. Destinations must not be sources."""
        if not pairs:
            return
        if self.device.type == "cuda":
            from backend.attention.triton_kernels import copy_blocks
            copy_blocks(self.gpu, pairs)
            return
        for src, dst, n in _runs(pairs):
            self.gpu[dst:dst + n].copy_(self.gpu[src:src + n])

    def swap_out(self, pairs: Pairs) -> None:
        """Copy (device block, cpu block) pairs to the CPU pool (asynchronous on CUDA, stream-ordered)."""
        for g, c, n in _runs(pairs):
            self._check(g, c, n)
            self.cpu[c:c + n].copy_(self.gpu[g:g + n], non_blocking=True)

    def swap_in(self, pairs: Pairs) -> None:
        """Copy (cpu block, device block) pairs back to the device."""
        for c, g, n in _runs(pairs):
            self._check(g, c, n)
            self.gpu[g:g + n].copy_(self.cpu[c:c + n], non_blocking=True)

    def _check(self, g: int, c: int, n: int) -> None:
        if not (0 <= g and g + n <= self.num_blocks and 0 <= c and c + n <= self.num_cpu_blocks):
            raise IndexError(f"swap pair out of range: device {g}+{n}/{self.num_blocks}, "
                             f"cpu {c}+{n}/{self.num_cpu_blocks}")


def block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V of `block_size` tokens in every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def _runs(pairs: Pairs) -> list[tuple[int, int, int]]:
    """Group (a, b) pairs into (a0, b0, n) runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for a, b in pairs:
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            a0, b0, n = runs[-1]
            runs[-1] = (a0, b0, n + 1)
        else:
            runs.append((int(a), int(b), 1))
    return runs
