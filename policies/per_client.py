"""What a per-client policy (fair share, quotas; VtcPolicy) reads at every step, compiled.

A window or decode step tells the policy the ~30 groups that decoded (`QueuePolicy.on_decoded`),
and the scheduler reads the waiting queue's head at every admission. Kept here, in the compiled
kernel (build_compiled.MODULES), each group's request is read natively; an interpreted policy
makes one call per step (`count_by_client`), or keeps its counters here (`ClientTokens`, VtcPolicy's),
and its queue (`ClientQueues`) runs compiled. ClientQueues stays subclassable from interpreted code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator

from mypy_extensions import mypyc_attr

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
    batch: list[SequenceGroup] = groups if isinstance(groups, list) else list(groups)  # a list: walked natively
    for g in batch:
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


class ClientTokens:
    """Tokens served to each client, counted as integers (`tokens`: client -> [input, output]), and
    each client's counter computed from them: w_in * input + w_out * output + its `lift` (what it
    was raised by when it came back active). VtcPolicy's, kept compiled: the scheduler tells the
    service at every step and window, and the queue reads counters at every admission."""

    def __init__(self, w_in: float, w_out: float) -> None:
        self.w_in = w_in
        self.w_out = w_out
        self.tokens: dict[str, list[int]] = {}
        self.lift: dict[str, float] = {}

    def counter(self, client: str) -> float:
        t = self.tokens.get(client)
        served = self.w_in * t[0] + self.w_out * t[1] if t is not None else 0.0
        return self.lift.get(client, 0.0) + served

    def _of(self, client: str) -> list[int]:
        t = self.tokens.get(client)
        if t is None:
            t = self.tokens[client] = [0, 0]
        return t

    def admitted(self, group: SequenceGroup, now: float) -> None:
        """The group's prompt tokens are charged to its client."""
        self._of(group.request.client)[0] += group.request.prompt_len

    def served(self, group: SequenceGroup, prefill_tokens: int, decode_tokens: int) -> None:
        """The tokens the group generated are charged to its client (its prompt was, on admission)."""
        self._of(group.request.client)[1] += decode_tokens

    def decoded(self, groups: Iterable[SequenceGroup], decode_tokens: int) -> None:
        """`served(g, 0, decode_tokens)` for each of `groups`, counted by client first (integer sums:
        the same counts in any order)."""
        for client, n in count_by_client(groups).items():
            self._of(client)[1] += n * decode_tokens


@mypyc_attr(allow_interpreted_subclasses=True)  # a policy may give its own (QueuePolicy.new_queue)
class ClientQueues:
    """A waiting queue of one FIFO per client; `[0]` is the head of the client whose counter is
    smallest now (ties: the older head, then the smaller group id), found in O(clients).
    `counter(client)` is a client's counter now, read only to compare clients: while one client
    has groups waiting it is not called."""

    def __init__(self, counter: Callable[[str], float]) -> None:
        self.counter = counter
        self.queues: dict[str, deque[SequenceGroup]] = {}  # clients in first-queued order, kept when empty
        self.size = 0

    def push(self, group: SequenceGroup, front: bool = False) -> None:
        client = group.request.client
        q = self.queues.get(client)
        if q is None:
            q = self.queues[client] = deque()
        if front:
            q.appendleft(group)
        else:
            q.append(group)
        self.size += 1

    def _best(self) -> deque[SequenceGroup]:
        """The queue whose (counter, head's arrival, head's group id) is smallest; the first of
        equals in client order (group ids are unique: no two keys are equal)."""
        first: deque[SequenceGroup] | None = None
        for q in self.queues.values():
            if q:
                if first is not None:
                    break  # a second client waits
                first = q
        else:
            if first is None:
                raise IndexError("the waiting queue is empty")
            return first  # one client waits: its head, counters not read
        best: deque[SequenceGroup] | None = None
        best_counter = best_arrival = 0.0
        best_id = 0
        for client, q in self.queues.items():
            if not q:
                continue
            head = q[0]
            counter, arrival, gid = self.counter(client), head.request.arrival, head.group_id
            # the tuples' order, field by field (no NaN: counters and arrivals are finite)
            if best is None or counter < best_counter or (counter == best_counter and (
                    arrival < best_arrival or (arrival == best_arrival and gid < best_id))):
                best, best_counter, best_arrival, best_id = q, counter, arrival, gid
        if best is None:
            raise IndexError("the waiting queue is empty")
        return best

    def __getitem__(self, i: int) -> SequenceGroup:
        if i != 0:
            raise IndexError("ClientQueues gives only its head, [0]")
        return self._best()[0]

    def popleft(self) -> SequenceGroup:
        group = self._best().popleft()
        self.size -= 1
        return group

    def remove(self, group: SequenceGroup) -> None:
        """Take `group` out (Scheduler.abort of a waiting request)."""
        q = self.queues.get(group.request.client)
        if q is None or group not in q:
            raise ValueError(f"group {group.group_id} is not waiting")
        q.remove(group)
        self.size -= 1

    def candidates(self) -> list[SequenceGroup]:
        """The groups that could come first while counters change: each client's head."""
        return [q[0] for q in self.queues.values() if q]

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[SequenceGroup]:
        for q in self.queues.values():
            yield from q
