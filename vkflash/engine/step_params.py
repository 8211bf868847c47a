"""The step-params buffer: everything that changes per replay of a recorded step graph.

One host-visible buffer of 32-bit words, written by the host before each replay and read by the
shaders (positions, lengths, token ids), so graphs are recorded once and never re-recorded:

    word 0             p0     position of the step's first token (attention reads it)
    word 1             n_kv   cache length after the step (p0 + n)
    words POS..+ub     p_t    position of token t (RoPE, KV append)
    words IDS..+ub     id_t   token ids (embedding gather)
    words EMB..+ub·d   f32 embedding rows gathered on the host (only for tables the embed kernel
                       cannot decode; the graph copies them into the residual)
    words EXTRA..+ub·x f32 per-token rows an arch fills on the host before each step
                       (qwen4exp: the PLE table rows e of P4, x = d)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vkflash.gpu.memory import Buffer

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu

P0, N_KV, POS = 0, 1, 2


def _extra_offset(ub: int, emb_dim: int) -> int:
    """The arch rows start after the embedding rows, rounded up to 4 words."""
    return -(-(POS + 2 * ub + ub * emb_dim) // 4) * 4


@dataclass
class StepParams:
    """The buffer and its layout for ubatches of up to `ub` tokens (`emb_dim` > 0: host embedding
    rows; `extra_dim` > 0: arch rows)."""

    buf: Buffer
    ub: int
    emb_dim: int = 0
    extra_dim: int = 0

    @classmethod
    def allocate(cls, gpu: "Gpu", ub: int, emb_dim: int = 0, extra_dim: int = 0) -> "StepParams":
        words = _extra_offset(ub, emb_dim) + ub * extra_dim
        return cls(gpu.buffer(4 * words, "step_params", host=True), ub, emb_dim, extra_dim)

    @property
    def pos(self) -> int:
        """Word offset of the token positions."""
        return POS

    @property
    def ids(self) -> int:
        """Word offset of the token ids."""
        return POS + self.ub

    @property
    def emb(self) -> int:
        """Word offset of the host-gathered embedding rows."""
        return POS + 2 * self.ub

    @property
    def extra(self) -> int:
        """Word offset of the arch's per-token rows (a multiple of 4: matmuls read them as vec4)."""
        return _extra_offset(self.ub, self.emb_dim)

    def set_extra(self, rows: np.ndarray) -> None:
        """Write the arch rows of this step, (n, extra_dim) f32."""
        if rows.ndim != 2 or rows.shape[1] != self.extra_dim or not 1 <= len(rows) <= self.ub:
            raise ValueError(f"arch rows must be (1..{self.ub}, {self.extra_dim}), got {rows.shape}")
        self.buf.write(np.asarray(rows, np.float32), 4 * self.extra)

    def _words(self) -> np.ndarray | None:
        """The buffer's mapped words as int32 (host-visible buffers; cached: the mapping is persistent)."""
        w = self.__dict__.get("_mapped_words")
        if w is None and self.buf.host_visible:
            w = self.__dict__["_mapped_words"] = self.buf.view(np.int32)
        return w

    def set(self, p0: int, ids: np.ndarray, emb: np.ndarray | None = None) -> None:
        """Describe a step of len(ids) tokens at positions p0, p0+1, …"""
        n = len(ids)
        if not 1 <= n <= self.ub:
            raise ValueError(f"a step has 1..{self.ub} tokens, got {n}")
        w = self._words()
        if w is not None and n == 1:  # decode: four words into the mapping, no temporaries
            w[P0], w[N_KV], w[POS], w[self.ids] = p0, p0 + 1, p0, ids[0]
        else:
            head = np.empty(POS + n, np.int32)
            head[P0], head[N_KV] = p0, p0 + n
            head[POS:] = p0 + np.arange(n, dtype=np.int32)
            self.buf.write(head)
            self.buf.write(np.asarray(ids, np.int32), 4 * self.ids)
        if self.emb_dim:
            if emb is None or emb.shape != (n, self.emb_dim):
                raise ValueError(f"host embedding rows must be ({n}, {self.emb_dim})")
            self.buf.write(np.asarray(emb, np.float32), 4 * self.emb)
