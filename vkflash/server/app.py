"""The HTTP server: FastAPI app on uvicorn (OpenAPI schema at /openapi.json), the API-key gate,
request counting, /health and /detokenize, and `serve`; llama-server's other endpoints are in
vkflash.server.llama_api.

`serve(settings)` prints one line per knob with its source, binds HOST:PORT (a bind failure
stops startup with a ConfigError), loads the model in the background and serves until stopped.
"""

from __future__ import annotations

import hmac
import socket
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
from vkflash.errors import ConfigError
from vkflash.server import backend, llama_api
from vkflash.server.errors import ApiError, validation_error
from vkflash.server.openai_api import make_router
from vkflash.server.schemas import DetokenizeRequest
from vkflash.server.state import ServerOptions, ServerState
from vkflash.settings import Settings

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/openapi.json", "/docs"})
KNOWN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/v1/health", "/metrics",
                         "/props", "/slots", "/tokenize", "/detokenize", "/apply-template", "/infill", "/openapi.json",
                         "/docs"})


def as_json(scope: Scope) -> Scope:
    """Every body this API takes is JSON: read it so whatever Content-Type came (`curl -d` sends a form type)."""
    headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
    return dict(scope, headers=[*headers, (b"content-type", b"application/json")])


class Gate:
    """ASGI middleware: the optional bearer API key (401 otherwise), JSON bodies, per-path request counts.

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
        status = 500

        async def counting_send(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            if self._authorized(scope):
                await self.app(as_json(scope) if scope["method"] == "POST" else scope, receive, counting_send)
            else:
                err = ApiError(401, "invalid or missing API key (send `Authorization: Bearer <API_KEY>`)",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, counting_send)
        finally:
            path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
            self.state.metrics.request(path, status)


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
        return ApiError(exc.status_code, str(exc.detail)).response()

    app.include_router(make_router(state))
    app.include_router(llama_api.make_router(state))

    @app.get("/v1/health", summary="Alias of /health (llama-server)")
    @app.get("/health", summary="200 when ready; 503 while loading or after a failed load / lost device")
    async def health() -> JSONResponse:
        h = state.health
        if h.status == "ok":
            return JSONResponse({"status": "ok"})
        msg = "Loading model" if h.status == "loading" else h.reason
        body = ApiError(503, msg, code=h.status).body()
        return JSONResponse(dict(body, status=h.status), status_code=503)

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
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise ConfigError(f"cannot listen on HOST={host} PORT={port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(settings: Settings, options: ServerOptions | None = None,
          loader: Callable[[Settings], backend.Loaded] = backend.load) -> None:
    """Run the server until interrupted: print the knobs in effect, bind, load, serve."""
    settings_mod.install(settings)
    for line in settings.lines():
        print(line, flush=True)
    summary = backend.preflight(settings)  # refuses a configuration that cannot boot, before any load
    if summary:
        print(summary, flush=True)
    sock = bind(settings["HOST"], settings["PORT"])
    state = ServerState(settings, options or ServerOptions(), loader)
    app = create_app(state)
    state.start_loading()
    host, port = sock.getsockname()[:2]
    print(f"vkflash serve: listening on http://{host}:{port} (OpenAPI: /docs); loading the model", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
