"""Memory the bookkeeping of blocks, requests and replicas needs, estimated before it is allocated.

A cache of a billion blocks or a workload of a hundred billion requests does not fit in any
machine's memory; without an estimate up front the run ends in a MemoryError traceback (or the
kernel's OOM killer) after the allocation has been tried. `check_fits` refuses such a size with a
one-line ValueError giving the estimate and the memory available.

The per-item sizes are lower bounds measured with tracemalloc on CPython 3.11 (64-bit):
`PagedBlockManager(200_000, 16, 0)` holds 241 B per GPU block (its Block object, list slot and
free-queue entry), `PagedBlockManager(1, 16, 200_000)` 48 B per CPU swap block, and a simulated
request peaked at 1.47-1.84 KB (Request, SequenceGroup, Sequence, its rows in the result tables)
in runs of 20,000-50,000 requests that logged few iterations. Every logged iteration adds more, so
a run refused here could never have fitted, while one let through may still run short.
"""

from __future__ import annotations

import os

GPU_BLOCK_BYTES = 240
CPU_BLOCK_BYTES = 48
REQUEST_BYTES = 1_400
# one replica's scheduler, executor and SimPy process besides its blocks: `simulate --replicas 2000`
# (OPT-13B, A100-40GB, 951 blocks each) peaked 1.62 GiB above one replica, ~850 KB a replica of
# which ~230 KB are blocks; 512 KiB keeps the estimate a lower bound
REPLICA_BYTES = 512 * 2**10

_NOT_WORTH_CHECKING = 256 * 2**20  # below this much, skip reading the system's memory figures


def available_memory() -> int | None:
    """Bytes the system can still give this process: MemAvailable from /proc/meminfo (Linux), else
    the physical memory size (sysconf), else None (unknown: nothing is refused)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _size(nbytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,.0f} B"


def check_fits(what: str, items: list[tuple[int, int]], available: int | None = None) -> int:
    """Refuse (ValueError naming `what`) a size whose bookkeeping cannot fit in memory; return the
    estimate in bytes. `items` are (count, bytes each) pairs; `available` defaults to
    `available_memory()`, read only when the estimate is large enough to matter."""
    need = sum(count * each for count, each in items)
    if need < _NOT_WORTH_CHECKING and available is None:
        return need
    have = available_memory() if available is None else available
    if have is not None and need > have:
        raise ValueError(f"{what}: the simulator's bookkeeping alone would need at least {_size(need)} of memory, "
                         f"but {_size(have)} is available")
    return need
