"""vLLM's internal load balancing over data-parallel ranks (`--data-parallel-size N`, one API server).

vLLM's front end (`DPLBAsyncMPClient.get_core_engine_for_request`, vllm/v1/engine/core_client.py)
sends each new request to the engine core with the lowest `waiting * 4 + running`, scanning from its
own start index (0 with one API server), so ties go to the lowest rank. It reads counts the DP
coordinator publishes every 100 ms and adds each request it sends to its local copy of that rank's
waiting count until the next update; the simulated router reads the ranks' queues as they are at the
arrival, which is what that local bookkeeping approximates. A preempted or swapped-out request
waits to resume, so it counts as waiting.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.request import Request
from policies.router import Router
from policies.scheduler import Scheduler

# vLLM weighs a waiting request four times a running one: a queue delays TTFT, a batch only TPOT
WAITING_WEIGHT = 4


class VllmDPRouter(Router):
    """The rank with the lowest WAITING_WEIGHT * waiting + running; ties to the lowest index."""

    name = "vllm-dp"

    def route(self, request: Request, replicas: Sequence[Scheduler]) -> int:
        best, least = 0, -1
        for i, r in enumerate(replicas):
            score = WAITING_WEIGHT * (len(r.waiting) + len(r.swapped)) + len(r.running)
            if score < least or least < 0:
                best, least = i, score
        return best
