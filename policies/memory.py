"""KV-cache memory accounting in the categories of the vLLM paper's Figure 2."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryBreakdown:
    """Token slots of the KV cache by use. The five categories add up to `total`.

    - token_states: slots holding a computed (or being computed) token's keys and values
    - reserved: slots set aside for tokens a request will generate later (contiguous baselines)
    - internal_frag: slots inside allocated units that will never hold a token (over-reservation,
      the unused tail of a paged sequence's last block)
    - external_frag: free slots that no allocation can use (stranded between allocated chunks)
    - free: slots available for new allocations
    """

    token_states: int
    reserved: int
    internal_frag: int
    external_frag: int
    free: int

    def __init__(self, token_states: int, reserved: int, internal_frag: int, external_frag: int, free: int) -> None:
        # written out, not generated: the compiled kernel builds one per iteration (see policies/plan.py)
        # object.__setattr__ written out at each field (frozen): the compiled kernel makes each a direct
        # store (mypyc specialises the literal call; through a local alias it is a generic call)
        object.__setattr__(self, "token_states", token_states)
        object.__setattr__(self, "reserved", reserved)
        object.__setattr__(self, "internal_frag", internal_frag)
        object.__setattr__(self, "external_frag", external_frag)
        object.__setattr__(self, "free", free)

    @property
    def total(self) -> int:
        return self.token_states + self.reserved + self.internal_frag + self.external_frag + self.free

    @property
    def used(self) -> int:
        return self.total - self.free

    def fractions(self) -> dict[str, float]:
        t = max(self.total, 1)
        return {k: getattr(self, k) / t for k in
                ("token_states", "reserved", "internal_frag", "external_frag", "free")}

    def usage_of_allocated(self) -> float:
        """Share of allocated (non-free) slots that hold token states: the paper's utilization."""
        used = self.token_states + self.reserved + self.internal_frag + self.external_frag
        return self.token_states / used if used else 1.0
