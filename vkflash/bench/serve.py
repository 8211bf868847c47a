"""`vkflash bench serve`: what HTTP costs. The real server process (`python -m vkflash.server` on a
free loopback port) is timed through a raw-socket streaming client, then the same Forward the
server builds (`server.backend.load`) is driven in this process with `engine.generate`, on the
same prompt ids and greedy settings.

TTFT is the time to the first visible text (request sent → first SSE chunk with text; generate
called → first TokenEvent with text). Decode rate is (n − 1) / (end − first), n the generated
tokens and end the finish (finish chunk / Finish event). Overheads are HTTP over in-process, in %.
Each figure is the median of `reps` runs after one warm-up run (shader compiles, caches), with its
spread (min–max over the runs); the overheads are the medians' ratios. These runs send
cache_prompt false, so every one prefills its whole prompt.

The agent exchange: a coding agent resends a long prefix with a short new turn. Turn 1 is the
long prompt, turn 2 the same plus `short` new tokens; turn 2's TTFT through the server with prompt
reuse (cache_prompt true: only the new tokens and whatever lies past the checkpoint it restarts
from are prefilled; timings.cache_n says how many were kept) and without (cache_prompt false).
Without --quick the sizes are the small ones anyway on a CPU device (lavapipe) or the NumPy
reference backend, where the full ones take minutes.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from vkflash import settings as settings_mod
from vkflash.engine.api import Finish, SamplingParams, TokenEvent
from vkflash.engine.generate import generate
from vkflash.errors import ConfigError
from vkflash.model.tokenizer import Tokenizer
from vkflash.model.hparams import hparams_from_gguf

# plain English to cut prompts from (any text works; this one tokenizes like a real request)
PROSE = ("The server reads a request, renders the prompt, and hands the token ids to a single generation slot. "
         "The engine fills the cache with the prompt in large batches, then produces one token at a time; "
         "each token is detokenized, checked against the stop rules and sent to the client as its own event. ")


@dataclass(frozen=True)
class Sizes:
    """Prompt lengths (tokens), tokens generated per run, measured runs per figure."""

    short: int
    long: int
    gen: int
    reps: int


FULL, QUICK = Sizes(32, 1024, 64, 3), Sizes(8, 64, 8, 1)


def default_sizes(s: settings_mod.Settings, arch: str) -> Sizes:
    """FULL, except QUICK where a run would crawl: the NumPy reference backend or a CPU device."""
    from vkflash.gpu.device import probe
    from vkflash.server.backend import uses_gpu

    if not uses_gpu(s, arch):
        return QUICK
    return QUICK if probe(int(s["VKFLASH_DEVICE"])).device_type == "cpu" else FULL


@dataclass(frozen=True)
class Sample:
    """One generation's timing: seconds to first text, seconds from it to the finish, tokens made."""

    ttft_s: float
    decode_s: float
    n: int

    @property
    def tok_s(self) -> float:
        """Decode rate after the first visible token."""
        return (self.n - 1) / self.decode_s if self.n > 1 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Spread:
    """A figure over repeated runs: median, min and max."""

    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        return cls(statistics.median(values), min(values), max(values))

    def show(self, digits: int) -> str:
        """`median (min–max)`, for the table."""
        return f"{self.median:.{digits}f} ({self.lo:.{digits}f}–{self.hi:.{digits}f})"


@dataclass
class Row:
    """One prompt's figures (medians), in-process vs HTTP, and each one's spread over the runs."""

    prompt: str
    prompt_tokens: int
    gen_tokens: int
    ttft_ms_engine: float
    ttft_ms_http: float
    ttft_overhead_pct: float
    tok_s_engine: float
    tok_s_http: float
    per_token_overhead_pct: float
    spread: dict[str, tuple[float, float]]


def prompt_ids(tok: Tokenizer, n: int) -> list[int]:
    """The first n token ids of enough repeated PROSE."""
    text = PROSE
    while len(ids := tok.encode(text)) < n:
        text += PROSE
    return ids[:n]


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then wait; kill if it has not exited within timeout_s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ServerProcess:
    """`python -m vkflash.server` with this environment (its knobs) on a free loopback port, its
    output in a file."""

    def __init__(self, env: dict[str, str], timeout_s: float) -> None:
        self.port = free_port()
        fd, name = tempfile.mkstemp(prefix="vkflash-bench-serve-", suffix=".log")
        os.close(fd)
        self.log = Path(name)
        full = {**env, "HOST": "127.0.0.1", "PORT": str(self.port), "PYTHONUNBUFFERED": "1"}
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "vkflash.server"], env=full, stdout=f,
                                         stderr=subprocess.STDOUT)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise ConfigError(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                status, body = http_get("127.0.0.1", self.port, "/health")
                if status == 200:
                    return
                if b'"failed"' in body:
                    raise ConfigError(f"the server could not load the model:\n{self.tail()}")
            except OSError:
                pass
            time.sleep(0.2)
        raise ConfigError(f"the server was not ready within {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 15) -> str:
        """The last lines the server printed."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """SIGTERM, then kill if it hangs; the log file goes too."""
        stop_process(self.proc, 15)
        self.log.unlink(missing_ok=True)


def http_get(host: str, port: int, path: str) -> tuple[int, bytes]:
    """Status and body of one GET (Connection: close)."""
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _body(s: socket.socket, buf: bytes, chunked: bool) -> Iterator[bytes]:
    """The response body as it arrives, de-chunked (HTTP/1.1 chunked or close-delimited)."""
    def more() -> bytes:
        data = s.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection mid-response")
        return data

    if not chunked:
        if buf:
            yield buf
        while data := s.recv(65536):
            yield data
        return
    while True:
        while b"\r\n" not in buf:
            buf += more()
        line, buf = buf.split(b"\r\n", 1)
        size = int(line.split(b";")[0], 16)
        if size == 0:
            return
        while len(buf) < size + 2:
            buf += more()
        yield buf[:size]
        buf = buf[size + 2:]


def sse_completion(port: int, body: dict) -> Iterator[tuple[float, dict]]:
    """POST a streamed /v1/completions over a plain socket; (arrival time, event) per SSE event."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=600) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = s.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection before answering")
            buf += data
        head, buf = buf.split(b"\r\n\r\n", 1)
        status = int(head.split(b" ", 2)[1])
        chunked = b"transfer-encoding: chunked" in head.lower()
        if status != 200:
            raise ConfigError(f"the server answered {status}: {b''.join(_body(s, buf, chunked)).decode()}")
        events = b""
        for piece in _body(s, buf, chunked):
            now = time.perf_counter()
            events += piece
            while b"\n\n" in events:
                ev, events = events.split(b"\n\n", 1)
                if ev.startswith(b":"):
                    continue  # an SSE comment: the keep-alive of a long prefill (SSE_KEEPALIVE)
                data = ev.decode().removeprefix("data: ")
                if data != "[DONE]":
                    yield now, json.loads(data)


@dataclass(frozen=True)
class Agent:
    """Turn 2 of the agent exchange: its TTFT with prompt reuse and without, the tokens reused."""

    prefix_tokens: int
    new_tokens: int
    cache_n: int
    ttft_ms_reuse: float
    ttft_ms_cold: float

    @property
    def speedup(self) -> float:
        """How many times sooner the first token comes with reuse."""
        return self.ttft_ms_cold / self.ttft_ms_reuse if self.ttft_ms_reuse > 0 else float("nan")


def http_sample(port: int, ids: list[int], gen: int, cache_prompt: bool = False) -> Sample:
    """One greedy streamed completion through the server (cache_prompt false: a whole prefill)."""
    return http_run(port, ids, gen, cache_prompt)[0]


def http_run(port: int, ids: list[int], gen: int, cache_prompt: bool) -> tuple[Sample, int]:
    """One greedy streamed completion through the server; its timing and timings.cache_n."""
    t0 = time.perf_counter()
    first = end = None
    n = cache_n = 0
    for t, ev in sse_completion(port, {"prompt": ids, "max_tokens": gen, "temperature": 0, "ignore_eos": True,
                                       "stream": True, "cache_prompt": cache_prompt}):
        if "error" in ev:
            raise ConfigError(f"the server failed: {ev['error'].get('message')}")
        choice = ev["choices"][0]
        if first is None and choice["text"]:
            first = t
        if choice["finish_reason"] is not None:
            end, n, cache_n = t, ev["usage"]["completion_tokens"], ev["timings"]["cache_n"]
    if first is None or end is None:
        raise ConfigError("the server's stream had no text or no finish")
    return Sample(first - t0, end - first, n), cache_n


def agent_exchange(port: int, prefix: list[int], new: list[int], gen: int, reps: int) -> Agent:
    """Turn 2 (prefix + new) right after turn 1 (prefix), with reuse and without: median TTFTs
    over reps pairs after one warm-up pair."""
    def pair() -> tuple[float, float, int]:
        http_run(port, prefix, gen, False)
        reuse, cache_n = http_run(port, prefix + new, gen, True)
        http_run(port, prefix, gen, False)
        cold, _ = http_run(port, prefix + new, gen, False)
        return reuse.ttft_s, cold.ttft_s, cache_n

    pair()
    runs = [pair() for _ in range(reps)]
    return Agent(len(prefix), len(new), runs[-1][2], 1e3 * statistics.median(r[0] for r in runs),
                 1e3 * statistics.median(r[1] for r in runs))


def engine_sample(fwd, tok: Tokenizer, ids: list[int], gen: int, ubatch: int) -> Sample:
    """One greedy generation with engine.generate in this process."""
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True, cache_prompt=False)
    t0 = time.perf_counter()
    first = end = None
    n = 0
    for ev in generate(fwd, tok, ids, params, ubatch=ubatch):
        t = time.perf_counter()
        if isinstance(ev, TokenEvent):
            if first is None and ev.text:
                first = t
        elif isinstance(ev, Finish):
            if ev.reason == "error":
                raise ev.error or ConfigError("generation failed")
            end, n = t, ev.completion_tokens
    if first is None or end is None:
        raise ConfigError("the generation produced no text")
    return Sample(first - t0, end - first, n)


def repeated(run, reps: int) -> list[Sample]:
    """Warm up once, then reps timed runs."""
    run()
    return [run() for _ in range(reps)]


def figures(samples: list[Sample]) -> dict[str, Spread]:
    """TTFT (ms) and decode rate (tok/s) over the runs."""
    return {"ttft_ms": Spread.of([x.ttft_s * 1e3 for x in samples]), "tok_s": Spread.of([x.tok_s for x in samples])}


def overhead_pct(http: float, engine: float) -> float:
    """How much longer HTTP took, in % of the in-process time."""
    return 100.0 * (http - engine) / engine if engine > 0 else float("nan")


def measure(model: str | None, sizes: Sizes | None, load_timeout_s: float = 900.0, reps: int | None = None) -> dict:
    """Both measurements and the agent exchange on one model (sizes None: default_sizes; reps
    overrides their runs per figure); the result as a JSON-ready dict (model, backend, rows, agent)."""
    from vkflash.server import backend

    env = {k: v for k, v in os.environ.items() if k not in ("HOST", "PORT", "API_KEY")}
    if model:
        env["MODEL"] = model
    s = settings_mod.load(env=env)
    path = backend.model_path(s)
    hp = hparams_from_gguf(path)
    n_ctx = s["CTX"] or hp.n_ctx_train
    sizes = sizes or default_sizes(s, hp.arch)
    if reps:
        sizes = replace(sizes, reps=reps)
    long_n = min(sizes.long, n_ctx - sizes.gen - sizes.short - 1)
    if long_n <= sizes.short:
        raise ConfigError(f"{path.name}: a context of {n_ctx} tokens is too small for this benchmark")
    if not s["CTX"]:
        env["CTX"] = str(long_n + sizes.short + sizes.gen + 1)
    env["MODEL"] = str(path)
    s = settings_mod.load(env=env)
    tok = Tokenizer.from_gguf(path)
    prompts = {"short": prompt_ids(tok, sizes.short), "long": prompt_ids(tok, long_n)}
    new_turn = prompt_ids(tok, long_n + sizes.short)[long_n:]

    server = ServerProcess(env, load_timeout_s)
    try:
        _, props = http_get("127.0.0.1", server.port, "/props")
        http = {name: repeated(lambda ids=ids: http_sample(server.port, ids, sizes.gen), sizes.reps)
                for name, ids in prompts.items()}
        agent = agent_exchange(server.port, prompts["long"], new_turn, sizes.gen, sizes.reps)
    finally:
        server.stop()

    settings_mod.install(s)
    loaded = backend.load(s)
    engine = {name: repeated(lambda ids=ids: engine_sample(loaded.fwd, loaded.tokenizer, ids, sizes.gen,
                                                           loaded.info.ubatch), sizes.reps)
              for name, ids in prompts.items()}
    rows = []
    for name, ids in prompts.items():
        e, h = figures(engine[name]), figures(http[name])
        rows.append(Row(name, len(ids), http[name][0].n, e["ttft_ms"].median, h["ttft_ms"].median,
                        overhead_pct(h["ttft_ms"].median, e["ttft_ms"].median), e["tok_s"].median,
                        h["tok_s"].median, overhead_pct(1 / h["tok_s"].median if h["tok_s"].median else 0,
                                                        1 / e["tok_s"].median if e["tok_s"].median else 0),
                        {f"{k}_{via}": (f.lo, f.hi) for via, fig in (("engine", e), ("http", h))
                         for k, f in fig.items()}))
    return {"model": path.name, "backend": loaded.info.backend, "server_backend": json.loads(props).get("backend"),
            "ctx": s["CTX"], "gen_tokens": sizes.gen, "reps": sizes.reps, "rows": [asdict(r) for r in rows],
            "agent": {**asdict(agent), "speedup": agent.speedup}}


def run(model: str | None, quick: bool, as_json: bool, console: Console, reps: int | None = None) -> None:
    """Measure (`reps` runs per figure; default 3, 1 at the small sizes) and print tables (or JSON)."""
    res = measure(model, QUICK if quick else None, reps=reps)
    if as_json:
        print(json.dumps(res, indent=1))
        return
    t = Table(title=f"bench serve: {res['model']} ({res['backend']}), CTX {res['ctx']}, {res['gen_tokens']} tokens "
                    f"out; median (min–max) of {res['reps']}", box=box.SIMPLE_HEAD)
    for c in ("prompt", "in", "via", "TTFT ms", "tok/s"):
        t.add_column(c, justify="left" if c in ("prompt", "via") else "right")
    for r in res["rows"]:
        sp = r["spread"]
        for via, label in (("engine", "engine"), ("http", "HTTP")):
            ttft = Spread(r[f"ttft_ms_{via}"], *sp[f"ttft_ms_{via}"])
            rate = Spread(r[f"tok_s_{via}"], *sp[f"tok_s_{via}"])
            t.add_row(r["prompt"] if via == "engine" else "", str(r["prompt_tokens"]) if via == "engine" else "",
                      label, ttft.show(1), rate.show(1))
        t.add_row("", "", "HTTP +%", f"{r['ttft_overhead_pct']:+.1f}", f"{r['per_token_overhead_pct']:+.1f} per token",
                  end_section=True)
    console.print(t)
    a = res["agent"]
    t = Table(title="agent exchange: turn 2 = turn 1 + a short turn, TTFT via HTTP", box=box.SIMPLE_HEAD)
    for c in ("prefix", "new", "reused", "TTFT ms reuse", "TTFT ms cold", "speedup"):
        t.add_column(c, justify="right")
    t.add_row(str(a["prefix_tokens"]), str(a["new_tokens"]), str(a["cache_n"]), f"{a['ttft_ms_reuse']:.1f}",
              f"{a['ttft_ms_cold']:.1f}", f"{a['speedup']:.2f}×")
    console.print(t)
