"""Pure decision logic: requests, block managers, schedulers. No torch, no simpy."""

from policies import _compiled

_compiled.guard()  # before any kernel module is imported: a stale compiled build must not load

from policies.block_manager import AllocStatus, PagedBlockManager
from policies.buddy import BuddyAllocator
from policies.contiguous import ContiguousAllocator
from policies.contiguous_schedulers import OrcaScheduler, StaticScheduler
from policies.memory import MemoryBreakdown
from policies.plan import ScheduledSeq, SeqOutcome, StepComposition, StepPlan, StepResult
from policies.registry import POLICIES, make_scheduler
from policies.request import Request, SamplingParams, SeqStatus, Sequence, SequenceGroup
from policies.scheduler import Scheduler
from policies.vllm_scheduler import VllmScheduler

__all__ = [
    "POLICIES", "AllocStatus", "BuddyAllocator", "ContiguousAllocator", "MemoryBreakdown", "OrcaScheduler",
    "PagedBlockManager", "Request", "SamplingParams", "ScheduledSeq", "Scheduler", "SeqOutcome", "SeqStatus",
    "Sequence", "SequenceGroup", "StaticScheduler", "StepComposition", "StepPlan", "StepResult",
    "VllmScheduler", "make_scheduler",
]
