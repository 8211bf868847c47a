"""Host-side token selection from logits: penalties and logit bias, then temperature, top-k, top-p,
min-p, then a draw from a per-request seeded generator (same seed + same logits → same tokens).

Order: penalties on raw logits → + logit bias → z/T → keep top-k → keep the smallest set with mass
≥ top_p → drop tokens with p < min_p·p_max → renormalise and draw. Greedy (T = 0) is argmax after
penalties and bias.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from vkflash.engine.api import SamplingParams


def apply_penalties(logits: np.ndarray, window: Sequence[int], p: SamplingParams) -> np.ndarray:
    """Repetition (z>0: z/r, else z·r), presence (−a·[c>0]) and frequency (−f·c) over the window."""
    if not p.penalized or not window:
        return logits
    z = logits.astype(np.float32, copy=True)
    counts = Counter(int(t) for t in window)
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    c = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
    zi = z[ids]
    if p.repetition_penalty != 1.0:
        zi = np.where(zi > 0, zi / p.repetition_penalty, zi * p.repetition_penalty)
    zi = zi - p.presence_penalty - p.frequency_penalty * c
    z[ids] = zi
    return z


def apply_bias(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The logits plus the request's logit_bias (llama.cpp's logit-bias sampler; -inf bans a token)."""
    if not p.logit_bias:
        return logits
    z = logits.astype(np.float32, copy=True)
    ids = np.fromiter((t for t, _ in p.logit_bias), dtype=np.int64, count=len(p.logit_bias))
    z[ids] += np.fromiter((b for _, b in p.logit_bias), dtype=np.float32, count=len(p.logit_bias))
    return z


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution a stochastic draw uses: softmax(z/T) truncated by top-k, top-p, min-p."""
    z = logits.astype(np.float64) / p.temperature
    if p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0.0:  # nothing filtered: softmax without sorting V
        w = np.exp(z - z.max())
        return w / w.sum()
    order = np.argsort(-z, kind="stable")
    if p.top_k > 0:
        order = order[: p.top_k]
    zs = z[order]
    w = np.exp(zs - zs[0])
    probs = w / w.sum()
    keep = len(order)
    if p.top_p < 1.0:
        # smallest prefix whose mass reaches top_p
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p, side="left")) + 1)
    if p.min_p > 0.0:
        keep = min(keep, int(np.count_nonzero(probs >= p.min_p * probs[0])))
    out = np.zeros(logits.shape[0], dtype=np.float64)
    kept = probs[:keep]
    out[order[:keep]] = kept / kept.sum()
    return out


class Sampler:
    """Per-request token picker; its generator is seeded once so a seeded request is reproducible."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        self._rng = np.random.default_rng(self.seed)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty nor bias: the backend's argmax alone decides (device fast path)."""
        return self.params.greedy and not self.params.adjusted

    def sample(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """Next token from logits (float32[V]) given the tokens so far (prompt + output)."""
        if self.params.greedy:
            return int(np.argmax(self.penalized(logits, history)))
        return self.draw(self.probs(logits, history))

    def penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The logits after the penalties over the window of `history` and the logit bias."""
        p = self.params
        return apply_bias(apply_penalties(logits, history[-p.penalty_last_n:] if p.penalty_last_n else (), p), p)

    def probs(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The distribution a stochastic draw after `history` uses (float64[V]; temperature > 0)."""
        return filtered_probs(self.penalized(logits, history), self.params)

    def draw(self, probs: np.ndarray) -> int:
        """One token from `probs` (any non-negative weights), with one uniform of the generator."""
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, self.uniform() * cdf[-1], side="right"), len(cdf) - 1))

    def uniform(self) -> float:
        """A uniform draw in [0, 1) from the request's generator (speculative acceptance tests)."""
        return float(self._rng.random())
