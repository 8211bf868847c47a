"""One generation slot and a bounded queue in front of it. The engine runs in a worker thread;
its events reach the asyncio side through call_soon_threadsafe, so the event loop never blocks.

A full queue refuses at admission (QueueFull → 503); a job's abort (client disconnect) stops it
within one token, or takes it out of the queue at once if it is still waiting (a client that left
holds no place). `shutdown` (SIGINT/SIGTERM) ends the running job and every waiting one with a
ShuttingDown error, refuses new ones and lets the worker thread end, to be joined before exit.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

from vkflash.engine.api import Finish, Forward, SamplingParams, TextCodec, TokenEvent
from vkflash.engine.generate import generate
from vkflash.engine.grammar import Grammar
from vkflash.errors import DeviceError
from vkflash.server.logprobs import LogitsTap, scored


class QueueFull(Exception):
    """The slot is busy and the queue holds its maximum of waiting requests."""


class ShuttingDown(Exception):
    """The server is stopping: no new generation starts, the running one is ended."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


@dataclass(frozen=True)
class Started:
    """The job left the queue and its prefill begins."""


Event = Started | TokenEvent | Finish


@dataclass(eq=False)  # a job is itself: the queue finds and removes it by identity
class Job:
    """One admitted request: its prompt and parameters, cancel flag and event channel.

    top_logprobs: None, or how many alternatives each token reports (its TokenEvents are then
    ScoredTokens, computed from full logits). grammar: None, or the grammar the output must match.
    n_decoded: tokens delivered so far (/slots).
    """

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    top_logprobs: int | None = None
    grammar: Grammar | None = None
    checkpoint_at: int | None = None  # generate()'s: where the prompt's state is kept (None: its end)
    n_decoded: int = 0
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    on_abort: Callable[["Job"], None] | None = None

    def abort(self) -> None:
        """Stop the job (its client went away): a running one within one token, a waiting one now."""
        self.cancel.set()
        if self.on_abort is not None:
            self.on_abort(self)

    def deliver(self, ev: Event) -> None:
        """From the worker thread: hand an event to the asyncio side (dropped if the loop is gone)."""
        if isinstance(ev, TokenEvent):
            self.n_decoded += 1
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:
            self.cancel.set()

    async def stream(self) -> AsyncIterator[Event]:
        """Events until the Finish; leaving early (disconnect, error) cancels the job."""
        try:
            while True:
                ev = await self.events.get()
                yield ev
                if isinstance(ev, Finish):
                    return
        finally:
            self.abort()


class Slot:
    """The single generation slot: a worker thread fed by a queue of at most `depth` waiting jobs."""

    def __init__(self, fwd: Forward, codec: TextCodec, depth: int, ubatch: int,
                 on_finish: Callable[[Finish], None], token_delay_s: float = 0.0) -> None:
        self.fwd, self.codec, self.depth, self.ubatch = fwd, codec, depth, ubatch
        self.on_finish, self.token_delay_s = on_finish, token_delay_s
        self._cv = threading.Condition()
        self._queue: deque[Job] = deque()
        self._running: Job | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="vkflash-slot", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Jobs waiting for the slot now."""
        return len(self._queue)

    @property
    def busy(self) -> bool:
        """Whether a generation runs now."""
        return self._running is not None

    @property
    def current(self) -> Job | None:
        """The running job (/slots), if any."""
        return self._running

    def submit(self, prompt: Sequence[int], params: SamplingParams, top_logprobs: int | None = None,
               grammar: Grammar | None = None, checkpoint_at: int | None = None) -> Job:
        """Admit a job or raise QueueFull / ShuttingDown (call from the event loop)."""
        job = Job(list(prompt), params, asyncio.get_running_loop(), top_logprobs, grammar, checkpoint_at,
                  on_abort=self._withdraw)
        with self._cv:
            if self._closed:
                raise ShuttingDown
            if len(self._queue) + int(self.busy) >= 1 + self.depth:
                raise QueueFull
            self._queue.append(job)
            self._cv.notify()
        return job

    def _withdraw(self, job: Job) -> None:
        """Take an aborted job out of the queue if it still waits there, and finish it as cancelled."""
        with self._cv:
            if job not in self._queue:
                return
            self._queue.remove(job)
        self._finish(job, Finish("cancelled", prompt_tokens=len(job.prompt)))

    def kv_fill(self) -> float:
        """Fraction of the context the slot's sequence occupies now."""
        return self.fwd.n_past / self.fwd.n_ctx if self.busy else 0.0

    def shutdown(self, running: bool = True) -> None:
        """Refuse new jobs, end every waiting one with ShuttingDown, and the running one too unless
        `running` is False (a drain: it runs to its end); the worker thread then ends (join it with
        `join`)."""
        with self._cv:
            self._closed = True
            dropped, self._queue = list(self._queue), deque()
            if running and self._running is not None:
                self._running.cancel.set()
            self._cv.notify_all()
        for job in dropped:
            self._finish(job, Finish("error", prompt_tokens=len(job.prompt), error=ShuttingDown()))

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker thread to end (after `shutdown`); whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                self._running = job = self._queue.popleft()
            try:
                self._serve(job)
            finally:
                with self._cv:
                    self._running = None

    def _finish(self, job: Job, fin: Finish) -> None:
        """Count a job's Finish, free the slot, then hand the Finish to its client (exactly once per
        job): as in llama-server, /metrics and /slots read right after the response show it idle."""
        self.on_finish(fin)
        with self._cv:
            if self._running is job:
                self._running = None
        job.deliver(fin)

    def _serve(self, job: Job) -> None:
        """Run one job to its Finish (always delivered exactly once)."""
        if job.cancel.is_set():
            fin = Finish("cancelled", prompt_tokens=len(job.prompt))
        else:
            job.deliver(Started())
            fin = Finish("error", error=RuntimeError("generation ended without a finish"))
            tap = LogitsTap(self.fwd) if job.top_logprobs is not None else None
            try:
                constraint = job.grammar.constraint() if job.grammar is not None else None
                for ev in generate(tap or self.fwd, self.codec, job.prompt, job.params, job.cancel, self.ubatch,
                                   constraint=constraint, checkpoint_at=job.checkpoint_at):
                    if isinstance(ev, Finish):
                        fin = ev
                        break
                    if tap is not None and tap.logits is not None:
                        # generate yields a token before computing the next logits: these are its own
                        ev = scored(ev, tap.logits, job.top_logprobs or 0)
                    job.deliver(ev)
                    if self.token_delay_s:
                        time.sleep(self.token_delay_s)
            except Exception as e:  # noqa: BLE001 — reported to the client, never kills the worker
                fin = Finish("error", prompt_tokens=len(job.prompt), error=e)
        if fin.reason == "cancelled" and self._closed:
            fin = replace(fin, reason="error", error=ShuttingDown())
        self._finish(job, fin)


def is_device_loss(fin: Finish) -> bool:
    """A Finish caused by the device going away (the server must then report itself unhealthy)."""
    return fin.reason == "error" and isinstance(fin.error, DeviceError)
