"""The ASGI app (starlette): the OpenAI-compatible API, `/metrics` and the swarm page (`/`, `/api/swarm`).

The key guards `/v1` only: `/metrics`, the page and its JSON are public and show no prompts,
texts or keys (`swarm_api`).

Every request is checked before anything costly, in the order a client can fix it: `HttpGuard`
first (headers 431, the declared and the arriving body size 413, a slow body 408), then the key
(401), the JSON's shape and fields (400, naming the field), the model (404), messages and
characters against the context (400, before the template and the tokenizer), the tokens (400),
a complete route (503), a place in the queue and the client's share (429). Only then does the generation run, inside the response, next to a task
that listens for the client going away: that cancels the generation, which closes its route
session on the peers at once. A stream's HTTP status is sent with its first tokens, so a route
that fails before them still gets a proper error status; a failure after them is sent as an
error event (the `openai` client raises it).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from dsd.node.head.setup import chat_ids
from dsd.node.route.record import ring_hops

from .admission import Busy
from .guards import HttpGuard, HttpLimits, PromptBudget, client_of
from .openai_wire import (
    SSE_DONE,
    CompletionRequest,
    call_deltas,
    chunk_body,
    completion_body,
    models_body,
    parse_request,
    sse,
    usage_chunk,
)
from .runner import CLIENT_GONE, Finished, Job, ServiceState, no_route_error, record, run_job
from .swarm_api import page_routes
from .wire_errors import WireError, retry_headers

log = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Events = trio.MemoryReceiveChannel[tuple[str, Any]]

ENDPOINTS = {"/v1/models": "models", "/v1/completions": "completions", "/v1/chat/completions": "chat"}

ROUTE_MAX_AGE_S = 2.0  # a request that finds no route surveys again when the last survey is older


def service_of(request: Request) -> ServiceState:
    return request.app.state.service


def check_key(state: ServiceState, request: Request) -> int | None:
    """401 unless the request carries one of the service's keys (`build_app`'s `api_keys`, by default
    `state.api_key`) as a bearer token, when it has any; the index of the key it carries."""
    keys: tuple[str, ...] = request.app.state.api_keys
    if not keys:
        return None
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if not auth:
        raise WireError(401, "missing API key: send it as 'Authorization: Bearer KEY'", code="invalid_api_key")
    given = token.strip().encode()
    found = [i for i, key in enumerate(keys) if secrets.compare_digest(given, key.encode())]
    if scheme.lower() != "bearer" or not found:
        raise WireError(401, "incorrect API key provided", code="invalid_api_key")
    return found[0]


def client_key(request: Request, key: int | None) -> str:
    """Whom a request counts against in admission: its key when the service has several, else its address."""
    several = len(request.app.state.api_keys) > 1
    return client_of(key if several else None, request.client.host if request.client else None)


def check_prompt_size(request: Request, req: CompletionRequest) -> None:
    """400 when the prompt's messages or characters cannot fit the context: before the tokenizer runs (and the
    chat template, but to confirm a refusal for characters: it may trim or drop some)."""
    if isinstance(req.prompt, list):
        return  # token ids: `plan` counts them without tokenizing
    texts = [str(m.get("content") or "") for m in req.messages] if req.chat else [req.prompt or ""]
    tokenizer = service_of(request).head.tokenizer

    def rendered() -> str:
        return tokenizer.apply_chat_template(list(req.messages), tokenize=False, add_generation_prompt=True)

    excess = request.app.state.prompt_budget.excess(texts, req.chat, rendered)
    if excess is not None:
        raise WireError(400, excess[1], code="context_length_exceeded", param=excess[0])


def error_response(exc: WireError) -> JSONResponse:
    """An OpenAI error object with its status."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=retry_headers(exc.status))


async def read_body(request: Request) -> bytes:
    """The request body; `HttpGuard` in front of every route refuses it (413, 408) when too big or too slow."""
    return await request.body()


async def _route_or_503(state: ServiceState) -> None:
    """A complete route is known (surveying again if the last view has none and is not fresh), else 503."""
    if state.swarm.hops is not None:
        return
    try:
        await state.swarm.refresh(max_age_s=ROUTE_MAX_AGE_S)
    except Exception as exc:  # the DHT or the probes failed, or the survey timed out
        raise WireError(503, f"cannot survey the swarm: {exc!r}", type="server_error", code="no_route") from None
    if state.swarm.hops is None:
        raise no_route_error(state.swarm.missing)


async def list_models(request: Request) -> Response:
    state = service_of(request)
    check_key(state, request)
    if state.swarm.hops is None:
        try:
            await state.swarm.refresh(max_age_s=ROUTE_MAX_AGE_S)
        except Exception:  # answer with what is known
            pass
    view = state.swarm.view
    models = []
    if view is not None and view.plan is not None:
        head = state.head
        peers = [{"peer_id": r.peer_id, "start": r.start, "end": r.end,
                  "rtt_ms": None if view.rtts.get(r.peer_id) is None else round(view.rtts[r.peer_id] * 1000, 3)}
                 for r in sorted(view.records, key=lambda r: (r.start, r.end, r.peer_id))]
        route = [h.as_dict() for h in ring_hops(view.plan.hops, state.node.peer_id, head.local_blocks)]
        models.append({"id": head.model_id, "created": head.created, "owned_by": "dsd", "dsd": {
            "num_layers": head.num_layers, "context_length": head.context_limit, "mode": head.options.mode,
            "peers": peers, "spans": [[p["start"], p["end"]] for p in peers], "route": route,
            "local_blocks": list(head.local_blocks) if head.local_blocks else None,
            "est_round_ms": round(view.plan.est_round_s * 1000, 3), "surveyed": round(state.swarm.surveyed_unix, 3),
        }})
    state.metrics.requests.labels(endpoint="models", status="200").inc()
    return JSONResponse(models_body(models))


async def _completion(request: Request, chat: bool) -> Any:
    state = service_of(request)
    arrived = trio.current_time()
    key = check_key(state, request)
    req = parse_request(await read_body(request), chat=chat)
    state.head.check_model(req.model)
    check_prompt_size(request, req)
    plan = state.head.plan(req)
    await _route_or_503(state)
    try:
        slot = state.admission.reserve(client_key(request, key))
    except Busy as exc:
        raise WireError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded") from None
    prefix = "chatcmpl" if chat else "cmpl"
    job = Job(req=req, plan=plan, slot=slot, endpoint="chat" if chat else "completions",
              rid=f"{prefix}-{uuid.uuid4().hex[:24]}", created=int(time.time()), arrived=arrived)
    return GenerationResponse(state, job)


async def chat_completions(request: Request) -> Any:
    return await _completion(request, chat=True)


async def completions(request: Request) -> Any:
    return await _completion(request, chat=False)


async def metrics(request: Request) -> Response:
    body, content_type = service_of(request).metrics.render()
    return Response(body, headers={"content-type": content_type})


class GenerationResponse:
    """The ASGI response of one admitted completion request: runs the generation while it answers."""

    def __init__(self, state: ServiceState, job: Job) -> None:
        self.state = state
        self.job = job
        self.status = 0  # the HTTP status sent (0: nothing sent yet)
        self.gone = False  # the client went away before the answer was complete
        self.complete = False  # the answer's last byte was handed to the server
        self._scope = trio.CancelScope()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        events_in, events = trio.open_memory_channel[tuple[str, Any]](math.inf)
        outcome: tuple[Finished | None, str | None] = (None, None)
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_client, receive)
                    nursery.start_soon(self._produce, events_in)
                    answer = self._stream if self.job.req.stream else self._whole
                    outcome = await answer(events, send)
                    nursery.cancel_scope.cancel()
        finally:
            self.job.slot.release()  # a request cancelled while still queued never held a running slot
            finished, error = outcome
            if self.gone:
                status, error = CLIENT_GONE, "the client went away"
            elif not self.status:  # cancelled before answering: the server is shutting down
                status, error = 503, "cancelled: the server is shutting down"
            else:
                status = self.status
            record(self.state, self.job, status, finished, error)

    def _client_gone(self) -> None:
        """Stop everything of this request: the generation and its route session end by cancellation."""
        if not self.complete:
            self.gone = True
            self._scope.cancel()

    async def _watch_client(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._client_gone()
                return

    async def _produce(self, events: trio.MemorySendChannel[tuple[str, Any]]) -> None:
        """Run the generation; every outcome becomes an event (an unexpected error too: never crash the app)."""
        try:
            finished = await run_job(self.state, self.job, lambda text: events.send_nowait(("text", text)))
            events.send_nowait(("done", finished))
        except WireError as exc:
            events.send_nowait(("error", exc))
        except Exception as exc:
            log.exception("request %s failed", self.job.rid)
            events.send_nowait(("error", WireError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                   type="server_error", code="internal")))

    async def _send(self, send: Send, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True  # a client that leaves from now on has its whole answer
        try:
            await send(message)
        except Exception:  # the connection is gone
            self._client_gone()
            await trio.lowlevel.checkpoint()  # raises Cancelled: this request's scope is cancelled

    async def _start(self, send: Send, status: int, content_type: str) -> None:
        self.status = status
        headers = [(b"content-type", content_type.encode())]
        headers += [(k.encode(), v.encode()) for k, v in retry_headers(status).items()]
        if content_type.startswith("text/event-stream"):
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        await self._send(send, {"type": "http.response.start", "status": status, "headers": headers})

    async def _json(self, send: Send, status: int, body: dict[str, Any]) -> None:
        await self._start(send, status, "application/json")
        await self._send(send, {"type": "http.response.body", "body": json.dumps(body).encode()})

    async def _whole(self, events: Events, send: Send) -> tuple[Finished | None, str | None]:
        """A non-streamed answer: wait for the end, answer once."""
        job = self.job
        async for kind, value in events:
            if kind == "done":
                body = completion_body(job.req, rid=job.rid, created=job.created, model=self.state.head.model_id,
                                       text=value.text, finish_reason=value.finish_reason, usage=value.usage,
                                       dsd=value.dsd, calls=value.calls, logprobs=value.logprobs)
                await self._json(send, 200, body)
                return value, None
            if kind == "error":
                await self._json(send, value.status, value.body())
                return None, value.message
        raise AssertionError("the generation ended without an outcome")

    async def _stream(self, events: Events, send: Send) -> tuple[Finished | None, str | None]:
        """Server-sent events: the status and the first chunk when the first tokens come, deltas, the end, [DONE]."""
        req = self.job.req
        ids = {"rid": self.job.rid, "created": self.job.created, "model": self.state.head.model_id}

        async def event(data: bytes, more: bool = True) -> None:
            await self._send(send, {"type": "http.response.body", "body": data, "more_body": more})

        async for kind, value in events:
            if kind == "error":
                if not self.status:  # nothing was generated: a proper status
                    await self._json(send, value.status, value.body())
                else:
                    await event(sse(value.body()), more=False)
                return None, value.message
            if not self.status:
                await self._start(send, 200, "text/event-stream; charset=utf-8")
                await event(sse(chunk_body(req, **ids, text=value if kind == "text" else "", first=True)))
            elif kind == "text" and value:
                await event(sse(chunk_body(req, **ids, text=value)))
            if kind == "done":
                done: Finished = value
                if done.tail:
                    await event(sse(chunk_body(req, **ids, text=done.tail)))
                for deltas in call_deltas(done.calls):
                    await event(sse(chunk_body(req, **ids, calls=deltas)))
                # Every token's logprobs ride on the finishing chunk: clients add up the chunks' entries.
                last = chunk_body(req, **ids, finish_reason=done.finish_reason, logprobs=done.logprobs)
                if req.include_usage:
                    await event(sse(last))
                    last = usage_chunk(req, **ids, usage=done.usage)
                await event(sse({**last, "dsd": done.dsd}))  # the dsd statistics ride on the last chunk
                await event(SSE_DONE, more=False)
                return done, None
        raise AssertionError("the generation ended without an outcome")


def build_app(state: ServiceState, extra_routes: Sequence[BaseRoute] = (), *, limits: HttpLimits | None = None,
              api_keys: Sequence[str] | None = None) -> Starlette:
    """The service's ASGI app: the API, `/metrics`, the swarm page (`/`, `/api/swarm`) and `extra_routes`, behind
    `HttpGuard` (`limits`); `/v1` takes any of `api_keys` (default: `state.api_key`, if set)."""
    routes: list[BaseRoute] = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        *page_routes(),
        *extra_routes,
    ]

    async def wire_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, WireError)
        endpoint = ENDPOINTS.get(request.url.path, "other")
        service_of(request).metrics.requests.labels(endpoint=endpoint, status=str(exc.status)).inc()
        log.log(logging.WARNING if exc.status >= 500 else logging.INFO, "%s %s %d: %s", request.method,
                request.url.path, exc.status, exc.message)
        return error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        what = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        return error_response(WireError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                        code=what))

    def refused(scope: dict[str, Any], status: int) -> None:  # answered by the guard: counted like the rest
        state.metrics.requests.labels(endpoint=ENDPOINTS.get(scope["path"], "other"), status=str(status)).inc()

    guard = Middleware(HttpGuard, limits=limits, on_refused=refused)
    app = Starlette(routes=routes, exception_handlers={WireError: wire_error, HTTPException: http_error},
                    middleware=[guard])
    app.state.service = state
    app.state.api_keys = tuple(api_keys) if api_keys is not None else (state.api_key,) if state.api_key else ()
    head = state.head
    app.state.prompt_budget = PromptBudget.of(head.tokenizer, head.context_limit, lambda m: chat_ids(head.tokenizer, m))
    return app
