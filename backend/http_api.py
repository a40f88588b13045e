"""The OpenAI-compatible HTTP face of `AsyncEngine` (Starlette; uvicorn runs it, see pagesim/serve.py).

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events, one event
per token per choice, or whole), GET /v1/models, /health and /metrics (Prometheus text).

Each prompt of a call is one engine request; its outputs come back on the engine thread and are
moved onto this event loop by `_Handoff` (one `loop.call_soon_threadsafe` per step, however many
requests got tokens). A call waits for its first output
before answering, so a request the scheduler rejects still gets an HTTP error status; a client
that goes away (while waiting, or mid-stream) has its requests aborted, which frees their blocks.
The client is gone when the HTTP layer reports a disconnect or when a send fails (OSError, as
ASGI 2.4 has it), whichever comes first: a pipelined request whose disconnect the HTTP layer
misses is still aborted at its next token.

A call is refused (never reaching the engine, using up no request id) when it is malformed (400),
too big (413), can never fit --max-pending (400) or does not fit it now (429), comes while the
server stops (503), or its body does not arrive within `body_timeout` (408); a client that leaves
while uploading its body is counted and logged in one line. Aborted streams end with a choice
whose finish_reason is "abort", then [DONE], as vLLM's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from backend.async_engine import AsyncEngine, EngineRequest, RequestOutput
from backend.openai_protocol import (
    ApiError,
    ParsedRequest,
    choice,
    envelope,
    parse_chat,
    parse_completion,
    usage,
)
from backend.serve_metrics import ServeMetrics
from policies.request import Request, SamplingParams


@dataclass
class ServeOptions:
    model_name: str
    max_model_len: int          # prompt + max_tokens of one request, at most
    max_pending: int = 0        # requests in the engine beyond which a new one is answered 429 (0: no limit)
    created: int = 0            # when the server started (unix seconds), for /v1/models
    max_body_bytes: int = 8 << 20  # a larger request body is answered 413 before it is read whole
    body_timeout: float | None = 30.0  # seconds for a call's whole body to arrive, else 408 (None: no limit)
    # an emulated frontend's cost: a call is read this many wall seconds after its first byte came
    # in (this server's own reading of it counts towards them), and arrives at the engine
    # `frontend_delay_engine_s` engine seconds after that byte, however late the event loop wakes
    # it (the loop's lateness is this server's overhead, not the frontend's)
    frontend_delay_s: float = 0.0
    frontend_delay_engine_s: float = 0.0


# the ASGI scope key under which the HTTP protocol (backend/http_server.py) puts when a request's
# first byte was read (time.perf_counter)
RECEIVED = "pagesim.received"
SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it samples greedily
# the server's own log lines go to uvicorn's error log, so that they share its format and level
log = logging.getLogger("uvicorn.error")


class _ClientGone(Exception):
    """The client went away (its connection closed, or a send to it failed)."""


class _Text:
    """One choice's text, decoded incrementally: a delta never ends inside a UTF-8 character or
    inside what may become a stop string; the stop string and what follows are never sent.

    Each token costs a decode of the few tokens since the last stable point, not of the whole
    text (which made a stream's decoding quadratic in its length): the new text is what
    decode(ids[prefix:]) adds to decode(ids[prefix:read]) (vLLM's incremental detokenization;
    decoding both from the same token keeps a tokenizer's leading-space rules out of the delta),
    held back while it ends in an incomplete character. The final call decodes the whole text
    once, so the text sent in all equals decode(ids) whenever the deltas were a prefix of it."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.longest = max((len(s) for s in stop), default=0)
        self.hold = max(self.longest, 1) - 1
        self.ids: list[int] = []
        self.text = ""      # decoded so far (up to `read`)
        self.prefix = 0     # ids[prefix:read] decode to the end of `text`
        self.read = 0
        self.searched = 0   # no stop string ends inside text[:searched]
        self.sent = 0
        self.stopped = False  # a stop string was found

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int], final: bool) -> str:
        self.ids += ids
        if final:
            self.text = self._decode(self.ids)
        elif ids:
            before = self._decode(self.ids[self.prefix:self.read])
            after = self._decode(self.ids[self.prefix:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self.prefix, self.read = self.read, len(self.ids)
        text = self.text
        end = len(text)
        if self.stop:
            start = max(0, self.searched - self.longest + 1)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            self.searched = end
            if hits:
                end, self.stopped, final = min(hits), True, True
        if not final:
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return delta


class _Handoff:
    """Outputs from the engine thread to the event loop: the engine's sinks append to one list and
    the first of a batch schedules one loop callback that hands them all over (one wake-up of the
    loop per step, not one per request). Outputs of calls still waiting for their first are handed
    over first (their tasks run before those of the step's other streams: a new request's first
    token does not queue behind every running stream's next one); each call's own stay in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._first: list[tuple[Callable[[RequestOutput], None], RequestOutput]] = []
        self._rest: list[tuple[Callable[[RequestOutput], None], RequestOutput]] = []
        self._lock = threading.Lock()

    def put(self, deliver: Callable[[RequestOutput], None], out: RequestOutput, first: bool = False) -> None:
        """On any thread: `deliver(out)` on the loop; `first`: the call has had no output yet."""
        with self._lock:
            (self._first if first else self._rest).append((deliver, out))
            wake = len(self._first) + len(self._rest) == 1
        if wake:
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items = self._first + self._rest
            self._first, self._rest = [], []
        for deliver, out in items:
            deliver(out)


class _Call:
    """One HTTP call's engine requests and what has come back for them."""

    def __init__(self, api: OpenAIServer, parsed: ParsedRequest, arrival: float) -> None:
        self.api, self.parsed = api, parsed
        p = parsed.params
        self.id = ("cmpl-" if parsed.kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.rids: list[int] = []
        self.texts: dict[tuple[int, int], _Text] = {}       # (prompt index, choice) -> text
        self.finish: dict[tuple[int, int], str] = {}
        self.tokens: dict[tuple[int, int], int] = {}
        self.open: set[int] = set()                          # engine requests not yet finished
        self.aborted = False                                 # one of them was aborted (shutdown)
        self.answered = False                                # its first output has been taken in
        self.prompt_tokens = sum(len(ids) for ids in parsed.prompts)
        self.requests = [self._request(ids, arrival) for ids in parsed.prompts]
        for i in range(len(parsed.prompts)):
            for j in range(p.n):
                self.texts[i, j] = _Text(api.tokenizer, p.stop)

    def _request(self, ids: list[int], arrival: float) -> Request:
        p, opts = self.parsed.params, self.api.options
        if p.seed is not None and p.seed >= 2**63:  # torch's generators take a signed 64-bit seed
            raise ApiError(f"'seed' must be below 2**63, got {p.seed}", param="seed")
        if p.max_tokens is None and len(ids) >= opts.max_model_len:  # no room left for a default (vLLM's wording)
            raise ApiError(f"This model's maximum context length is {opts.max_model_len} tokens. However, your "
                           f"request has {len(ids)} input tokens. Please reduce the length of the input.",
                           param="prompt" if self.parsed.kind == "completion" else "messages",
                           code="context_length_exceeded")
        max_tokens = p.max_tokens if p.max_tokens is not None else opts.max_model_len - len(ids)
        if len(ids) + max_tokens > opts.max_model_len:
            raise ApiError(f"This model's maximum context length is {opts.max_model_len} tokens. However, you "
                           f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
                           "for the completion). Please reduce the length of the prompt or completion.",
                           param="max_tokens" if p.max_tokens is not None else "prompt",
                           code="context_length_exceeded")
        # as vLLM: a temperature under 1e-5 is greedy (logits / 1e-40 overflow to inf, NaN after the
        # softmax, and that stopped the engine for every client); a top_p under 1e-9 keeps the top
        # token alone, as 1e-9 does (its probability is >= 1 / vocab), but a float32 0 keeps none
        temperature = p.temperature if p.temperature >= SAMPLING_EPS else 0.0
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=p.ignore_eos, n=p.n, temperature=temperature,
                            top_p=max(p.top_p, 1e-9), top_k=p.top_k, seed=p.seed)
        # its id comes at submit: a call refused meanwhile uses none up (requests.csv has no gaps)
        req = Request(-1, arrival, len(ids), sp, prompt_token_ids=ids)
        reason = self.api.engine.refusal(req)
        if reason is not None:
            if sp.width > 1 and self.api.engine.refusal(replace(req, sampling=replace(sp, n=1))) is None:
                # one sequence would be served: it is n that can never fit the batch (never worth a retry)
                raise ApiError(f"this request can never be served: {reason}", param="n", code="invalid_value")
            raise ApiError(f"this request can never be served: {reason}", param="prompt",
                           code="context_length_exceeded")
        return req

    def submit(self, handoff: _Handoff) -> None:
        put = self.queue.put_nowait
        self.requests = [replace(r, request_id=self.api.engine.new_request_id()) for r in self.requests]
        for r in self.requests:
            self.rids.append(r.request_id)
            self.open.add(r.request_id)
            self.api.engine.submit(EngineRequest(r, lambda out: handoff.put(put, out, not self.answered),
                                                 self.parsed.params.stop, self.parsed.params.seed))

    def abort_open(self) -> None:
        for rid in self.open:
            self.api.engine.abort(rid)
        self.open.clear()

    def apply(self, out: RequestOutput) -> list[tuple[int, str, str | None]]:
        """Take one output in: (choice index, text delta, finish reason) per choice it touched. An
        aborted request ends each of its unfinished choices with what text was held back and the
        reason "abort"; any other error raises ApiError."""
        if out.error is not None:
            self.open.discard(out.request_id)
            if not out.aborted:
                raise _failure(out)
            self.aborted = True
        i = self.rids.index(out.request_id)
        n = self.parsed.params.n
        if out.aborted:
            ends = [j for j in range(n) if (i, j) not in self.finish]
            for j in ends:
                self.finish[i, j] = "abort"
            return [(i * n + j, self.texts[i, j].add([], final=True), "abort") for j in ends]
        touched = []
        for j in sorted(set(out.new_tokens) | set(out.finish_reasons)):
            key = (i, j)
            text = self.texts[key]
            if key in self.finish:  # a stop string ended it earlier; the engine's reason comes later
                continue
            new = out.new_tokens.get(j, [])
            self.tokens[key] = self.tokens.get(key, 0) + len(new)
            reason = out.finish_reasons.get(j)
            delta = text.add(new, final=reason is not None)
            if text.stopped:
                reason = "stop"
            if reason is not None:
                self.finish[key] = reason
            touched.append((i * n + j, delta, reason))
        if out.finished:
            self.open.discard(out.request_id)
        return touched

    @property
    def completion_tokens(self) -> int:
        return sum(self.tokens.values())

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens)


def _failure(out: RequestOutput) -> ApiError:
    if out.aborted:
        return ApiError(out.error, status=503, code="aborted", type="server_error")
    if out.error.startswith("engine error"):
        return ApiError(out.error, status=500, code="engine_error", type="server_error")
    return ApiError(f"the scheduler rejected the request: {out.error}", status=429, code="rejected",
                    type="rate_limit_error")


class OpenAIServer:
    """The routes, over one engine. `draining` (set on shutdown) answers new calls 503;
    `cut_off()` (the shutdown's deadline) also ends the body reads still waiting, with 503."""

    def __init__(self, engine: AsyncEngine, tokenizer, metrics: ServeMetrics, options: ServeOptions,
                 extra_routes: list[Route] | None = None) -> None:
        self.engine, self.tokenizer, self.metrics, self.options = engine, tokenizer, metrics, options
        self.extra_routes = extra_routes or []  # served beside the OpenAI routes (an emulator's KV events)
        self.draining = False
        self.cut = False  # the shutdown deadline passed: body reads still waiting end
        self._handoff: _Handoff | None = None  # the engine's outputs to the loop serving this API

    def app(self) -> ASGIApp:
        return _QuietWhenGone(Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
            *self.extra_routes,
        ], exception_handlers={HTTPException: _http_error, Exception: _internal_error}))

    def cut_off(self) -> None:
        """Stop taking calls and end the body reads in progress (503). Call on the event loop."""
        self.draining = self.cut = True

    # ---------------------------------------------------------------- small routes
    async def models(self, request: HttpRequest) -> Response:
        o = self.options
        return JSONResponse({"object": "list", "data": [{
            "id": o.model_name, "object": "model", "created": o.created, "owned_by": "pagesim",
            "root": o.model_name, "parent": None, "max_model_len": o.max_model_len}]})

    async def health(self, request: HttpRequest) -> Response:
        if not self.engine.alive:
            return _error(ApiError(f"engine stopped: {self.engine.error or 'shut down'}", status=503,
                                   type="server_error"))
        return Response(status_code=503 if self.draining else 200)

    async def metrics_text(self, request: HttpRequest) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---------------------------------------------------------------- generation
    async def completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, parse_completion)

    async def chat(self, request: HttpRequest) -> Response:
        return await self._generate(request, parse_chat)

    async def _generate(self, request: HttpRequest, parse) -> Response:
        arrival = self.engine.clock()
        delay = self.options.frontend_delay_s
        if delay > 0:  # an emulated frontend: its delay runs from the request's first byte, so that
            # this server's own reading and routing of the request is hidden inside it (up to all of it)
            received = request.scope.get(RECEIVED)
            spent = min(max(time.perf_counter() - received, 0.0), delay) if received is not None else 0.0
            arrival -= spent * self.options.frontend_delay_engine_s / delay
            await asyncio.sleep(delay - spent)
            arrival = min(arrival + self.options.frontend_delay_engine_s, self.engine.clock())
        try:
            call = await self._accept(request, parse, arrival)
        except _ClientGone as e:
            self.metrics.abandoned.inc()
            log.warning("client %s left during its upload: %s", _peer(request), e)
            return Response(status_code=499)
        except ApiError as e:
            if e.status == 408:
                self.metrics.timed_out("body")
            else:
                self.metrics.refused.inc()
            return _error(e)
        loop = asyncio.get_running_loop()
        if self._handoff is None or self._handoff.loop is not loop:
            self._handoff = _Handoff(loop)
        call.submit(self._handoff)
        streaming = False
        try:  # on any way out but the stream (which owns them then), what is still open is aborted
            first = await self._next(call, request)
            call.answered = True
            if first.aborted:
                raise _failure(first)
            events = call.apply(first)
            if call.parsed.params.stream:
                streaming = True
                return EventStream(self._stream(call, events, request))
            while call.open:
                call.apply(await self._next(call, request))
            if call.aborted:
                raise ApiError("the request was aborted: the server is shutting down", status=503, code="aborted",
                               type="server_error")
            return JSONResponse(self._whole(call))
        except _ClientGone:
            return Response(status_code=499)
        except ApiError as e:
            return _error(e)
        finally:
            if not streaming:
                call.abort_open()

    def _refuse_if_stopping(self) -> None:
        if self.draining or not self.engine.alive:
            raise ApiError("the server is shutting down" if self.draining else "the engine has stopped",
                           status=503, type="server_error")

    async def _accept(self, request: HttpRequest, parse, arrival: float) -> _Call:
        self._refuse_if_stopping()
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise ApiError(f"the request body must be JSON: content-type {ctype!r} is not application/json",
                           code="unsupported_media_type")
        raw = await self._read_body(request)
        self._refuse_if_stopping()  # the server began to stop while the body came in
        try:
            body = json.loads(raw)
        # ValueError covers both decode errors and an integer past Python's 4300-digit limit
        except (ValueError, RecursionError) as e:
            raise ApiError(f"malformed JSON in the request body: {e}", code="invalid_json") from None
        try:  # a lone surrogate escape ("\ud800") parses, then breaks the tokenizer or the answer's encoding
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ApiError("the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff): not valid "
                           "Unicode", code="invalid_json") from None
        parsed = parse(body, self.options.model_name, self.tokenizer)
        call = _Call(self, parsed, arrival)
        limit = self.options.max_pending
        if limit and len(call.requests) > limit:  # never admitted, idle or not: 429 would be retried forever
            raise ApiError(f"this call holds {len(call.requests)} prompts, more than the server's limit of {limit} "
                           f"pending requests (--max-pending {limit}): it can never be admitted; send at most "
                           f"{limit} prompts per call", param="prompt", code="invalid_value")
        if limit and self.engine.num_outstanding + len(call.requests) > limit:
            raise ApiError(f"the server holds {self.engine.num_outstanding} requests (--max-pending {limit}); "
                           "retry later", status=429, code="too_many_requests", type="rate_limit_error")
        return call

    async def _read_body(self, request: HttpRequest, poll: float = 0.25) -> bytes:
        """The body, within `body_timeout` seconds (else 408); 503 when the server's shutdown
        deadline cuts it off (seen within `poll` s); _ClientGone when the client leaves meanwhile."""
        loop = asyncio.get_running_loop()
        limit = self.options.body_timeout
        deadline = loop.time() + limit if limit is not None else float("inf")
        close = {"connection": "close"}  # what is left of the body is never read
        reading = asyncio.ensure_future(_body(request, self.options.max_body_bytes))
        try:
            while not reading.done():
                if self.cut:
                    raise ApiError("the server is shutting down: the request body did not arrive before its "
                                   "deadline", status=503, code="shutting_down", type="server_error", headers=close)
                if loop.time() >= deadline:
                    raise ApiError(f"the request body did not arrive within {limit:g} s", status=408,
                                   code="request_timeout", headers=close)
                await asyncio.wait({reading}, timeout=min(poll, deadline - loop.time()))
            return reading.result()
        finally:
            reading.cancel()  # no-op once done

    async def _next(self, call: _Call, request: HttpRequest, poll: float = 0.25) -> RequestOutput:
        """The call's next output; raises _ClientGone when the client disconnects meanwhile."""
        if not call.queue.empty():  # already here (a step's outputs come together): no waiter needed
            return call.queue.get_nowait()
        getter = asyncio.ensure_future(call.queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=poll)
                if done:
                    return getter.result()
                if await request.is_disconnected():
                    raise _ClientGone()
                if not self.engine.alive and call.queue.empty():
                    raise ApiError("the engine stopped", status=500, code="engine_error", type="server_error")
        finally:
            if not getter.done():
                getter.cancel()

    def _whole(self, call: _Call) -> dict:
        p = call.parsed
        choices = []
        for (i, j), text in sorted(call.texts.items()):
            whole = text.tokenizer.decode(text.ids, skip_special_tokens=True)
            cut = min([k for k in (whole.find(s) for s in p.params.stop) if k >= 0], default=len(whole))
            choices.append(choice(p.kind, i * p.params.n + j, whole[:cut], call.finish.get((i, j)), delta=False))
        body = envelope(p.kind, call.id, p.created, self.options.model_name, choices, stream=False)
        body["usage"] = call.usage()
        return body

    async def _stream(self, call: _Call, events: list, request: HttpRequest) -> AsyncGenerator[str, None]:
        """SSE: the events of the call's first output, then one event per token per choice as they
        come; usage on the last chunk (or its own chunk with stream_options.include_usage).
        Raises _ClientGone when the client disconnects."""
        p = call.parsed
        try:
            if p.kind == "chat":  # OpenAI opens each chat choice with the assistant's role
                roles = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for k in range(len(p.prompts) * p.params.n)]
                yield self._sse(call, roles, None)
            while True:
                last = not call.open
                for k, (index, delta, reason) in enumerate(events):
                    u = call.usage() if p.params.continuous_usage or (
                        last and k == len(events) - 1 and not p.params.include_usage) else None
                    yield self._sse(call, [choice(p.kind, index, delta, reason, delta=True)], u)
                if last:
                    break
                try:
                    events = call.apply(await self._next(call, request))
                except ApiError as e:
                    yield f"data: {json.dumps(e.body())}\n\n"
                    break
            if p.params.include_usage:
                yield self._sse(call, [], call.usage())
            yield "data: [DONE]\n\n"
        finally:  # the client went away, the stream was closed, or an error ended it
            call.abort_open()

    def _sse(self, call: _Call, choices: list[dict], use: dict | None) -> str:
        p = call.parsed
        body = envelope(p.kind, call.id, p.created, self.options.model_name, choices, stream=True)
        if use is not None:
            body["usage"] = use
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class EventStream(Response):
    """Server-sent events from `events`, sent as they come (the completions' streams and
    backend.kv_events' stream, with extra `headers`). The client is gone when a send fails
    (OSError: its connection is lost, whichever request the HTTP layer thinks is current) or when
    `events` raises _ClientGone (a disconnect the HTTP layer reported); either way the stream ends
    quietly, and `events` is always closed, so its finally aborts the call's requests."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (OSError, _ClientGone):
            return
        finally:
            await self.events.aclose()


class _QuietWhenGone:
    """ASGI wrapper: a send that fails because the client's connection is gone (OSError) ends the
    call quietly (the route has aborted its engine requests), not as a traceback in the log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        failed = False

        async def send_once_gone(message: dict) -> None:
            nonlocal failed
            try:
                await send(message)
            except OSError:
                failed = True
                raise

        try:
            await self.app(scope, receive, send_once_gone)
        except OSError:
            if not failed:
                raise


async def _body(request: HttpRequest, limit: int) -> bytes:
    """The request body, refused with 413 once it is known to exceed `limit` bytes (by its
    Content-Length, or while it streams in), so a huge body is never held whole; _ClientGone
    when the client leaves before it is whole."""
    declared = request.headers.get("content-length", "")
    too_big = ApiError(f"the request body exceeds {limit} bytes", status=413, code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:
        want = f" of {declared}" if declared.isdigit() else ""
        raise _ClientGone(f"{request.method} {request.url.path}, {size}{want} body bytes received") from None
    return b"".join(chunks)


def _peer(request: HttpRequest) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "?"


async def _http_error(request: HttpRequest, exc: HTTPException) -> JSONResponse:
    """Unknown path (404), wrong method (405): OpenAI's error object, not Starlette's plain text."""
    e = ApiError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code,
                 code="not_found" if exc.status_code == 404 else "method_not_allowed")
    return JSONResponse(e.body(), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: HttpRequest, exc: Exception) -> JSONResponse:
    """A bug of ours: OpenAI's error object with status 500 (Starlette still logs the traceback)."""
    e = ApiError(f"internal server error: {type(exc).__name__}: {exc}", status=500, code="internal_error",
                 type="server_error")
    return JSONResponse(e.body(), status_code=500)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
