"""The HTTP side of ``offload serve`` (Starlette on uvicorn): OpenAI's routes, server-sent
events for ``stream``, llama-server's ``/health`` and ``/metrics``.

Every error is an OpenAI-style ``{"error": {...}}`` body: a bad request is a 4xx, a full
queue or a model still loading a 503, and the server keeps serving. A client that leaves —
mid-stream, or while waiting for a whole answer — cancels its generation.
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from offload.server.engine import Engine, Job
from offload.server.protocol import APIError, Choice, Responder, parse_chat, parse_completion

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/slots")
CLIENT_CLOSED = 499               # nginx's status for "the client closed the connection"


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _api_error(request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _http_error(request, exc: HTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind))


async def _internal_error(request, exc: Exception) -> JSONResponse:
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


class CountRequests:
    """ASGI middleware: ``requests_total`` by route and status."""

    def __init__(self, app, engine: Engine):
        self.app, self.engine = app, engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"] if scope["path"] in ROUTES else "other"
            self.engine.metrics.requests[(path, str(status))] += 1


# -- routes -----------------------------------------------------------------------------

async def health(request: HTTPRequest) -> Response:
    if request.app.state.engine.ready:
        return JSONResponse({"status": "ok"})
    return error_response(APIError(503, "loading model", type="unavailable_error"))


async def models(request: HTTPRequest) -> Response:
    engine: Engine = request.app.state.engine
    return JSONResponse({"object": "list", "data": [
        {"id": engine.model_name, "object": "model", "created": request.app.state.started, "owned_by": "offload",
         "meta": request.app.state.model_meta}]})


async def metrics(request: HTTPRequest) -> Response:
    return PlainTextResponse(request.app.state.engine.metrics.render(),
                             media_type="text/plain; version=0.0.4")


async def slots(request: HTTPRequest) -> Response:
    engine: Engine = request.app.state.engine
    if not request.app.state.slots_endpoint:
        return error_response(APIError(501, "the slots endpoint is off (offload serve --no-slots)",
                                       type="not_supported_error"))
    if not engine.ready:
        return error_response(APIError(503, "loading model", type="unavailable_error"))
    if request.method == "GET":
        return JSONResponse(engine.slot_states())
    action = request.query_params.get("action")
    if action != "erase":
        raise APIError(400, f"action {action!r}: this server's slots take action=erase (save and restore "
                       "are llama-server's; offload keeps no slot files)", param="action")
    index = request.path_params["id_slot"]
    return JSONResponse({"id_slot": index, "n_erased": engine.erase_slot(index)})


async def chat_completions(request: HTTPRequest) -> Response:
    return await _generate(request, parse_chat)


async def completions(request: HTTPRequest) -> Response:
    return await _generate(request, parse_completion)


async def _generate(request: HTTPRequest, parse) -> Response:
    engine: Engine = request.app.state.engine
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    r = parse(body)
    job = engine.prepare(r, asyncio.get_running_loop())
    engine.submit(job)
    responder = Responder(r, engine.model_name, engine.pieces)
    if r.stream:
        return StreamingResponse(_events(engine, job, responder), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(engine, job, responder, request)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(engine: Engine, job: Job, responder: Responder):
    """The stream: per choice (one after another) a role chunk (chat), text chunks and a chunk
    with its finish_reason; the last one carries the timings; a usage chunk if asked,
    ``[DONE]``. Starlette cancels this generator when the client disconnects; ``finally``
    then cancels the generation."""
    ended = False
    finish = None                 # a choice's finish chunk, held until the next event
    try:
        if responder.chat:
            yield _sse(responder.role_chunk(0))
        while True:
            kind, value = await job.events.get()
            if finish is not None and kind != "done":
                yield _sse(finish)
                finish = None
            if kind == "piece":
                yield _sse(responder.chunk(value))
            elif kind == "end":
                index, reason = value
                finish = responder.finish_chunk(index, reason)
                if responder.chat and index + 1 < job.request.n:
                    yield _sse(finish)
                    finish = None
                    yield _sse(responder.role_chunk(index + 1))
            elif kind == "error":
                ended = True
                yield _sse(value.body())
                return
            else:
                ended = True
                yield _sse(finish | {"timings": value.timings})
                if job.request.include_usage:
                    yield _sse(responder.usage_chunk(value))
                yield "data: [DONE]\n\n"
                return
    finally:
        if not ended:
            engine.cancel(job)


async def _disconnected(request: HTTPRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(engine: Engine, job: Job, responder: Responder, request: HTTPRequest) -> Response:
    """Collect a whole answer, watching for the client to leave meanwhile."""
    choices = [Choice(i) for i in range(job.request.n)]
    left = asyncio.ensure_future(_disconnected(request))
    ended = False
    try:
        while True:
            event = asyncio.ensure_future(job.events.get())
            await asyncio.wait({event, left}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                return Response(status_code=CLIENT_CLOSED)
            kind, value = event.result()
            if kind == "piece":
                choices[value.index].add(value)
                continue
            if kind == "end":
                choices[value[0]].finish_reason = value[1]
                continue
            ended = True
            if kind == "error":
                return error_response(value)
            return JSONResponse(responder.response(choices, value))
    finally:
        left.cancel()
        if not ended:
            engine.cancel(job)


def build_app(engine: Engine, *, model_meta: dict, slots_endpoint: bool = True) -> Starlette:
    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = Starlette(
        routes=[Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
                Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/slots", slots), Route("/slots/{id_slot:int}", slots, methods=["POST"])],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan)
    app.state.engine, app.state.model_meta, app.state.started = engine, model_meta, int(time.time())
    app.state.slots_endpoint = slots_endpoint
    app.add_middleware(CountRequests, engine=engine)
    return app
