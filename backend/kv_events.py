"""KV-cache events for cache-aware routers, as vLLM publishes them (`--kv-events-config`): which
blocks the prefix cache gained (BlockStored, with their chained hashes, the hash of the block before
the first, their token ids and the block size), which it evicted (BlockRemoved) and that it was
emptied (AllBlocksCleared).

`KvEventLog` is the block pool's listener (policies.kv_listener; set by `attach`): during an
iteration it only appends (block id, hash) pairs; `seal()` (called once the iteration's tokens are
released) turns them into one `KvEventBatch` with the next sequence number, in the order they
happened, consecutive blocks of one sequence merged into one BlockStored as vLLM does. Each stored
block's parent hash and token ids are read from the block tables at the seal; a block no table
holds any more (its sequence ended in the same iteration) is reported by its hash alone (parent
None, no token ids). The log keeps the last `buffer_batches` batches for replay and the set of
hashes the cache holds, so that a subscriber joining late starts from a snapshot consistent with
the batches that follow it.

Hashes are the block manager's (policies/block_manager.py: Python's hash of (parent hash, the
block's token ids), chained from 0), sent as unsigned 64-bit integers (that value mod 2**64), as
vLLM sends its own 64-bit hashes.

Two ways out, both per replica:
- `kv_events_route`: GET /v1/kv_events, server-sent events, one `data:` JSON object per batch with
  `id:` its sequence number (`?since=N` or the `Last-Event-ID` header replays from there while
  buffered; otherwise the stream opens with a snapshot batch: AllBlocksCleared then one BlockStored
  of every hash held, hashes only). Needs nothing beyond the serve extra.
- `ZmqPublisher`: vLLM's wire format over ZeroMQ (pyzmq and msgpack): a PUB socket sends
  (topic, 8-byte big-endian sequence number, msgpack payload) per batch, the payload vLLM's
  array-like KVEventBatch [ts, [event, ...]] with events ["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium], ["BlockRemoved", block_hashes,
  medium] and ["AllBlocksCleared"]; an optional ROUTER socket replays buffered batches from a
  sequence number a client sends (8 bytes big-endian), ending with sequence -1 and an empty payload.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from backend.http_api import EventStream
from backend.openai_protocol import ApiError

MASK64 = (1 << 64) - 1
MEDIUM = "GPU"
KEEPALIVE_S = 5.0      # an idle stream sends a comment this often, so a client that left is noticed
MAX_BACKLOG = 10_000   # batches a stream may fall behind before it is ended (the client reconnects with since)


@dataclass
class KvEventBatch:
    """One iteration's events. `events`: ("BlockStored", hashes, parent, token_ids),
    ("BlockRemoved", hashes) or ("AllBlocksCleared",), hashes unsigned 64-bit. `ts`: unix seconds
    when it was sealed; `engine_time`: the engine's (emulated) seconds then."""

    seq: int
    ts: float
    engine_time: float
    events: list[tuple]
    block_size: int
    snapshot: bool = False
    _json: str | None = field(default=None, repr=False)

    def to_json(self) -> str:
        if self._json is None:
            self._json = json.dumps({"seq": self.seq, "ts": self.ts, "engine_time": self.engine_time,
                                     "snapshot": self.snapshot, "events": [self._event(e) for e in self.events]})
        return self._json

    def _event(self, e: tuple) -> dict:
        if e[0] == "BlockStored":
            return {"type": "BlockStored", "block_hashes": e[1], "parent_block_hash": e[2], "token_ids": e[3],
                    "block_size": self.block_size, "lora_id": None, "medium": MEDIUM}
        if e[0] == "BlockRemoved":
            return {"type": "BlockRemoved", "block_hashes": e[1], "medium": MEDIUM}
        return {"type": "AllBlocksCleared"}

    def to_vllm(self) -> list:
        """vLLM's array-like KVEventBatch, ready for msgpack (module docstring)."""
        out = []
        for e in self.events:
            if e[0] == "BlockStored":
                out.append(["BlockStored", e[1], e[2], e[3], self.block_size, None, MEDIUM])
            elif e[0] == "BlockRemoved":
                out.append(["BlockRemoved", e[1], MEDIUM])
            else:
                out.append(["AllBlocksCleared"])
        return [self.ts, out]


def apply_events(held: set[int], events: list) -> None:
    """Fold a batch's events into the set of hashes a cache holds, as a router reading the stream
    does: BlockStored adds its hashes, BlockRemoved drops them, AllBlocksCleared empties it."""
    for e in events:
        if e[0] == "BlockStored":
            held.update(e[1])
        elif e[0] == "BlockRemoved":
            held.difference_update(e[1])
        else:
            held.clear()


class KvEventLog:
    """The block pool's listener and the replica's event history; see the module docstring.
    `stored`, `removed`, `cleared` and `seal` run on the engine thread; `subscribe` on any.
    Invariant: `held` is the set of hashes the pool's cache holds as of batch `last_seq`."""

    def __init__(self, block_manager, seqs: dict, buffer_batches: int = 10_000) -> None:
        self.bm, self.seqs = block_manager, seqs
        self.block_size: int = block_manager.block_size
        self._pending: list[tuple[int, int] | None] = []  # (block id, hash); (-1, hash): removed; None: cleared
        self._buffer: deque[KvEventBatch] = deque(maxlen=buffer_batches)
        self.held: set[int] = set()
        self.last_seq = -1
        self._subscribers: list[Callable[[KvEventBatch], None]] = []
        self._lock = threading.Lock()

    def attach(self) -> None:
        """Become the block pool's listener; the stream opens with AllBlocksCleared (batch 0), so
        that a router forgets what an earlier server on this address had cached."""
        self.bm.pool.listener = self
        self.cleared()
        self.seal(0.0)

    # ---------------------------------------------------------------- the pool's listener
    def stored(self, block, content_hash: int) -> None:
        self._pending.append((block.block_id, content_hash))

    def removed(self, content_hash: int) -> None:
        self._pending.append((-1, content_hash))

    def cleared(self) -> None:
        self._pending.append(None)

    # ---------------------------------------------------------------- batches
    def seal(self, engine_time: float) -> KvEventBatch | None:
        """The events since the last seal as the next batch (None when there were none), handed
        to every subscriber."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        events = self._events(pending)
        with self._lock:
            self.last_seq += 1
            batch = KvEventBatch(self.last_seq, time.time(), engine_time, events, self.block_size)
            self._buffer.append(batch)
            apply_events(self.held, events)
            for deliver in self._subscribers:
                deliver(batch)
        return batch

    def _events(self, pending: list[tuple[int, int] | None]) -> list[tuple]:
        owners = self._owners({p[0] for p in pending if p is not None and p[0] >= 0})
        events: list[tuple] = []
        last_owner = None  # (seq id, block index) of the last block of the BlockStored being built
        bs = self.block_size
        for p in pending:
            if p is None:
                events.append(("AllBlocksCleared",))
                last_owner = None
                continue
            block_id, h = p
            h &= MASK64
            if block_id < 0:
                if events and events[-1][0] == "BlockRemoved":
                    events[-1][1].append(h)
                else:
                    events.append(("BlockRemoved", [h]))
                last_owner = None
                continue
            owner = owners.get(block_id)
            if owner is None:  # its sequence is gone: the hash alone
                events.append(("BlockStored", [h], None, []))
                last_owner = None
                continue
            seq_id, i = owner
            seq = self.seqs[seq_id]
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            if last_owner == (seq_id, i - 1):
                events[-1][1].append(h)
                events[-1][3].extend(tokens)
            else:
                parent = seq.block_hashes[i - 1] & MASK64 if i > 0 else None
                events.append(("BlockStored", [h], parent, list(tokens)))
            last_owner = owner
        return events

    def _owners(self, block_ids: set[int]) -> dict[int, tuple[int, int]]:
        """(sequence id, index in its table) of each block, looked for among each table's full
        blocks from its last one down (where an iteration names new blocks)."""
        owners: dict[int, tuple[int, int]] = {}
        if not block_ids:
            return owners
        bs, slots, seqs = self.block_size, self.bm.slots, self.seqs
        for seq_id, table in self.bm.tables.items():
            seq = seqs.get(seq_id)
            if seq is None or seq.token_ids is None:
                continue
            i = min(slots.get(seq_id, 0) // bs, len(table)) - 1
            while i >= 0 and table[i] in block_ids:
                owners[table[i]] = (seq_id, i)
                block_ids.discard(table[i])
                i -= 1
            if not block_ids:
                break
        return owners

    # ---------------------------------------------------------------- subscribers
    def subscribe(self, deliver: Callable[[KvEventBatch], None],
                  since: int | None = None) -> tuple[list[KvEventBatch], Callable[[], None]]:
        """Start handing every new batch to `deliver` (on the engine thread: it must not block).
        Returns what comes before them (the buffered batches from `since` on when all are still
        held, else a snapshot) and the call that stops the delivery."""
        with self._lock:
            buffered = list(self._buffer)
            if since is not None and buffered and buffered[0].seq <= since <= self.last_seq + 1:
                first = [b for b in buffered if b.seq >= since]
            else:
                first = [self._snapshot()]
            self._subscribers.append(deliver)

        def unsubscribe() -> None:
            with self._lock:
                if deliver in self._subscribers:
                    self._subscribers.remove(deliver)

        return first, unsubscribe

    def _snapshot(self) -> KvEventBatch:
        events: list[tuple] = [("AllBlocksCleared",)]
        if self.held:
            events.append(("BlockStored", sorted(self.held), None, []))
        return KvEventBatch(self.last_seq, time.time(), float("nan"), events, self.block_size, snapshot=True)


# ---- GET /v1/kv_events --------------------------------------------------------------------------------
def _since(request: HttpRequest) -> int | None:
    """The first sequence number the client wants: ?since=N, else Last-Event-ID + 1, else None."""
    raw = request.query_params.get("since")
    name = "since"
    if raw is None and "last-event-id" in request.headers:
        raw, name = request.headers["last-event-id"], "Last-Event-ID"
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise ApiError(f"{name} must be a sequence number (an integer >= 0), got {raw!r}", param=name)
    return int(raw) + (1 if name == "Last-Event-ID" else 0)


def kv_events_route(log: KvEventLog, stopped: Callable[[], bool]):
    """The GET /v1/kv_events handler over `log` (module docstring); the stream ends once
    `stopped()` (the engine has stopped, or the server's shutdown deadline passed) and what was
    sealed before has been sent."""

    async def route(request: HttpRequest) -> Response:
        try:
            since = _since(request)
        except ApiError as e:
            return _error(e)
        return EventStream(_stream(log, since, stopped), {"cache-control": "no-cache"})

    return route


async def _stream(log: KvEventLog, since: int | None, stopped: Callable[[], bool]) -> AsyncGenerator[str, None]:
    loop = asyncio.get_running_loop()
    batches: asyncio.Queue[KvEventBatch] = asyncio.Queue()
    first, unsubscribe = log.subscribe(lambda b: loop.call_soon_threadsafe(batches.put_nowait, b), since)
    try:
        for b in first:
            yield _sse(b)
        idle = 0.0
        while True:
            try:
                b = await asyncio.wait_for(batches.get(), timeout=0.25)
            except TimeoutError:
                if stopped() and batches.empty():
                    break
                idle += 0.25
                if idle >= KEEPALIVE_S:
                    idle = 0.0
                    yield ": keep-alive\n\n"
                continue
            idle = 0.0
            yield _sse(b)
            if batches.qsize() > MAX_BACKLOG:
                err = ApiError(f"this stream fell {MAX_BACKLOG} batches behind; reconnect with ?since={b.seq + 1}",
                               status=503, code="too_slow", type="server_error")
                yield f"event: error\ndata: {json.dumps(err.body())}\n\n"
                break
    finally:
        unsubscribe()


def _sse(b: KvEventBatch) -> str:
    return f"id: {b.seq}\ndata: {b.to_json()}\n\n"


# ---- POST /reset_prefix_cache --------------------------------------------------------------------------
def reset_prefix_cache_route(engine, pool, log: KvEventLog, clock, timeout: float = 10.0):
    """vLLM's POST /reset_prefix_cache: on the engine thread, between steps, the pool forgets every
    cached hash (policies.block_manager.BlockPool.clear_cache) and the AllBlocksCleared goes out at
    once; 200, or 409 while blocks are in use (vLLM refuses then too), 503 once the engine has
    stopped."""

    async def route(request: HttpRequest) -> Response:
        if not engine.alive:
            return _error(ApiError("the engine has stopped", status=503, type="server_error"))
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()

        def reset() -> bool:
            cleared = pool.clear_cache()
            log.seal(clock.now())
            return cleared

        def answer(ok: bool) -> None:  # on the loop; nothing when the route gave up waiting
            if not done.done():
                done.set_result(ok)

        engine.call(reset, lambda ok: loop.call_soon_threadsafe(answer, ok))
        try:
            ok = await asyncio.wait_for(done, timeout)
        except TimeoutError:
            return _error(ApiError(f"the engine did not reset its prefix cache within {timeout:g} s", status=503,
                                   type="server_error"))
        if not ok:
            return _error(ApiError("the prefix cache cannot be reset while requests hold KV blocks; retry when idle",
                                   status=409, code="blocks_in_use"))
        return JSONResponse({"reset": True})

    return route


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


# ---- vLLM's ZeroMQ publisher ----------------------------------------------------------------------------
class ZmqPublisher:
    """Publishes a KvEventLog's batches in vLLM's wire format (module docstring) from a thread of its
    own; `endpoint` is bound (tcp://*:PORT or tcp://HOST:PORT), as is `replay_endpoint` when given.
    ValueError naming `flag` when pyzmq or msgpack is missing or an endpoint cannot be bound."""

    def __init__(self, log: KvEventLog, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 flag: str = "--kv-events-zmq", buffer_batches: int = 10_000) -> None:
        try:
            import msgpack
            import zmq
        except ImportError as e:
            raise ValueError(f"{flag}: vLLM's ZeroMQ wire format needs pyzmq and msgpack ({e})") from None
        self._zmq, self._pack = zmq, msgpack.Packer()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self.close()
            which, bad = ("--kv-events-replay", replay_endpoint) if self._replay is not None else (flag, endpoint)
            raise ValueError(f"{which}: cannot bind {bad} ({e})") from None
        self._topic = topic.encode()
        self._queue: queue.SimpleQueue[KvEventBatch | None] = queue.SimpleQueue()
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        first, self._unsubscribe = log.subscribe(self._queue.put, since=0)
        for b in first:
            self._queue.put(b)
        self._thread = threading.Thread(target=self._run, name="pagesim-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._pack.pack(batch.to_vllm())
            seq = batch.seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq, payload))
            self._sent.append((batch.seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request (client id, empty, 8-byte start)
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._sent):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (within `timeout` s), then close the sockets."""
        if hasattr(self, "_thread"):
            self._unsubscribe()
            self._queue.put(None)
            self._thread.join(timeout)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
