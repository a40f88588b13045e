"""uvicorn under stuck and hostile clients: what runs an `OpenAIServer` (any front end: the live
engine or an emulated one; only the HTTP API and the engine's shutdown are used here).

- `GuardedHttpProtocol`: uvicorn's HTTP/1.1 protocol (httptools) with a header read timeout (a
  request's head, its request line and headers, must arrive whole within `header_timeout` seconds
  of the connection opening or of the request's first byte; else 408 and the connection closes;
  idle kept-alive connections are uvicorn's `timeout_keep_alive`), and sends that fail on a lost
  connection: a send after the connection is gone marks that request disconnected and raises
  ConnectionResetError, whichever request the protocol thinks is current (a pipelined request's
  disconnect used to go unseen while the engine generated every token for nobody). Body read
  timeouts are the app's (`ServeOptions.body_timeout`).
- `BoundedServer`: a shutdown that always ends. The first SIGTERM / SIGINT stops taking calls and
  drains (or aborts) what is in flight; `shutdown_timeout` seconds later whatever still runs is
  cut off: the engine aborts its requests (streams end with finish_reason "abort" and [DONE]),
  body reads still waiting get 503, and `grace` seconds after that every connection is closed. A
  second signal does all of that at once. `run()` returns in every case, so the caller writes its
  tables; it should do so in a `finally`, as `pagesim serve` does, in case the HTTP layer fails.
- `serve_together`: several BoundedServers on one event loop (`pagesim serve --emulate --replicas N`;
  one server is the case N = 1): a signal reaches every one, so each drains and is cut off as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from backend.async_engine import AsyncEngine
from backend.http_api import RECEIVED, OpenAIServer
from backend.openai_protocol import ApiError

log = logging.getLogger("uvicorn.error")


class GuardedHttpProtocol(HttpToolsProtocol):
    """See the module docstring. `on_header_timeout(peer)` is called once per timed-out head."""

    def __init__(self, config, server_state, app_state, _loop=None, *, header_timeout: float | None = 10.0,
                 on_header_timeout: Callable[[str], None] = lambda peer: None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout, self.on_header_timeout = header_timeout, on_header_timeout
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:  # a request's first byte (a later one on a kept-alive connection)
        super().on_message_begin()
        # when the request began to arrive, for the app (an emulated frontend's delay runs from here)
        self.scope[RECEIVED] = time.perf_counter()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before:  # a new request (not an upgrade): run_asgi reads cycle.send when it starts
            self.cycle.send = _send_failing_when_gone(self.cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None and self.header_timeout:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        self.on_header_timeout(peer)
        if self.cycle is not None and not self.cycle.response_complete:
            # a pipelined head is late while an earlier response is still going out: that one is
            # not cut; the connection closes when it ends
            self.cycle.keep_alive = False
            return
        body = json.dumps(ApiError(f"the request head did not arrive within {self.header_timeout:g} s", status=408,
                                   code="request_timeout").body()).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def _send_failing_when_gone(cycle):
    """`cycle.send`, raising ConnectionResetError (and marking the cycle disconnected, so uvicorn
    logs nothing) once the connection is gone and the response is not complete."""
    send = cycle.send

    async def guarded(message) -> None:
        if not cycle.response_complete and (cycle.disconnected or cycle.transport.is_closing()):
            cycle.disconnected = True
            cycle.message_event.set()
            raise ConnectionResetError("the client's connection is gone")
        await send(message)

    return guarded


class BoundedServer(uvicorn.Server):
    """uvicorn's Server with the bounded shutdown of the module docstring. `drain`: finish the
    requests in flight on the first signal (else abort them at once)."""

    def __init__(self, config: uvicorn.Config, api: OpenAIServer, engine: AsyncEngine, drain: bool = True,
                 shutdown_timeout: float = 20.0, grace: float = 1.0) -> None:
        super().__init__(config)
        self.api, self.engine, self.drain = api, engine, drain
        self.shutdown_timeout, self.grace = shutdown_timeout, grace
        self.signals = 0
        self.cut = False
        self.own_signals = True  # False: the caller routes SIGINT / SIGTERM to handle_exit
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM call `handle_exit` (see `loop_signals`); not when `own_signals` is
        False (`serve_together` routes them to every server it runs)."""
        self._loop = asyncio.get_running_loop()
        if not self.own_signals:
            yield
            return
        with loop_signals(self._loop, self.handle_exit):
            yield

    def handle_exit(self, sig, frame) -> None:
        """A shutdown signal (thread-safe: it sets flags and hands the rest to the event loop)."""
        self.signals += 1
        if self.signals == 1:
            self.api.draining = True
            self.engine.shutdown(self.drain)
            self._on_loop(self._arm_deadline)
            self.should_exit = True  # uvicorn stops listening and waits for the connections
        else:  # a second signal: stop at once (uvicorn's own force_exit would cancel tasks mid-way)
            log.warning("pagesim serve: second signal, stopping now")
            self._on_loop(self.cut_off, 0.0)

    def _on_loop(self, fn, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _arm_deadline(self) -> None:
        self._loop.call_later(self.shutdown_timeout, self._deadline)

    def _deadline(self) -> None:
        log.warning("pagesim serve: shutdown timeout (%g s) reached with %d connection(s) open; cutting off",
                    self.shutdown_timeout, len(self.server_state.connections))
        self.cut_off(self.grace)

    def cut_off(self, grace: float) -> None:
        """Abort the engine's requests and end body reads now; close every connection `grace`
        seconds later (time for aborted streams to send their last event). Runs on the loop."""
        if not self.cut:
            self.cut = True
            self.should_exit = True
            self.engine.shutdown(drain=False)
            self.api.cut_off()
        self._loop.call_later(grace, self._close_connections)

    def _close_connections(self) -> None:
        for conn in list(self.server_state.connections):
            conn.transport.abort()  # not close(): a client that reads nothing would keep it open
        # what still runs has had its engine requests aborted and its connection closed, so it
        # ends within a poll; if not, uvicorn stops waiting for it a little later
        self._loop.call_later(2.0, setattr, self, "force_exit", True)


def http_server(api: OpenAIServer, engine: AsyncEngine, metrics, host: str, port: int, *, drain: bool = True,
                shutdown_timeout: float = 20.0, header_timeout: float | None = 10.0) -> BoundedServer:
    """A BoundedServer for `api` on host:port with the GuardedHttpProtocol (see the module
    docstring); `metrics` (a ServeMetrics) counts the heads that time out."""
    def header_timed_out(peer: str) -> None:
        metrics.timed_out("header")
        log.warning("client %s: request head not received within %g s (408, connection closed)", peer,
                    header_timeout)

    protocol = partial(GuardedHttpProtocol, header_timeout=header_timeout, on_header_timeout=header_timed_out)
    config = uvicorn.Config(api.app(), host=host, port=port, http=protocol, log_level="warning", access_log=False)
    return BoundedServer(config, api, engine, drain=drain, shutdown_timeout=shutdown_timeout)


@contextlib.contextmanager
def loop_signals(loop: asyncio.AbstractEventLoop, handle_exit: Callable[[int, None], None]) -> Iterator[None]:
    """SIGINT and SIGTERM call `handle_exit(sig, None)` as event loop callbacks (loop.add_signal_handler,
    as vLLM's server does, instead of uvicorn's signal.signal handlers that run between any two
    bytecodes); the handlers found before are back afterwards. Only the main thread gets signals:
    elsewhere (a server in a test's thread) `handle_exit` is called directly."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.getsignal(sig) for sig in sigs}
    for sig in sigs:
        loop.add_signal_handler(sig, handle_exit, sig, None)
    try:
        yield
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)
            signal.signal(sig, before[sig])


def serve_together(servers: list[BoundedServer], sockets: list[socket.socket] | None = None) -> None:
    """Run `servers` on one event loop until every one has stopped; `sockets`: each server's
    listening socket, bound by the caller (else each binds its config's port). A SIGINT / SIGTERM
    goes to every server (the first drains them all, the second cuts them all off)."""
    def handle_exit(sig, frame) -> None:
        for server in servers:
            server.handle_exit(sig, frame)

    async def serve_all() -> None:
        for server in servers:
            server.own_signals = False
        with loop_signals(asyncio.get_running_loop(), handle_exit):
            await asyncio.gather(*(server.serve(sockets=None if sockets is None else [sock])
                                   for server, sock in zip(servers, sockets or [None] * len(servers))))

    with asyncio.Runner(loop_factory=servers[0].config.get_loop_factory()) as runner:  # as uvicorn's own run
        runner.run(serve_all())
