"""A Forward over the NumPy reference (`vkflash.model.reference`): the whole server runs end to end
on tiny generated models before (and independently of) the GPU forward, which implements the
same protocol, prompt reuse included: K/V-only states are cut by position, recurrent ones go back
to checkpoints (snapshots of the reference state) kept by the same book as the GPU's
(engine/prefix.py), so both keep the same prefix of a prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vkflash import settings
from vkflash.engine.api import InvalidRequest
from vkflash.engine.prefix import CheckpointBook, common_prefix
from vkflash.model import reference
from vkflash.model.layers.attention import KVCache


class ReferenceForward:
    """One sequence on the NumPy reference; truncate replays the kept prefix (slow, exact)."""

    def __init__(self, weights: Any, n_ctx: int, ckpt: int | None = None, ckpt_every: int | None = None,
                 **options: Any) -> None:
        """ckpt / ckpt_every: checkpoints kept and tokens between them within a prefill (default:
        the CACHE_CKPT / CACHE_CKPT_EVERY knobs); options: the reference's (layers.common.RefOptions)."""
        s = settings.current()
        self.weights, self.options = weights, options
        self.n_ctx = n_ctx
        self.n_vocab = int(weights.hp.V)
        self._seq: list[int] = []
        self._state = reference.new_state(weights, **options)
        self._recurrent = not all(isinstance(layer, KVCache) for layer in self._state.layers)
        slots = int(s["CACHE_CKPT"] if ckpt is None else ckpt) if self._recurrent else 0
        self.book = CheckpointBook(slots, int(s["CACHE_CKPT_EVERY"] if ckpt_every is None else ckpt_every))
        self._saved: dict[int, Any] = {}  # slot → state snapshot

    @property
    def n_past(self) -> int:
        """Tokens fed so far."""
        return len(self._seq)

    def reset(self) -> None:
        """Start a new, empty sequence."""
        self._seq = []
        self._state = reference.new_state(self.weights, **self.options)
        self.book.clear()

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Feed ids; logits (float32[V]) after the last one (checkpoints where a prefill crosses a
        multiple of the book's interval, as the GPU's steps do)."""
        if self.n_past + len(ids) > self.n_ctx:
            raise InvalidRequest(f"{self.n_past} + {len(ids)} tokens exceed the context of {self.n_ctx}")
        ids = [int(i) for i in ids]
        every = self.book.every
        start, logits = 0, None
        while start < len(ids):
            n0 = self.n_past
            end = len(ids) if every <= 0 else min(len(ids), start + every - n0 % every)
            logits = reference.prefill(np.asarray(ids[start:end], dtype=np.int64), self._state)
            self._seq.extend(ids[start:end])
            if self.book.due(n0, self.n_past):
                self.checkpoint()
            start = end
        assert logits is not None
        return np.asarray(logits[-1], dtype=np.float32)

    def decode(self, token: int) -> np.ndarray:
        """Feed one token; its next-token logits."""
        return self.prefill([token])

    def truncate(self, n: int) -> None:
        """Keep the first n tokens: K/V cut by position; recurrent states from the nearest
        checkpoint (or the start) with the rest of the prefix re-run."""
        if n >= self.n_past:
            return
        if not self._recurrent:
            self._cut(n)
            return
        keep = self._seq[:n]
        p = self._restore(self.book.best(n))
        if n > p:
            self.prefill(keep[p:])

    def reuse(self, ids: Sequence[int]) -> int:
        """Keep the longest restorable prefix the sequence shares with ids, never all of ids (as
        GpuForward.reuse): the tokens of ids not to feed again."""
        c = min(common_prefix(self._seq, [int(t) for t in ids]), len(ids) - 1)
        if c <= 0:
            self.reset()
            return 0
        if c == self.n_past:
            return c
        if not self._recurrent:
            self._cut(c)
            return c
        return self._restore(self.book.best(c))

    @property
    def keeps_checkpoints(self) -> bool:
        return self._recurrent and self.book.slots > 0

    def checkpoint(self) -> None:
        """Keep a snapshot of the state after the tokens fed so far (recurrent models)."""
        slot = self.book.take(self.n_past)
        if slot is not None:
            self._saved[slot] = self._state.snapshot()

    def _cut(self, n: int) -> None:
        """K/V caches and the sequence cut to their first n positions (attention-only states)."""
        for layer in self._state.layers:
            layer.k, layer.v = layer.k[:n], layer.v[:n]
        self._state.n = n
        del self._seq[n:]

    def _restore(self, at: tuple[int, int] | None) -> int:
        """The state of checkpoint (position, slot) (a copy: the slot stays), or a new sequence."""
        if at is None:
            self.reset()
            return 0
        pos, slot = at
        self._state = self._saved[slot].snapshot()
        del self._seq[pos:]
        self.book.drop_after(pos)
        return pos
