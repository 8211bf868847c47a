"""Server test helpers: real server processes on free loopback ports, an in-process server over
any state, and a small JSON-over-HTTP client (stdlib only)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vkflash.bench.serve import free_port, stop_process

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Reply:
    """Status, headers and decoded body of one HTTP exchange."""

    status: int
    headers: dict[str, str]
    body: Any


def call(base: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None, timeout: float = 60) -> Reply:
    """One request; JSON in (body) or raw bytes; JSON (or text) out; never raises on 4xx/5xx."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, hdrs, text = e.code, dict(e.headers), e.read().decode()
    try:
        parsed: Any = json.loads(text)
    except json.JSONDecodeError:
        parsed = text
    return Reply(status, {k.lower(): v for k, v in hdrs.items()}, parsed)


@dataclass
class Server:
    """A running `python -m vkflash.server` process."""

    base: str
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def wait_health(base: str, want: int, proc: subprocess.Popen | None = None, timeout: float = 90) -> Reply:
    """Poll /health until it answers `want` (or fail with what it said)."""
    end, last = time.monotonic() + timeout, None
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}")
        try:
            last = call(base, "GET", "/health", timeout=5)
            if last.status == want:
                return last
        except (urllib.error.URLError, ConnectionError, socket.timeout):
            pass
        time.sleep(0.1)
    raise AssertionError(f"/health never answered {want}; last: {last}")


def start_server(tmp: Path, env: dict[str, str], args: list[str] = (), want_health: int = 200,
                 port: int | None = None) -> Server:
    """Start a server process with these knobs (on `port`, else a free one) and wait until /health
    says `want_health`.

    The backend is the NumPy reference unless `env` names another: these tests check the server
    exactly against the reference (tests/engine checks the GPU forward against it)."""
    port = port or free_port()
    log = tmp / f"server-{port}-{time.monotonic_ns()}.log"
    full_env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "CTX", "API_KEY", "TEMP", "PORT", "HOST")}
    full_env.update({"VKFLASH_BACKEND": "reference", **env}, PORT=str(port), HOST="127.0.0.1", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "vkflash.server", *args], cwd=ROOT, env=full_env,
                                stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_health(base, want_health, proc)
    except AssertionError as e:
        proc.kill()
        raise AssertionError(f"{e}\n--- server output ---\n{log.read_text()}") from None
    return Server(base, proc, log)


def stop_server(s: Server) -> None:
    """SIGTERM, then wait (kill if it hangs)."""
    stop_process(s.proc, 15)


@dataclass
class InProcess:
    """A server running in this process (uvicorn in a thread) over a given state."""

    base: str
    state: Any
    server: Any
    thread: threading.Thread


def start_in_process(state: Any) -> InProcess:
    """Serve `state` on a free loopback port from a thread (its model loads in the background);
    returns once /health answers at all. The caller must call stop_in_process."""
    import uvicorn

    from vkflash.server.app import Server, bind, create_app

    sock = bind("127.0.0.1", 0)
    server = Server(uvicorn.Config(create_app(state), log_level="warning", lifespan="off"), state)
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    state.start_loading()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    end = time.monotonic() + 30
    while True:
        try:
            call(base, "GET", "/health", timeout=5)
            break
        except (urllib.error.URLError, ConnectionError, socket.timeout):
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
    return InProcess(base, state, server, t)


def stop_in_process(p: InProcess) -> None:
    """Stop the server as `vkflash serve` does (its shutdown ends the slot's worker), then wait for the
    model load and the worker (ServerState.close): a worker left waiting would hold its forward (GPU
    memory) for the rest of the test session."""
    p.server.should_exit = True
    p.thread.join(timeout=10)
    assert p.state.close(timeout=30), "the server's engine thread did not stop"
