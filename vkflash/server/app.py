"""The HTTP server: FastAPI app on uvicorn (OpenAPI schema at /openapi.json), the API-key gate,
the body-size limit (MAX_BODY), request counting, /health and /detokenize, and `serve`; llama-server's
other endpoints are in vkflash.server.llama_api.

`serve(settings)` prints one line per knob with its source, binds HOST:PORT (a bind failure
stops startup with a ConfigError), loads the model in the background and serves until stopped:
a failed load stops it with the reason (exit status 1, for systemd's Restart=on-failure);
SIGINT/SIGTERM end the running and waiting generations with an error, join the engine's thread
and return (exit status 0); with DRAIN > 0 the running generation first has up to DRAIN seconds
to finish while everything else is answered 503.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import vkflash
from vkflash import settings as settings_mod
from vkflash.engine.api import InvalidRequest
from vkflash.errors import ConfigError, VkflashError
from vkflash.progress import Steps
from vkflash.server import backend, llama_api
from vkflash.server.errors import ApiError, document_errors, validation_error
from vkflash.server.openai_api import make_router
from vkflash.server.schemas import DetokenizeRequest
from vkflash.server.slot import ShuttingDown
from vkflash.server.state import ServerOptions, ServerState
from vkflash.settings import Settings

log = logging.getLogger("vkflash.server")

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/openapi.json", "/docs"})
KNOWN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/chat/completions", "/completions",
                         "/models", "/health", "/v1/health", "/metrics", "/props", "/slots", "/tokenize", "/detokenize",
                         "/apply-template", "/infill", "/openapi.json", "/docs"})


STOP_WAIT_S = 20.0  # how long a stop waits for the engine's thread (systemd's TimeoutStopSec is 30 s)
DRAIN_S = 2.0  # how long a refused body is read on (and dropped) so the client sees the 413, not a reset


class BodyTooLarge(StarletteHTTPException):
    """The request body is larger than MAX_BODY (raised from the body stream, answered as a 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than MAX_BODY={limit} bytes")


async def drain(receive: Receive, more: bool = True) -> None:
    """Read and drop the rest of a request body (bounded by DRAIN_S), so the answer reaches the client."""
    async def rest() -> None:
        nonlocal more
        while more:
            msg = await receive()
            more = msg["type"] == "http.request" and msg.get("more_body", False)

    try:
        await asyncio.wait_for(rest(), DRAIN_S)
    except asyncio.TimeoutError:
        pass


def limited(receive: Receive, limit: int) -> Receive:
    """`receive` that raises BodyTooLarge once the body passes `limit` bytes (the rest is drained)."""
    seen = 0

    async def receive_limited() -> Message:
        nonlocal seen
        msg = await receive()
        if msg["type"] == "http.request":
            seen += len(msg.get("body", b""))
            if seen > limit:
                await drain(receive, msg.get("more_body", False))
                raise BodyTooLarge(limit)
        return msg

    return receive_limited


def as_json(scope: Scope) -> Scope:
    """Every body this API takes is JSON: read it so whatever Content-Type came (`curl -d` sends a form type)."""
    headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
    return dict(scope, headers=[*headers, (b"content-type", b"application/json")])


class Gate:
    """ASGI middleware: the optional bearer API key (401 otherwise), JSON bodies, the body limit
    (413), per-path request counts, and the last resort: an exception nothing else handled is
    logged once and answered as a JSON 500, never a plain-text one.

    Pure ASGI (not BaseHTTPMiddleware) so streamed responses pass through unbuffered and a
    client disconnect still reaches the endpoint.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    def _authorized(self, scope: Scope) -> bool:
        key = self.state.settings["API_KEY"]
        if not key or scope["path"] in PUBLIC_PATHS:
            return True
        auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def counting_send(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        limit = self.state.settings["MAX_BODY"]
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"0")
        try:
            if not self._authorized(scope):
                err = ApiError(401, "invalid or missing API key (send `Authorization: Bearer <API_KEY>`)",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, counting_send)
            elif length.isdigit() and int(length) > limit:
                if b"100-continue" not in headers.get(b"expect", b"").lower():  # else the body never comes
                    await drain(receive)
                await too_large(BodyTooLarge(limit)).response()(scope, receive, counting_send)
            else:
                await self.app(as_json(scope) if scope["method"] == "POST" else scope, limited(receive, limit),
                               counting_send)
        except Exception:  # noqa: BLE001 — the catch-all: one log line with the traceback, a JSON 500
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not status:
                await ApiError(500, "internal server error (logged on the server)",
                               code="internal_error").response()(scope, receive, counting_send)
        finally:
            path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
            self.state.metrics.request(path, status or 500)


def too_large(exc: BodyTooLarge) -> ApiError:
    """The 413 error object."""
    return ApiError(413, str(exc.detail), code="request_too_large")


def create_app(state: ServerState) -> ASGIApp:
    """The FastAPI app over a server state, behind the Gate."""
    started = int(time.time())
    app = FastAPI(title="vkflash", version=vkflash.__version__,
                  description="OpenAI-compatible server of the vkflash Vulkan inference engine", redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_req: Any, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Any, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(InvalidRequest)
    async def _engine_invalid(_req: Any, exc: InvalidRequest) -> JSONResponse:
        return ApiError(400, str(exc), param=exc.param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Any, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, BodyTooLarge):
            return too_large(exc).response()
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(_req: Any, _exc: Exception) -> JSONResponse:
        # Starlette's last handler: the answer; it re-raises, and the Gate logs it once
        return ApiError(500, "internal server error (logged on the server)", code="internal_error").response()

    app.include_router(make_router(state))
    app.include_router(llama_api.make_router(state))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document_errors(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/v1/health", summary="Alias of /health (llama-server)")
    @app.get("/health", summary="200 when ready; 503 while loading, after a failed load / lost device, or stopping")
    async def health() -> JSONResponse:
        h = state.health
        if state.stopping:
            body = ApiError(503, str(ShuttingDown()), code="shutting_down").body()
            return JSONResponse(dict(body, status="shutting_down"), status_code=503)
        if h.status == "ok":
            return JSONResponse({"status": "ok"})
        msg = "Loading model" if h.status == "loading" else h.reason
        body = ApiError(503, msg, code=h.status).body()
        return JSONResponse(dict(body, status=h.status), status_code=503)

    @app.get("/models", summary="Alias of /v1/models (llama-server)")
    @app.get("/v1/models", summary="The served model")
    async def models() -> JSONResponse:
        i = state.ready().info
        return JSONResponse({"object": "list", "data": [{
            "id": i.model_id, "object": "model", "created": started, "owned_by": "vkflash",
            "meta": {"arch": i.arch, "n_ctx": i.n_ctx, "n_ctx_train": i.n_ctx_train, "n_vocab": i.n_vocab}}]})

    @app.post("/detokenize", summary="Token ids → text")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        loaded = state.ready()
        bad = [t for t in req.tokens if not 0 <= t < loaded.tokenizer.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary 0..{loaded.tokenizer.vocab_size - 1}",
                           param="tokens")
        return JSONResponse({"content": loaded.tokenizer.decode(req.tokens, special=True)})

    return Gate(app, state)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a ConfigError saying why not."""
    sock: socket.socket | None = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        if sock is not None:  # the port is taken or not ours: the socket made for the try is closed now
            sock.close()
        raise ConfigError(f"cannot listen on HOST={host} PORT={port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def ready_line(loaded: backend.Loaded, url: str, t0: float) -> str:
    """The one line saying the server is ready: where, with what, after how long."""
    i = loaded.info
    return (f"vkflash serve: ready on {url} (model {i.model_id}, {i.arch}, {i.backend}, CTX {i.n_ctx}) "
            f"after {time.monotonic() - t0:.1f} s")


def serve(settings: Settings, options: ServerOptions | None = None,
          loader: Callable[[Settings, Steps], backend.Loaded] = backend.load) -> None:
    """Run the server until interrupted: print the knobs in effect, bind, load (showing the download,
    upload and pipeline compilation), say when ready, serve."""
    t0 = time.monotonic()
    settings_mod.install(settings)
    for line in settings.lines():
        print(line, flush=True)
    steps = Steps("vkflash serve")
    summary = backend.preflight(settings, steps)  # refuses a configuration that cannot boot, before any load
    if summary:
        print(summary, flush=True)
    sock = bind(settings["HOST"], settings["PORT"])
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"

    def load(s: Settings) -> backend.Loaded:
        loaded = loader(s, steps)
        print(ready_line(loaded, url, t0), flush=True)  # /health says ok right after this line
        return loaded

    state = ServerState(settings, options or ServerOptions(), load)
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2)
    server = Server(config, state)
    failure: list[str] = []

    def load_failed(reason: str) -> None:
        failure.append(reason)
        server.should_exit = True

    state.on_load_failure = load_failed
    print(f"vkflash serve: listening on {url} (OpenAPI: /docs); loading the model", flush=True)
    state.start_loading()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        state.stop()
        if not state.close(STOP_WAIT_S):
            print("warning: the engine thread did not stop in time", file=sys.stderr, flush=True)
    if failure:
        raise LoadFailed(failure[0])


class LoadFailed(VkflashError):
    """The model could not be loaded: the server stops (exit status 1) instead of answering 503 forever."""


class Server(uvicorn.Server):
    """uvicorn's server that ends the generations before closing connections, and treats SIGINT /
    SIGTERM as a requested stop (uvicorn would raise the signal again after shutting down: a
    KeyboardInterrupt traceback or death by SIGTERM instead of exit status 0)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # DRAIN: the running generation may finish while /health and new or waiting requests get 503
        # (still listening, so a router retries them elsewhere); then, or at once, streams end with
        # an error event and [DONE], waiting requests get 503: wait for the engine to stop (a prefill
        # only checks between ubatches) before uvicorn's short grace period
        drain_s = self.state.settings["DRAIN"]
        if drain_s and self.state.slot is not None and not self.force_exit:
            self.state.drain()
            print(f"vkflash serve: draining: the running generation has up to {drain_s:g} s to finish", flush=True)
            end = time.monotonic() + drain_s
            while time.monotonic() < end and not self.force_exit:  # a second Ctrl-C cuts the drain short
                if await asyncio.to_thread(self.state.slot.join, min(0.2, end - time.monotonic())):
                    break
        self.state.stop()
        if self.state.slot is not None:
            await asyncio.to_thread(self.state.slot.join, STOP_WAIT_S)
        await super().shutdown(sockets)
