"""The engine's public types: sampling parameters, the Forward protocol every backend implements
(the Vulkan forward, engine/gpu_forward.py, and the NumPy reference, engine/reference_backend.py),
the events a generation yields, engine info.

The server talks only to these types, so swapping the backend changes nothing above the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import numpy as np

from vkflash.errors import VkflashError

if TYPE_CHECKING:
    from vkflash.engine.sampling import Sampler

FinishReason = Literal["stop", "length", "cancelled", "error"]


class InvalidRequest(VkflashError):
    """A request the engine cannot run as asked (bad sampling value, prompt longer than the context)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (OpenAI / llama-server request fields).

    temperature ≤ 0 is greedy. top_k = 0, top_p = 1, min_p = 0 and penalties of 1/0/0 are off.
    Penalties look at the last `penalty_last_n` tokens of prompt + output (llama.cpp's window).
    max_tokens None: until EOS, a stop string or the context end. cache_prompt (llama-server's
    field): keep the prefix the prompt shares with the last sequence instead of prefilling it again.
    """

    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit; -inf bans)
    cache_prompt: bool = True

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "a number in 0..100"),
            ("top_p", 0.0 < self.top_p <= 1.0, "a number in (0, 1]"),
            ("top_k", self.top_k >= 0, "an integer ≥ 0"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "a number in 0..1"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "an integer ≥ 1"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "a number in (0, 10]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "a number in -2..2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "a number in -2..2"),
            ("penalty_last_n", self.penalty_last_n >= 0, "an integer ≥ 0"),
            ("seed", self.seed is None or 0 <= self.seed < 2**64, "an integer in 0..2^64-1"),
        ]
        for name, ok, accepted in checks:
            if not ok:
                raise InvalidRequest(f"{name}={getattr(self, name)!r} is out of range; accepted: {accepted}", name)
        if any(t < 0 or b != b for t, b in self.logit_bias):
            raise InvalidRequest("logit_bias: token ids ≥ 0 and numeric biases", "logit_bias")
        if len(self.stop) > 16 or any(not s for s in self.stop):
            raise InvalidRequest("stop: at most 16 non-empty strings", "stop")

    @property
    def greedy(self) -> bool:
        """Temperature 0: always the most likely token."""
        return self.temperature <= 0.0

    @property
    def adjusted(self) -> bool:
        """Penalties or a logit bias change the logits (the device's argmax alone cannot pick)."""
        return self.penalized or bool(self.logit_bias)

    @property
    def penalized(self) -> bool:
        """Any penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@runtime_checkable
class Forward(Protocol):
    """One sequence on a model: feed tokens, get next-token logits (float32[V]).

    The sequence grows by every token fed; `n_past` never exceeds `n_ctx` (the backend may raise
    if asked to). `truncate(n)` drops everything after the first n tokens (speculation rollback).
    """

    n_ctx: int
    n_vocab: int

    @property
    def n_past(self) -> int: ...

    def reset(self) -> None: ...

    def prefill(self, ids: Sequence[int]) -> np.ndarray: ...

    def decode(self, token: int) -> np.ndarray: ...

    def truncate(self, n: int) -> None: ...


@runtime_checkable
class ArgmaxForward(Forward, Protocol):
    """A Forward that can return the greedy token directly (device argmax: 4 bytes read back)."""

    def prefill_argmax(self, ids: Sequence[int]) -> int: ...

    def decode_argmax(self, token: int) -> int: ...


@runtime_checkable
class PrefixForward(Forward, Protocol):
    """A Forward that keeps the prefix a new prompt shares with its sequence (prompt reuse,
    engine/prefix.py): `reuse(ids)` keeps what it can and says how many of ids to skip (never
    all), `checkpoint()` marks the state after the tokens fed so far as a place to come back to;
    `keeps_checkpoints` says whether it keeps anything (a recurrent state, which reuse cannot cut
    at any position, and checkpoint slots for it)."""

    @property
    def keeps_checkpoints(self) -> bool: ...

    def reuse(self, ids: Sequence[int]) -> int: ...

    def checkpoint(self) -> None: ...


@runtime_checkable
class SpeculativeForward(Forward, Protocol):
    """A Forward that decodes in speculation rounds (MTP, engine/speculate.py): each round feeds one
    token and returns the tokens it produced; draft tokens proposed and accepted since the last reset."""

    drafted: int
    accepted: int

    def speculate(self, token: int, sampler: "Sampler", history: Sequence[int], limit: int) -> list[int]: ...


class TextCodec(Protocol):
    """What the engine needs of a tokenizer: streaming detokenization and end-of-generation ids."""

    def streamer(self) -> "Streamer": ...

    def is_eog(self, token_id: int) -> bool: ...


class Streamer(Protocol):
    """Incremental detokenizer: text completed by each token; never splits a UTF-8 character."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it releases (may be empty: held back for UTF-8 or stop strings)."""

    token: int
    text: str


@dataclass(frozen=True)
class Timings:
    """llama-server's `timings` object: prompt (prefill) and predicted (decode) counts and rates;
    cache_n prompt tokens reused from the last sequence (not in prompt_n: those were prefilled);
    with speculative decoding also the draft tokens proposed and accepted (None: no speculation)."""

    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    cache_n: int = 0

    def to_json(self) -> dict[str, float | int]:
        """The llama-server field set, with per-token ms and tokens per second."""
        def rate(n: int, ms: float) -> tuple[float, float]:
            return (ms / n if n else 0.0), (1000.0 * n / ms if ms > 0 else 0.0)

        p_tok, p_sec = rate(self.prompt_n, self.prompt_ms)
        d_tok, d_sec = rate(self.predicted_n, self.predicted_ms)
        out: dict[str, float | int] = {
            "cache_n": self.cache_n, "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms, "prompt_per_token_ms": p_tok,
            "prompt_per_second": p_sec, "predicted_n": self.predicted_n, "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": d_tok, "predicted_per_second": d_sec}
        if self.draft_n is not None:
            out.update(draft_n=self.draft_n, draft_n_accepted=self.draft_n_accepted or 0)
        return out


@dataclass(frozen=True)
class Finish:
    """The end of a generation: why, the text still held back, counts and timings."""

    reason: FinishReason
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Timings = field(default_factory=Timings)
    error: BaseException | None = None


@dataclass(frozen=True)
class EngineInfo:
    """What the server reports about the loaded model and backend (/v1/models, /props)."""

    model_id: str
    model_path: str
    arch: str
    backend: str
    n_ctx: int
    n_ctx_train: int
    n_vocab: int
    chat_template: str
    ubatch: int = 2048
