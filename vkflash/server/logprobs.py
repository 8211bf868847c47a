"""Token log-probabilities for `logprobs` / `top_logprobs`: log-softmax of the raw logits the
chosen token was drawn from (before penalties and temperature, as OpenAI and llama-server report),
the n most likely alternatives, and the two OpenAI response shapes (chat and legacy completions).

The engine's greedy fast path returns only the argmax token; `LogitsTap` wraps a Forward without
exposing the argmax methods, so a request that asks for log-probabilities runs on full logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vkflash.engine.api import Forward, PrefixForward, TokenEvent

MAX_TOP = 20  # OpenAI's bound on top_logprobs


class LogitsTap:
    """A Forward that remembers the last logits it returned (no argmax fast path on purpose)."""

    def __init__(self, fwd: Forward) -> None:
        self.fwd = fwd
        self.n_ctx, self.n_vocab = fwd.n_ctx, fwd.n_vocab
        self.logits: np.ndarray | None = None

    @property
    def n_past(self) -> int:
        return self.fwd.n_past

    def reset(self) -> None:
        self.logits = None
        self.fwd.reset()

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        self.logits = self.fwd.prefill(ids)
        return self.logits

    def decode(self, token: int) -> np.ndarray:
        self.logits = self.fwd.decode(token)
        return self.logits

    def truncate(self, n: int) -> None:
        self.fwd.truncate(n)

    def reuse(self, ids: Sequence[int]) -> int:
        """Prompt reuse when the wrapped forward has it (engine/prefix.py), else a new sequence."""
        self.logits = None
        if isinstance(self.fwd, PrefixForward):
            return self.fwd.reuse(ids)
        self.fwd.reset()
        return 0

    @property
    def keeps_checkpoints(self) -> bool:
        return isinstance(self.fwd, PrefixForward) and self.fwd.keeps_checkpoints

    def checkpoint(self) -> None:
        if isinstance(self.fwd, PrefixForward):
            self.fwd.checkpoint()


@dataclass(frozen=True)
class ScoredToken(TokenEvent):
    """A TokenEvent with its log-probability and the top alternatives [(id, logprob)], best first."""

    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()


def score(logits: np.ndarray, token: int, n_top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """log p(token) = z_t − max z − log Σ exp(z − max z), and the n_top best (ties: lower id first)."""
    z = logits.astype(np.float64)
    m = float(z.max())
    lse = m + float(np.log(np.exp(z - m).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        k = min(n_top, z.shape[0])
        cand = np.argpartition(-z, k - 1)[:k] if k < z.shape[0] else np.arange(z.shape[0])
        # the cut may split a tie: widen to every id tied with the k-th value, then order by (−z, id)
        cut = z[cand].min()
        cand = np.flatnonzero(z >= cut)
        order = cand[np.lexsort((cand, -z[cand]))][:k]
        top = tuple((int(i), float(z[i] - lse)) for i in order)
    return float(z[token] - lse), top


def scored(ev: TokenEvent, logits: np.ndarray, n_top: int) -> ScoredToken:
    """The event with its scores from the logits it was drawn from."""
    lp, top = score(logits, ev.token, n_top)
    return ScoredToken(ev.token, ev.text, lp, top)


Piece = Callable[[int], bytes]


def chat_entries(tokens: Sequence[ScoredToken], piece: Piece) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` of a chat completion: token, logprob, bytes, top_logprobs."""

    def one(t: int, lp: float) -> dict[str, Any]:
        b = piece(t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

    return [dict(one(s.token, s.logprob), top_logprobs=[one(i, lp) for i, lp in s.top]) for s in tokens]


def completion_logprobs(tokens: Sequence[ScoredToken], piece: Piece, offset: int = 0) -> dict[str, Any]:
    """`choices[].logprobs` of a legacy completion; text_offset counts the characters of the
    completion's text before each token, from `offset` (a character split over tokens counts at
    its last). Alternatives are keyed by text, as OpenAI does."""
    def text(t: int) -> str:
        return piece(t).decode("utf-8", errors="replace")

    def top(s: ScoredToken) -> dict[str, float]:
        d: dict[str, float] = {}
        for i, lp in s.top:
            d.setdefault(text(i), lp)  # tokens that print alike (partial UTF-8 → "�") keep the best
        return d

    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s.text)  # what the token put out: "" for a partial character
    return {"tokens": [text(s.token) for s in tokens], "token_logprobs": [s.logprob for s in tokens],
            "top_logprobs": [top(s) for s in tokens], "text_offset": offsets}
