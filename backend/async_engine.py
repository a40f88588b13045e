"""The live engine behind a server (no HTTP here: that is backend.http_api): `AsyncEngine` steps a
replica (backend.live_executor.build_live_replica) through the step loop of docs/design.md

    plan = scheduler.schedule(now); result = executor.execute(plan); scheduler.on_step_done(...)

in a background thread (torch releases the GIL in its kernels, so an event loop beside it keeps
answering). Callers hand it requests and aborts through a thread-safe inbox, read between steps, so
a request enters the scheduler as soon as the current step ends. After each step every request
that sampled gets one `RequestOutput` with its new tokens, delivered by its own `sink` callback
(called on the engine thread; it must not block: a server passes it on with
`loop.call_soon_threadsafe`). Every request ends with exactly one output whose `finished` is set:
done, rejected by the scheduler, or aborted.

Per-request timestamps and per-iteration rows are recorded as `backend.replay.serve` records them, so
`tables()` gives the same requests / iterations tables as `pagesim live`.

Time comes from a `StepClock`: `WallClock` (the default) measures each iteration on the wall clock;
an emulated engine (`pagesim serve --emulate`, sim.emulated.PacedClock) plans each one from the
executor's priced duration and waits for the wall clock to get there before releasing its tokens.
The replica's executor holds no scheduler and is told about a served request only through its two
hooks (`ServedExecutor`: `register` before the scheduler sees it, `release` once it has ended):
`LiveExecutor` or sim.emulated.EmulatedExecutor, both built through policies.replica_config.build_replica.

Output lag (`output_lag_steps` = n + f, n whole, 0 <= f < 1; vLLM V1 sends a step's outputs while
the next one runs): the outputs of step i go out at end(i + n) + f * duration(i + n + 1), the time
policies.client_latency.lagged_times gives `pagesim simulate`'s client latencies, and at once when
the engine goes idle. Invariant: a step's outputs are never delivered before that lagged time, and
nothing is held once the engine is idle (one exception, for order: a request that ends early, aborted
or rejected, first gets its own held outputs). A step that starts a little after the previous one's
end (a request read in just after it) is not idleness and does not flush: the simulated engine would
have run it back to back. The live engine holds nothing (lag 0).
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import pandas as pd

from policies.plan import StepResult
from policies.request import Request, Sequence, SequenceGroup
from policies.request_rows import request_frame
from policies.scheduler import Scheduler
from policies.step import ReplicaStep, ServedExecutor


@dataclass
class RequestOutput:
    """What one step gave one request. Choice i is the request's i-th sequence (n > 1: the first
    sequence is choice 0, its forks follow in the order they were made)."""

    request_id: int
    new_tokens: dict[int, list[int]]                              # choice -> tokens new in this step
    finish_reasons: dict[int, str] = field(default_factory=dict)  # choice -> "stop" | "length", once
    finished: bool = False                                        # the last output for this request
    error: str | None = None                                      # why it ended without finishing
    aborted: bool = False                                         # error came from an abort, not the scheduler


@dataclass
class EngineRequest:
    """A request and how to tell its caller. `stop`: strings that end a sequence when its text
    contains one (the caller trims the text); `seed`: the request's own sampling seed."""

    request: Request
    sink: Callable[[RequestOutput], None]
    stop: tuple[str, ...] = ()
    seed: int | None = None


class StepClock(Protocol):
    """Engine time, and when iterations start, end and release their tokens."""

    def start(self) -> None: ...          # time 0 is now

    def now(self) -> float: ...           # engine seconds since start

    def begin(self, now: float, newest_arrival: float) -> float: ...  # the next iteration's start

    def end(self, start: float, result: StepResult) -> float: ...     # its end (may set result.duration)

    def idle(self) -> None: ...           # nothing ran at the last begin

    def wait(self, end: float, step: float) -> float: ...  # block until its tokens may go out; the lag

    def until(self, t: float) -> float: ...  # block until engine time t (inside a step); how late


class WallClock:
    """The live loop's clock: engine time is wall time; an iteration lasts what it measured."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def begin(self, now: float, newest_arrival: float) -> float:
        return now

    def end(self, start: float, result: StepResult) -> float:
        end = self.now()
        result.duration = end - start  # measured: the model, scheduling and bookkeeping
        return end

    def idle(self) -> None:
        return

    def wait(self, end: float, step: float) -> float:
        return 0.0

    def until(self, t: float) -> float:
        return 0.0  # a measured step has already ended: what is owed part-way through it goes now


class EngineObserver:
    """Hooks the engine calls on its thread (a metrics exporter overrides them); no-ops here."""

    def on_step(self, scheduler: Scheduler, duration: float, num_preempted: int) -> None:
        return

    def on_first_token(self, group: SequenceGroup, ttft: float) -> None:
        return

    def on_token_gap(self, group: SequenceGroup, gap: float) -> None:
        return

    def on_end(self, group: SequenceGroup, status: str) -> None:
        """status: "stop", "length", "abort" or "rejected"."""
        return


@dataclass
class _Live:
    """The engine's view of one unfinished request."""

    req: EngineRequest
    sent: list[int] = field(default_factory=list)  # tokens delivered, per choice
    last_token_time: float | None = None


class AsyncEngine:
    """Owns a served replica (a scheduler and a ServedExecutor: live or emulated) and steps it in a
    thread; see the module docstring. It tells the executor about a request only through
    `register` / `release`.
    Invariant: every request submitted is, once the engine has stopped, in `scheduler.done`."""

    def __init__(self, replica: ReplicaStep, tokenizer=None, observer: EngineObserver | None = None,
                 debug: bool = False, clock: StepClock | None = None, output_lag_steps: float = 0.0) -> None:
        if not (math.isfinite(output_lag_steps) and output_lag_steps >= 0):
            raise ValueError(f"--output-lag-steps: must be a finite number >= 0, got {output_lag_steps!r}")
        self.replica = replica
        self.scheduler: Scheduler = replica.scheduler
        self.executor: ServedExecutor = replica.executor
        self.tokenizer = tokenizer
        self.timing: StepClock = clock or WallClock()
        self.output_lag_steps = output_lag_steps
        self._lag_whole = int(output_lag_steps)                  # n: whole steps held
        self._lag_frac = output_lag_steps - self._lag_whole      # f: and this fraction of the one after
        self._held: deque[list[tuple[Callable, RequestOutput]]] = deque()  # outputs of the last steps, unsent
        self.observer = observer or EngineObserver()
        self.debug = debug  # check the block pool after every step
        self.log = self.replica.log
        self.error: str | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}
        self._ids = itertools.count()
        self._count_lock = threading.Lock()
        self._outstanding = 0
        self._newest_arrival = 0.0  # of the requests added so far: no iteration starts before it
        self._stopping: bool | None = None  # None: serving; True: drain then stop; False: abort all and stop
        self._thread = threading.Thread(target=self._run, name="pagesim-engine", daemon=True)

    # ---------------------------------------------------------------- caller side (any thread)
    def clock(self) -> float:
        """Engine seconds since the engine started: the time base of every timestamp it records."""
        return self.timing.now()

    def new_request_id(self) -> int:
        return next(self._ids)

    def start(self) -> None:
        self.timing.start()
        self._thread.start()

    def submit(self, req: EngineRequest) -> None:
        with self._count_lock:
            self._outstanding += 1
        self._inbox.put(("add", req))

    def abort(self, request_id: int, reason: str = "aborted: client disconnected") -> None:
        self._inbox.put(("abort", request_id, reason))

    def call(self, fn: Callable[[], object], reply: Callable[[object], None]) -> None:
        """Run `fn` on the engine thread between steps (what must not race the scheduler, e.g. a
        prefix-cache reset), then `reply(its result)` there too (it must not block)."""
        self._inbox.put(("call", fn, reply))

    def shutdown(self, drain: bool = True) -> None:
        """Ask the engine to stop (returns at once): after finishing every request already submitted
        (`drain`), or at its next step boundary, aborting them all."""
        self._inbox.put(("stop", drain))

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """`shutdown(drain)`, then wait for the engine thread to end."""
        self.shutdown(drain)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_outstanding(self) -> int:
        """Requests submitted and not yet ended (queued, running, or still in the inbox)."""
        return self._outstanding

    def refusal(self, request: Request) -> str | None:
        """Why the scheduler could never serve `request` (too long for the context or the KV
        cache, a prompt over the token budget without chunked prefill), or None. Reads only the
        scheduler's configuration, so any thread may call it."""
        return self.scheduler.refusal(request)

    def tables(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(requests, iterations) as `pagesim live` writes them; call after `stop`."""
        return request_frame(self.scheduler.done), self.log.frame()

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                if not self.scheduler.has_unfinished():
                    self._flush()  # idle: nothing follows that a held output would wait for
                self._read_inbox(block=not self.scheduler.has_unfinished())
                if self._stopping is not None and not self.scheduler.has_unfinished():
                    break
                if self.scheduler.has_unfinished():
                    self._step()
        except BaseException:  # the server must learn of it: every waiting caller gets the error
            self.error = traceback.format_exc(limit=4)
            self._fail_all(f"engine error: {self.error.strip().splitlines()[-1]}")

    def _read_inbox(self, block: bool, timeout: float = 0.05) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        self.observer.on_step(self.scheduler, 0.0, 0)  # queues changed: gauges follow at once

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "add":
            self._add(item[1])
        elif kind == "abort":
            self._abort(item[1], item[2])
        elif kind == "call":
            item[2](item[1]())
        elif kind == "stop":
            self._stopping = item[1]
            if not item[1]:
                for rid in list(self._live):
                    self._abort(rid, "aborted: server shutdown")

    def _add(self, req: EngineRequest) -> None:
        r = req.request
        stop = (lambda seq, token: self._hits_stop(req.stop, seq, token)) if req.stop and self.tokenizer else None
        try:  # a seed the executor refuses fails this request alone, not the engine
            self.executor.register(r, req.seed, stop)
        except ValueError as e:
            with self._count_lock:
                self._outstanding -= 1
            req.sink(RequestOutput(r.request_id, {}, finished=True, error=str(e)))
            return
        self._newest_arrival = max(self._newest_arrival, r.arrival)
        live = self._live[r.request_id] = _Live(req, [0] * r.sampling.n)
        group = self.scheduler.add_request(r)
        if group.rejected is not None:  # refused on arrival
            self._end(group, live, error=group.rejected)

    def _abort(self, request_id: int, reason: str) -> None:
        live = self._live.get(request_id)
        group = self.scheduler.abort(request_id, self.clock(), reason)
        if group is None or live is None:
            return
        self._end(group, live, error=reason, aborted=True)
        if self.debug:
            self._check_pool()

    def _step(self) -> None:
        sched = self.scheduler
        now = self.timing.begin(self.clock(), self._newest_arrival)
        step = self.replica.begin(now)  # the loop's one iteration, as the simulator runs it
        plan = step.plan
        for gid, reason in plan.rejected:
            group = next(g for g in reversed(sched.done) if g.group_id == gid)
            self._end(group, self._live[gid], error=reason)
        if step.idle:
            self.timing.idle()
            self._flush()
            if not plan.rejected:  # nothing can run until something arrives or a policy's wait ends
                wait = min(max(sched.wake_time(now) - now, 0.0), 0.05)
                self._read_inbox(block=True, timeout=wait or 0.001)
            return
        sampling = {ss.seq_id: sched.seqs[ss.seq_id].group for ss in plan.seqs if ss.samples}
        end = self.timing.end(now, step.result)  # live: measured wall time; emulated: the priced time
        finished = self.replica.complete(step, end)
        self.observer.on_step(sched, step.result.duration, len(plan.preempted))
        self._release_lagged(now, end)
        done = {g.group_id for g in finished}
        self._held.append([self._publish(group, end, group.group_id in done)
                           for group in {g.group_id: g for g in sampling.values()}.values()])
        while len(self._held) > self._lag_whole + (self._lag_frac > 0):
            self._deliver(self._held.popleft())
        if self.debug:
            self._check_pool()

    def _release_lagged(self, start: float, end: float) -> None:
        """Wait until the step [start, end] has ended on the clock (emulated: the wall clock gets to its
        planned end). With a fractional lag f, the held step that has already waited its n whole steps
        goes out on the way, at start + f * (end - start): the lagged time of the module docstring."""
        if self._lag_frac and len(self._held) > self._lag_whole:
            self.timing.until(start + self._lag_frac * (end - start))
            while len(self._held) > self._lag_whole:
                self._deliver(self._held.popleft())
        self.timing.wait(end, end - start)  # emulated: this step's tokens exist when the wall clock gets there

    def _deliver(self, outputs: list[tuple[Callable, RequestOutput]]) -> None:
        for sink, out in outputs:
            sink(out)

    def _flush(self) -> None:
        while self._held:
            self._deliver(self._held.popleft())

    def _publish(self, group: SequenceGroup, now: float, finished: bool) -> tuple[Callable, RequestOutput]:
        """The step's output for `group` (its new tokens, finish reasons) and the sink it goes to."""
        live = self._live[group.group_id]
        choices = sorted(group.seqs + group.finished_seqs, key=lambda s: s.seq_id)
        if len(live.sent) < len(choices):
            live.sent += [0] * (len(choices) - len(live.sent))
        out = RequestOutput(group.group_id, {})
        p = group.request.prompt_len
        for i, s in enumerate(choices):
            # after a restart preemption (a forked group recomputed from its prompt) the tokens
            # already sent are not sent again
            new = s.token_ids[p + live.sent[i]:]
            if new:
                out.new_tokens[i] = new
                live.sent[i] += len(new)
        if out.new_tokens:
            if live.last_token_time is None:
                self.observer.on_first_token(group, now - group.arrival)
            else:
                self.observer.on_token_gap(group, now - live.last_token_time)
            live.last_token_time = now
        finished_ids = {s.seq_id for s in group.finished_seqs}
        for i, s in enumerate(choices):
            if s.seq_id in finished_ids:
                # "length": it reached max_tokens (an emulated request may stop before, at its drawn length)
                out.finish_reasons[i] = "length" if s.output_len >= group.request.sampling.max_tokens else "stop"
        if finished:
            out.finished = True
            self._forget(group)
            self.observer.on_end(group, "length" if set(out.finish_reasons.values()) == {"length"} else "stop")
        return live.req.sink, out

    def _deliver_own(self, group_id: int) -> None:
        """Deliver now the held outputs of one request (it is ending early), the others keep their lag."""
        for batch in self._held:
            mine = [item for item in batch if item[1].request_id == group_id]
            if mine:
                self._deliver(mine)
                batch[:] = [item for item in batch if item[1].request_id != group_id]

    def _end(self, group: SequenceGroup, live: _Live, error: str, aborted: bool = False) -> None:
        self._deliver_own(group.group_id)  # what it was sent before goes first
        self._forget(group)
        self.observer.on_end(group, "abort" if aborted else "rejected")
        live.req.sink(RequestOutput(group.group_id, {}, finished=True, error=error, aborted=aborted))

    def _forget(self, group: SequenceGroup) -> None:
        """Drop what a finished request no longer needs, so that a long-running server's memory
        grows only by its table rows (token lists go; counts and timestamps stay)."""
        gid = group.group_id
        if self._live.pop(gid, None) is not None:
            with self._count_lock:
                self._outstanding -= 1
        self.executor.release(gid)
        for s in group.seqs + group.finished_seqs:
            s.token_ids = None
        group.request.prompt_token_ids = None

    def _fail_all(self, message: str) -> None:
        self._flush()
        for live in list(self._live.values()):
            live.req.sink(RequestOutput(live.req.request.request_id, {}, finished=True, error=message))
        self._live.clear()
        while True:  # and those still in the inbox
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                item[1].sink(RequestOutput(item[1].request.request_id, {}, finished=True, error=message))

    def _check_pool(self) -> None:
        self.scheduler.check_invariants()
        if not self.scheduler.has_unfinished():
            self.scheduler.assert_drained()

    # ---------------------------------------------------------------- stop strings
    def _hits_stop(self, stop: tuple[str, ...], seq: Sequence, token: int) -> bool:
        """Whether `token` completes one of the request's stop strings in its sequence's text."""
        longest = max(len(s) for s in stop)
        # every token is at least one byte and a character at most four, so the text of the last
        # 4 * longest + 1 tokens holds any stop string that ends in this token
        tail = seq.token_ids[max(seq.prompt_len, len(seq.token_ids) - 4 * longest):] + [token]
        text = self.tokenizer.decode(tail)
        return any(s in text for s in stop)

