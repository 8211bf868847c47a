"""Scripted forwards for server tests: the greedy output is a given token script (then the end
token), optionally on random logits that the test can read back, optionally with the device
argmax fast path; and an in-process server over one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harness import start_in_process, wait_health

from vkflash import settings
from vkflash.engine.api import EngineInfo
from vkflash.errors import DeviceError
from vkflash.model.tokenizer import read_tokenizer_meta
from vkflash.server.backend import Loaded
from vkflash.server.state import ServerOptions, ServerState


class ScriptedForward:
    """Greedy output is `script` (then the end token); decode number `lose_at` raises DeviceError.

    Logits are one-hot, or with `rng` random normal with the scripted token lifted above the rest;
    every logits vector handed out is kept in `given` (in order).
    """

    def __init__(self, script: Sequence[int], eos: int, V: int, n_ctx: int, lose_at: int | None = None,
                 rng: np.random.Generator | None = None) -> None:
        self.script, self.eos, self.n_vocab, self.n_ctx, self.lose_at = list(script), eos, V, n_ctx, lose_at
        self.rng = rng
        self.given: list[np.ndarray] = []
        self._n, self._k = 0, 0

    @property
    def n_past(self) -> int:
        return self._n

    def reset(self) -> None:
        self._n, self._k = 0, 0
        self.given = []

    def _target(self) -> int:
        return self.script[self._k] if self._k < len(self.script) else self.eos

    def _next(self) -> np.ndarray:
        t = self._target()
        if self.rng is None:
            z = np.zeros(self.n_vocab, np.float32)
            z[t] = 1.0
        else:
            z = self.rng.normal(0.0, 2.0, self.n_vocab).astype(np.float32)
            z[t] = z.max() + np.float32(self.rng.uniform(0.01, 3.0))
        self.given.append(z)
        return z

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        self._n += len(ids)
        return self._next()

    def decode(self, token: int) -> np.ndarray:
        self._k += 1
        if self.lose_at is not None and self._k >= self.lose_at:
            raise DeviceError("vkQueueSubmit: VK_ERROR_DEVICE_LOST")
        self._n += 1
        return self._next()

    def truncate(self, n: int) -> None:
        self._n = min(self._n, n)


class ArgmaxScripted(ScriptedForward):
    """The same script with the device fast path: argmax calls return the token, no logits."""

    argmax_calls = 0

    def prefill_argmax(self, ids: Sequence[int]) -> int:
        self.argmax_calls += 1
        self._n += len(ids)
        return self._target()

    def decode_argmax(self, token: int) -> int:
        self.argmax_calls += 1
        self._k += 1
        self._n += 1
        return self._target()


def serve_scripted(in_process: list, tiny_model, tokenizer, fwd: ScriptedForward, template: str | None = None,
                   env: dict[str, str] | None = None) -> str:
    """Serve `fwd` in this process with the tiny model's tokenizer (and knobs `env`); the base URL once healthy."""
    tpl = template or read_tokenizer_meta(tiny_model)["tokenizer.chat_template"]
    info = EngineInfo("scripted", str(tiny_model), "qwen4exp", "scripted", fwd.n_ctx, fwd.n_ctx,
                      tokenizer.vocab_size, tpl)
    state = ServerState(settings.load(env=env or {}), ServerOptions(queue_depth=1),
                        lambda s: Loaded(fwd, tokenizer, info))
    p = start_in_process(state)
    in_process.append(p)
    wait_health(p.base, 200)
    return p.base


def openai_client(base: str):
    """The official client against a test server."""
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)


class SpeculativeScripted(ArgmaxScripted):
    """The script in speculation rounds (a SpeculativeForward): each round returns up to 3 tokens,
    counting 3 drafted and all but the last accepted."""

    drafted = accepted = 0

    def reset(self) -> None:
        super().reset()
        self.drafted = self.accepted = 0

    def speculate(self, token: int, sampler, history: Sequence[int], limit: int) -> list[int]:
        out = []
        for _ in range(min(3, limit)):
            self._k += 1
            self._n += 1
            out.append(self._target())
        self.drafted += 3
        self.accepted += len(out) - 1
        return out
