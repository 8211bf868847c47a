"""The server's shared state: settings, health (loading → ok, or failed with a reason), the
loaded model and its slot, metrics. Loading runs in a thread so /health answers from the start.

`stop` (the server was told to exit) makes every new request a 503 and ends the slot's jobs;
`close` then waits for the loader and the worker thread, so no engine thread still runs while
the interpreter tears the GPU objects down.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from vkflash.engine.api import Finish
from vkflash.engine.grammar import ll_tokenizer
from vkflash.errors import VkflashError
from vkflash.server.backend import Loaded
from vkflash.server.errors import ApiError
from vkflash.server.metrics import Metrics
from vkflash.server.slot import ShuttingDown, Slot, is_device_loss
from vkflash.settings import Settings


@dataclass(frozen=True)
class ServerOptions:
    """Server settings that are not (yet) knobs: queue depth, and a per-token delay for tests."""

    queue_depth: int = 8
    token_delay_s: float = 0.0


@dataclass
class Health:
    """What /health reports: loading, ok, or failed (failed load or lost device) with the reason."""

    status: Literal["loading", "ok", "failed"] = "loading"
    reason: str = ""


@dataclass
class ServerState:
    """Everything the request handlers share."""

    settings: Settings
    options: ServerOptions
    loader: Callable[[Settings], Loaded]
    metrics: Metrics = field(default_factory=Metrics)
    health: Health = field(default_factory=Health)
    loaded: Loaded | None = None
    slot: Slot | None = None
    on_load_failure: Callable[[str], None] | None = None  # set: a failed load ends the server (it reports)
    stopping: bool = False
    _loader_thread: threading.Thread | None = field(default=None, init=False, repr=False)

    def start_loading(self) -> threading.Thread:
        """Load the model in a background thread; the outcome lands in `health`."""
        t = self._loader_thread = threading.Thread(target=self._load, name="vkflash-load", daemon=True)
        t.start()
        return t

    def _load(self) -> None:
        try:
            loaded = self.loader(self.settings)
        except VkflashError as e:
            self._load_failed(f"model load failed: {e}")
            return
        except Exception as e:  # anything else must still end "loading", never leave it hanging
            self._load_failed(f"model load failed: {type(e).__name__}: {e}")
            return
        self.slot = Slot(loaded.fwd, loaded.tokenizer, self.options.queue_depth, loaded.info.ubatch,
                         self.on_finish, self.options.token_delay_s)
        self.metrics.ubatch = loaded.info.ubatch
        # structured output's view of the vocabulary takes seconds on a real one: build it now
        threading.Thread(target=ll_tokenizer, args=(loaded.tokenizer, loaded.info.n_vocab), name="vkflash-llg",
                         daemon=True).start()
        self.loaded = loaded
        self.health = Health("ok")

    def _load_failed(self, reason: str) -> None:
        """Unhealthy for good; the owner's hook, if any, stops the server (else say why here)."""
        if self.on_load_failure is None:
            self.fail(reason)
        else:
            self.health = Health("failed", reason)
            self.on_load_failure(reason)

    def stop(self) -> None:
        """The server is exiting: new requests get 503, the slot's jobs end (call from the event loop)."""
        self.stopping = True
        if self.slot is not None:
            self.slot.shutdown()

    def drain(self) -> None:
        """The server is told to exit but lets the running generation finish: /health and new and
        waiting requests get 503 from now on (call from the event loop; `stop` ends the rest)."""
        self.stopping = True
        if self.slot is not None:
            self.slot.shutdown(running=False)

    def close(self, timeout: float = 30.0) -> bool:
        """After `stop`: wait for the model load and the worker thread to end; whether they did."""
        if self._loader_thread is not None:
            self._loader_thread.join(timeout)
        if self.slot is None:
            return self._loader_thread is None or not self._loader_thread.is_alive()
        self.slot.shutdown()  # a load that finished after `stop` started a worker
        return self.slot.join(timeout)

    def fail(self, reason: str) -> None:
        """Mark the server unhealthy for good (a failed load or a lost device)."""
        self.health = Health("failed", reason)
        print(f"error: {reason}", file=sys.stderr, flush=True)

    def on_finish(self, fin: Finish) -> None:
        """Worker-thread hook: count the generation; a lost device makes the server unhealthy."""
        self.metrics.finish(fin)
        if is_device_loss(fin):
            self.fail(f"device lost: {fin.error}")

    def ready(self) -> Loaded:
        """The loaded model, or a 503 saying why there is none."""
        h = self.health
        if self.stopping:
            raise ApiError(503, str(ShuttingDown()), code="shutting_down")
        if h.status == "loading":
            raise ApiError(503, "the model is still loading", code="loading", headers={"Retry-After": "2"})
        if h.status == "failed" or self.loaded is None:
            raise ApiError(503, f"the server is unhealthy: {h.reason}", code="unhealthy")
        return self.loaded
