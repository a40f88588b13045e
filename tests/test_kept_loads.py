"""Counts kept as the batch changes: each replica's outstanding count (Scheduler.loads, shared
among a router's views) and VTC's service counters told a batch's decodes at once (on_decoded)."""

from __future__ import annotations

import random

import pytest

from policies.queue_policy import QueuePolicy, VtcPolicy
from policies.registry import make_scheduler
from policies.request import Request, SamplingParams, SequenceGroup
from policies.router import LeastLoadedRouter, ReplicaViews, replica_views


def _req(i: int, prompt: int = 8, out: int = 4, client: str = "", **kw: object) -> Request:
    return Request(i, 0.0, prompt, SamplingParams(max_tokens=out, ignore_eos=True), out, client=client, **kw)


class _Counted:
    """A replica view with nothing but its count (what a plug-in router may be handed in a test)."""

    def __init__(self, n: int) -> None:
        self.outstanding = n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_least_loaded_reads_the_kept_list_as_it_reads_each_count(seed: int) -> None:
    """The same picks, ties included (from the one after the last pick, wrapping round), from the
    kept list as from each view's own count."""
    rng = random.Random(seed)
    by_list, by_view = LeastLoadedRouter(), LeastLoadedRouter()
    for _ in range(500):
        loads = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
        views = [_Counted(n) for n in loads]
        a = by_list.route(_req(0), ReplicaViews(views, loads))
        b = by_view.route(_req(0), views)
        assert a == b
        assert loads[a] == min(loads)


def test_the_kept_count_follows_arrivals_rejections_finishes_and_departing() -> None:
    scheds = [make_scheduler("vllm", 64), make_scheduler("vllm", 64)]
    scheds[0].add_request(_req(0))  # before the views: share_load starts from the exact count
    views = replica_views(LeastLoadedRouter(), scheds)
    assert isinstance(views, ReplicaViews) and views.loads == [1, 0]
    scheds[1].add_request(_req(1))
    scheds[1].add_request(_req(2, reject_reason="failed in the trace"))  # refused on arrival: never outstanding
    assert views.loads == [1, 1] == [v.outstanding for v in views] == [s.outstanding for s in scheds]
    scheds[0].departing = 2  # a window finished two ahead of the caller's clock
    assert views.loads[0] == 3 == scheds[0].outstanding
    scheds[0].departing = 0
    scheds[0].abort(0, 0.0)
    assert views.loads == [0, 1] == [s.outstanding for s in scheds]
    for s in scheds:
        s.check_conservation()  # asserts the kept count against the queues


def test_vtc_takes_a_batch_of_decodes_as_one_on_served_per_group() -> None:
    groups = [SequenceGroup(_req(i, client="abc"[i % 3]), i) for i in range(10)]
    at_once, one_by_one = VtcPolicy(), VtcPolicy()
    for g in groups:
        at_once.on_admitted(g, 0.0)
        one_by_one.on_admitted(g, 0.0)
    at_once.on_decoded(groups[:7], 5)
    for g in groups[:7]:
        one_by_one.on_served(g, 0, 5)
    assert at_once.tokens == one_by_one.tokens and at_once.tokens["a"][1] == 3 * 5


def test_a_subclass_own_on_served_sees_every_group() -> None:
    seen: list[tuple[int, int]] = []

    class Logged(VtcPolicy):
        name = "logged-vtc"

        def on_served(self, group: SequenceGroup, prefill_tokens: int, decode_tokens: int) -> None:
            seen.append((group.group_id, decode_tokens))
            super().on_served(group, prefill_tokens, decode_tokens)

    class OnlyDecoded(QueuePolicy):
        name = "only-decoded"

        def on_decoded(self, groups: list[SequenceGroup], decode_tokens: int) -> None:
            seen.append((-1, decode_tokens))

    groups = [SequenceGroup(_req(i), i) for i in range(3)]
    Logged().on_decoded(groups, 2)
    assert seen == [(0, 2), (1, 2), (2, 2)]
    assert OnlyDecoded.tracks_service and not QueuePolicy.tracks_service  # the scheduler calls it
