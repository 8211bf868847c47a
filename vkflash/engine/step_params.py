"""The step-params buffer: everything that changes per replay of a recorded step graph.

One host-visible buffer of 32-bit words, written by the host before each replay and read by the
shaders (positions, lengths, token ids), so graphs are recorded once and never re-recorded:

    word 0             p0     cache cell of the step's first token (attention reads it)
    word 1             n_kv   cache length after the step (p0 + n)
    words POS..+ub     p_t    cache cell of token t (KV append; RoPE unless ROPE is there)
    words IDS..+ub     id_t   token ids (embedding gather)
    words ROWS..+2r    (p_t, p_t + 1) per token for steps of at most r = min(ub, ROW_STEP_MAX)
                       tokens: such a step attends row by row with each row's own (p0, n_kv), so
                       a verify row computes exactly what a decode step at its position does
    words ROPE..+ub    positions for RoPE, only with cell_shift > 0: a cache whose cell c holds
                       position c + cell_shift (the MTP head has no row for position 0)
    words EMB..+ub·d   f32 embedding rows gathered on the host (only for tables the embed kernel
                       cannot decode; the graph copies them into the residual)
    words EXTRA..+ub·x per-token rows an arch fills on the host before each step (qwen4exp: the
                       PLE table rows e of P4, as f32, x = d, or as stored, decoded by the graph)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.attention import SPLIT_MAX_TOKENS

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu

P0, N_KV, POS = 0, 1, 2
ROW_STEP_MAX = SPLIT_MAX_TOKENS
"""Steps of 2..ROW_STEP_MAX tokens (MTP verify) attend row by row, as decode does."""


@dataclass
class Layout:
    """Word offsets of the regions for ubatches of up to `ub` tokens (see the module docstring)."""

    ub: int
    emb_dim: int = 0
    extra_dim: int = 0
    cell_shift: int = 0

    @property
    def pos(self) -> int:
        """Word offset of the tokens' cache cells."""
        return POS

    @property
    def ids(self) -> int:
        """Word offset of the token ids."""
        return POS + self.ub

    @property
    def row_steps(self) -> int:
        """Most tokens of a step that attends row by row."""
        return min(self.ub, ROW_STEP_MAX)

    def row(self, t: int) -> int:
        """Word offset of token t's own (p0, n_kv) pair (steps of ≤ row_steps tokens)."""
        if not 0 <= t < self.row_steps:
            raise ValueError(f"row {t}: per-row params exist for steps of at most {self.row_steps} tokens")
        return POS + 2 * self.ub + 2 * t

    @property
    def rope(self) -> int:
        """Word offset of the RoPE positions (the cache cells unless shifted)."""
        return POS + 2 * self.ub + 2 * self.row_steps if self.cell_shift else POS

    @property
    def emb(self) -> int:
        """Word offset of the host-gathered embedding rows."""
        return POS + 2 * self.ub + 2 * self.row_steps + (self.ub if self.cell_shift else 0)

    @property
    def extra(self) -> int:
        """Word offset of the arch's per-token rows (a multiple of 4: matmuls read them as vec4)."""
        return -(-(self.emb + self.ub * self.emb_dim) // 4) * 4

    @property
    def words(self) -> int:
        """Words of the whole buffer."""
        return self.extra + self.ub * self.extra_dim


@dataclass
class StepParams(Layout):
    """The buffer and its layout (`emb_dim` > 0: host embedding rows; `extra_dim` > 0: arch rows;
    `cell_shift` > 0: cache cells lag positions by that much)."""

    buf: Buffer = field(kw_only=True)

    @classmethod
    def allocate(cls, gpu: "Gpu", ub: int, emb_dim: int = 0, extra_dim: int = 0,
                 cell_shift: int = 0) -> "StepParams":
        words = Layout(ub, emb_dim, extra_dim, cell_shift).words
        return cls(ub, emb_dim, extra_dim, cell_shift, buf=gpu.buffer(4 * words, "step_params", host=True))

    def set_extra(self, rows: np.ndarray) -> None:
        """Write the arch rows of this step, (n, extra_dim) 32-bit words (f32 values or raw bits)."""
        if rows.ndim != 2 or rows.shape[1] != self.extra_dim or not 1 <= len(rows) <= self.ub:
            raise ValueError(f"arch rows must be (1..{self.ub}, {self.extra_dim}), got {rows.shape}")
        if rows.dtype not in (np.float32, np.uint32):
            raise ValueError(f"arch rows must be float32 or uint32 words, got {rows.dtype}")
        self.buf.write(np.ascontiguousarray(rows), 4 * self.extra)

    def _words(self) -> np.ndarray | None:
        """The buffer's mapped words as int32 (host-visible buffers; cached: the mapping is persistent)."""
        w = self.__dict__.get("_mapped_words")
        if w is None and self.buf.host_visible:
            w = self.__dict__["_mapped_words"] = self.buf.view(np.int32)
        return w

    def set(self, p0: int, ids: np.ndarray, emb: np.ndarray | None = None) -> None:
        """Describe a step of len(ids) tokens at positions p0, p0+1, … (cells p − cell_shift)."""
        n = len(ids)
        if not 1 <= n <= self.ub:
            raise ValueError(f"a step has 1..{self.ub} tokens, got {n}")
        c0 = p0 - self.cell_shift
        if c0 < 0:
            raise ValueError(f"position {p0} has no cache cell (cells start at position {self.cell_shift})")
        w = self._words()
        if w is not None and n == 1:  # decode: a few words into the mapping, no temporaries
            r = self.row(0)
            w[P0], w[N_KV], w[POS], w[self.ids], w[r], w[r + 1] = c0, c0 + 1, c0, ids[0], c0, c0 + 1
            if self.cell_shift:
                w[self.rope] = p0
        else:
            cells = c0 + np.arange(n, dtype=np.int32)
            head = np.empty(POS + n, np.int32)
            head[P0], head[N_KV] = c0, c0 + n
            head[POS:] = cells
            self.buf.write(head)
            self.buf.write(np.asarray(ids, np.int32), 4 * self.ids)
            if n <= self.row_steps:
                self.buf.write(np.stack([cells, cells + 1], axis=1), 4 * self.row(0))
            if self.cell_shift:
                self.buf.write(cells + self.cell_shift, 4 * self.rope)
        if self.emb_dim:
            if emb is None or emb.shape != (n, self.emb_dim):
                raise ValueError(f"host embedding rows must be ({n}, {self.emb_dim})")
            self.buf.write(np.asarray(emb, np.float32), 4 * self.emb)
