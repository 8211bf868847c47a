"""The HTTP server: FastAPI app on uvicorn (OpenAPI schema at /openapi.json), the API-key gate,
request counting, llama-server's /health /metrics /props /tokenize /detokenize, and `serve`.

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
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import vkflash
from vkflash import settings as settings_mod
from vkflash.engine.api import InvalidRequest
from vkflash.errors import ConfigError
from vkflash.progress import Steps
from vkflash.server import backend
from vkflash.server.errors import ApiError, validation_error
from vkflash.server.openai_api import make_router
from vkflash.server.schemas import DetokenizeRequest, TokenizeRequest
from vkflash.server.state import ServerOptions, ServerState
from vkflash.settings import Settings

PUBLIC_PATHS = frozenset({"/health", "/openapi.json", "/docs"})
KNOWN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/props",
                         "/tokenize", "/detokenize", "/openapi.json", "/docs"})


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

    @app.get("/props", summary="Server and model properties (llama-server style)")
    async def props() -> JSONResponse:
        i = state.ready().info
        s = state.settings
        return JSONResponse({
            "default_generation_settings": {"n_ctx": i.n_ctx, "params": {"temperature": s["TEMP"]}},
            "total_slots": 1, "queue_depth": state.options.queue_depth, "model_path": i.model_path,
            "model_alias": i.model_id, "arch": i.arch, "backend": i.backend, "n_vocab": i.n_vocab,
            "n_ctx_train": i.n_ctx_train, "chat_template": i.chat_template, "reasoning": s["REASONING"] or "default",
            "build_info": f"vkflash {vkflash.__version__}", "modalities": {"vision": False, "audio": False}})

    @app.post("/tokenize", summary="Text → token ids (special tokens in the text are parsed)")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        tok = state.ready().tokenizer
        ids = await run_in_threadpool(tok.encode, req.content, req.add_special, True)
        if req.with_pieces:
            return JSONResponse({"tokens": [{"id": t, "piece": tok.decode([t], special=True)} for t in ids]})
        return JSONResponse({"tokens": ids})

    @app.post("/detokenize", summary="Token ids → text")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        loaded = state.ready()
        bad = [t for t in req.tokens if not 0 <= t < loaded.tokenizer.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary 0..{loaded.tokenizer.vocab_size - 1}",
                           param="tokens")
        return JSONResponse({"content": loaded.tokenizer.decode(req.tokens, special=True)})

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        slot = state.slot
        fwd = state.loaded.fwd if state.loaded else None
        gauges = {
            "healthy": ("1 when the server can generate", float(state.health.status == "ok")),
            "queue_depth": ("requests waiting for the slot", float(slot.waiting if slot else 0)),
            "queue_capacity": ("requests that may wait", float(state.options.queue_depth)),
            "slot_busy": ("1 while a generation runs", float(slot.busy if slot else 0)),
            "kv_fill_ratio": ("fraction of the context in use", slot.kv_fill() if slot else 0.0),
            "guard_tier": ("deep-context guard steps in force (0: none)", float(getattr(fwd, "guard_tier", 0))),
            **_memory_gauges(fwd),
        }
        return PlainTextResponse(state.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    return Gate(app, state)


def _memory_gauges(fwd: Any) -> dict[str, tuple[str, float]]:
    """Memory held against the budget and what the guard's steps returned (GPU forward only)."""
    guard = getattr(fwd, "guard", None)
    if guard is None:
        return {}
    return {"guard_freed_bytes": ("bytes the deep-context guard's steps returned", float(guard.freed)),
            "memory_bytes": ("bytes held against the memory budget", float(fwd.gpu.ledger.total)),
            "memory_budget_bytes": ("the memory budget", float(guard.budget.nbytes))}


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
    app = create_app(state)
    print(f"vkflash serve: listening on {url} (OpenAPI: /docs); loading the model", flush=True)
    state.start_loading()
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
