"""Counts over a batch of groups that a policy reads at every decode step, in one call.

A window or decode step tells the policy the ~30 groups that decoded (`QueuePolicy.on_decoded`);
a per-client policy (fair share, quotas) needs only how many each client had. Counted here, in
the compiled kernel (build_compiled.MODULES), each group's request is read natively; from an
interpreted policy that is one call per step instead of two attribute lookups per group.
"""

from __future__ import annotations

from collections.abc import Iterable

from policies.request import SequenceGroup


def count_by_client(groups: Iterable[SequenceGroup]) -> dict[str, int]:
    """How many of `groups` each client (`request.client`) has; clients in first-seen order. The
    counts sum to the number of groups, and a client with none is absent."""
    counts: dict[str, int] = {}
    # a run of groups from one client (one client's whole batch, the common case) is counted
    # without a dict lookup per group: the dict sees each run once. Runs are told apart by
    # identity, a cheap test; equal strings that are distinct objects only split a run, and the
    # dict adds their counts up.
    run_client = ""
    run = 0
    for g in groups:
        client = g.request.client
        if client is run_client:
            run += 1
            continue
        if run:
            counts[run_client] = counts.get(run_client, 0) + run
        run_client, run = client, 1
    if run:
        counts[run_client] = counts.get(run_client, 0) + run
    return counts
