"""A Forward over the NumPy reference (`vkflash.model.reference`): the whole server runs end to end
on tiny generated models before (and independently of) the GPU forward, which implements the
same protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vkflash.engine.api import InvalidRequest
from vkflash.model import reference


class ReferenceForward:
    """One sequence on the NumPy reference; truncate replays the kept prefix (slow, exact)."""

    def __init__(self, weights: Any, n_ctx: int, **options: Any) -> None:
        self.weights, self.options = weights, options
        self.n_ctx = n_ctx
        self.n_vocab = int(weights.hp.V)
        self._seq: list[int] = []
        self._state = reference.new_state(weights, **options)

    @property
    def n_past(self) -> int:
        """Tokens fed so far."""
        return len(self._seq)

    def reset(self) -> None:
        """Start a new, empty sequence."""
        self._seq = []
        self._state = reference.new_state(self.weights, **self.options)

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Feed ids; logits (float32[V]) after the last one."""
        if self.n_past + len(ids) > self.n_ctx:
            raise InvalidRequest(f"{self.n_past} + {len(ids)} tokens exceed the context of {self.n_ctx}")
        logits = reference.prefill(np.asarray(ids, dtype=np.int64), self._state)
        self._seq.extend(int(i) for i in ids)
        return np.asarray(logits[-1], dtype=np.float32)

    def decode(self, token: int) -> np.ndarray:
        """Feed one token; its next-token logits."""
        return self.prefill([token])

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (recurrent states cannot be cut, so the prefix is re-run)."""
        if n >= self.n_past:
            return
        keep = self._seq[:n]
        self.reset()
        if keep:
            self.prefill(keep)
