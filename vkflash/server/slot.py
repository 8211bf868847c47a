"""One generation slot and a bounded queue in front of it. The engine runs in a worker thread;
its events reach the asyncio side through call_soon_threadsafe, so the event loop never blocks.

A full queue refuses at admission (QueueFull → 503); a job's cancel event (set on client
disconnect) stops it within one token, or skips it if it is still waiting.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from vkflash.engine.api import Finish, Forward, SamplingParams, TextCodec, TokenEvent
from vkflash.engine.generate import generate
from vkflash.engine.grammar import Grammar
from vkflash.errors import DeviceError
from vkflash.server.logprobs import LogitsTap, scored


class QueueFull(Exception):
    """The slot is busy and the queue holds its maximum of waiting requests."""


@dataclass(frozen=True)
class Started:
    """The job left the queue and its prefill begins."""


Event = Started | TokenEvent | Finish


@dataclass
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
    n_decoded: int = 0
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

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
            self.cancel.set()


class Slot:
    """The single generation slot: a worker thread fed by a queue of at most `depth` waiting jobs."""

    def __init__(self, fwd: Forward, codec: TextCodec, depth: int, ubatch: int,
                 on_finish: Callable[[Finish], None], token_delay_s: float = 0.0) -> None:
        self.fwd, self.codec, self.depth, self.ubatch = fwd, codec, depth, ubatch
        self.on_finish, self.token_delay_s = on_finish, token_delay_s
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.busy = False
        self.current: Job | None = None
        self._thread = threading.Thread(target=self._run, name="vkflash-slot", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams, top_logprobs: int | None = None,
               grammar: Grammar | None = None) -> Job:
        """Admit a job or raise QueueFull (call from the event loop)."""
        job = Job(list(prompt), params, asyncio.get_running_loop(), top_logprobs, grammar)
        with self._lock:
            if self.waiting + int(self.busy) >= 1 + self.depth:
                raise QueueFull
            self.waiting += 1
        self._q.put(job)
        return job

    def kv_fill(self) -> float:
        """Fraction of the context the slot's sequence occupies now."""
        return self.fwd.n_past / self.fwd.n_ctx if self.busy else 0.0

    def close(self) -> None:
        """Stop the worker after the current job."""
        self._q.put(None)

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            with self._lock:
                self.waiting -= 1
                self.busy = True
                self.current = job
            try:
                self._serve(job)
            finally:
                with self._lock:
                    self.busy = False
                    self.current = None

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
                                   constraint=constraint):
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
        self.on_finish(fin)
        job.deliver(fin)


def is_device_loss(fin: Finish) -> bool:
    """A Finish caused by the device going away (the server must then report itself unhealthy)."""
    return fin.reason == "error" and isinstance(fin.error, DeviceError)
