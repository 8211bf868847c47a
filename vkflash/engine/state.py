"""Recurrent per-sequence state on the GPU (MODEL.md §6): GDN conv [K_c−1, C] and SSM [n_v, S·S]
states per GDN layer, the PLE conv state [(K_p−1)·N, hc·d] and the PLE token history, all f32
(history: host int64), each kept as n_draft + 2 planes so that a verify step can be rolled back.

The live plane's index is one word of a small host-visible buffer the kernels read (gpu/ops/gdn.py
`Planes`). Decode and prefill update the live plane in place. A verify step of 2 ≤ n < n_planes
tokens (at most the step kernels' STEP_MAX_T) leaves it and writes the state after its token t
into plane live + 1 + t; the live index then moves n planes on. `truncate(s)` drops the last
s < n tokens of that step: in place (RSROLL=1) by moving the index back s planes, no copy, or
(RSROLL=0) by copying the plane s tokens back into the live one on the device. Both leave the live
state bit for bit the state after the kept tokens.

Checkpoints for prompt reuse (engine/prefix.py) are copies of the live plane of every state into
`slots` planes of a buffer beside it (`save`), copied back into the live plane on `load`; the PLE
history is the last N − 1 tokens, so the caller's token list restores it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from vkflash.gpu.graph import Graph
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.copy import copy_words
from vkflash.gpu.ops.gdn import STEP_MAX_T, Planes
from vkflash.model.hparams import HParams
from vkflash.settings import current

if TYPE_CHECKING:
    from vkflash.engine.step_params import StepParams
    from vkflash.gpu.context import Gpu


def n_draft() -> int:
    """Draft tokens a verify step may carry (DRAFT knob; 0 means 6, the longest default draft),
    sizing the state planes."""
    return int(current()["DRAFT"]) or 6


@dataclass(frozen=True)
class StateBuffer:
    """One recurrent state of `rows` × `cols` f32 in `n_planes` planes; `index` holds the live one."""

    buf: Buffer
    rows: int
    cols: int
    n_planes: int
    index: Buffer

    @classmethod
    def allocate(cls, gpu: "Gpu", rows: int, cols: int, n_planes: int, index: Buffer, name: str) -> "StateBuffer":
        return cls(gpu.buffer(4 * n_planes * rows * cols, name), rows, cols, n_planes, index)

    @property
    def plane_words(self) -> int:
        return self.rows * self.cols

    def planes(self) -> Planes:
        """The view the step kernels take."""
        return Planes(self.buf, self.rows, self.cols, self.n_planes, self.index)

    def zero(self, plane: int) -> None:
        """Plane `plane` = 0."""
        self.buf.write(np.zeros(self.plane_words, np.float32), 4 * plane * self.plane_words)


@dataclass(frozen=True)
class GDNLayerState:
    """One GDN layer's conv and SSM states."""

    conv: StateBuffer
    ssm: StateBuffer


@dataclass
class RecurrentState:
    """Every recurrent row of one sequence: the states, the live plane, the PLE history, and how
    many tokens the last step allows to roll back (`valid_slots`: a verify step of n tokens, n)."""

    gpu: "Gpu"
    n_planes: int
    gdn: dict[int, GDNLayerState]
    ple_conv: StateBuffer | None
    ple_keep: int  # N − 1 tokens of PLE history (0: no PLE)
    index: Buffer
    in_place: bool  # RSROLL
    live: int = 0
    ple_history: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    valid_slots: int = 0
    _last: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    _copies: dict[tuple[int, int], Graph] = field(default_factory=dict)
    saved: list[Buffer] = field(default_factory=list)  # per state (states() order): its checkpoint planes
    _ckpt: dict[tuple[str, int, int], Graph] = field(default_factory=dict)

    @classmethod
    def allocate(cls, gpu: "Gpu", hp: HParams, n_draft: int, ple_dilation_hist: int = 0) -> "RecurrentState":
        """States for hp's GDN layers (and its PLE layer, history rows `ple_dilation_hist`) in
        n_draft + 2 planes: the live one and one per token of a verify step of n_draft + 1; the
        RSROLL knob in effect now picks the rollback."""
        n_planes = n_draft + 2
        index = gpu.buffer(4, "state.live", host=True)
        gdn = {i: GDNLayerState(StateBuffer.allocate(gpu, hp.K_c - 1, hp.C, n_planes, index, f"blk.{i}.conv_state"),
                                StateBuffer.allocate(gpu, hp.n_v, hp.S * hp.S, n_planes, index, f"blk.{i}.ssm_state"))
               for i in range(hp.L) if hp.is_gdn[i]}
        ple = None
        if hp.has_ple:
            ple = StateBuffer.allocate(gpu, ple_dilation_hist, hp.hc * hp.d, n_planes, index, "ple_conv_state")
        st = cls(gpu, n_planes, gdn, ple, hp.N - 1 if hp.has_ple else 0, index, bool(current()["RSROLL"]))
        st.reset()
        return st

    def allocate_checkpoints(self, slots: int) -> None:
        """Room for `slots` checkpoints of every state (prompt reuse); 0: none."""
        self.saved = [self.gpu.buffer(4 * slots * s.plane_words, f"{s.buf.name}.ckpt") for s in self.states()] \
            if slots else []

    def compile_checkpoints(self) -> None:
        """Record one checkpoint copy each way, so their pipeline is compiled at load and not by the
        first request that reuses a prefix."""
        if self.saved:
            for way in ("save", "load"):
                self._checkpoint_graph(way, 0, 0).record()

    def save(self, slot: int) -> None:
        """Checkpoint `slot` = the live state, on the device."""
        self._checkpoint_graph("save", self.live, slot).run()

    def load(self, slot: int, tokens: np.ndarray) -> None:
        """The live state = checkpoint `slot`, taken after `tokens` (the sequence's first tokens: the
        PLE history is their tail); nothing left to roll back."""
        self._checkpoint_graph("load", self.live, slot).run()
        self.ple_history = np.asarray(tokens[max(0, len(tokens) - self.ple_keep):] if self.ple_keep else [], np.int64)
        self._last = self.ple_history
        self.valid_slots = 0

    def _checkpoint_graph(self, way: str, plane: int, slot: int) -> Graph:
        """Live plane `plane` → checkpoint `slot` of every state (`save`), or back (`load`)."""
        g = self._ckpt.get((way, plane, slot))
        if g is None:
            g = Graph(self.gpu, f"checkpoint.{way}.{plane}.{slot}", split=False)
            for s, saved in zip(self.states(), self.saved):
                live, kept = (s.buf, plane * s.plane_words), (saved, slot * s.plane_words)
                src, dst = (live, kept) if way == "save" else (kept, live)
                copy_words(g, *src, *dst, s.plane_words, name=f"{s.buf.name}.{way}")
            self._ckpt[(way, plane, slot)] = g
        return g

    def states(self) -> list[StateBuffer]:
        """Every state buffer, GDN layers in order, then the PLE conv."""
        out = [s for layer in self.gdn.values() for s in (layer.conv, layer.ssm)]
        return out + ([self.ple_conv] if self.ple_conv is not None else [])

    def ring(self, n: int) -> bool:
        """Whether a step of n tokens is a verify step (2 ≤ n < n_planes, step GDN): one plane per token."""
        return 2 <= n < self.n_planes and n <= STEP_MAX_T

    def reset(self) -> None:
        """A new sequence: the live plane zero, no history, nothing to roll back."""
        self._set_live(0)
        for s in self.states():
            s.zero(0)
        self.ple_history = np.zeros(0, np.int64)
        self.valid_slots = 0
        self._last = np.zeros(0, np.int64)

    def before_step(self, params: "StepParams", ids: np.ndarray) -> None:
        """Host work before a step's replay: none for the states themselves."""

    def stepped(self, ids: np.ndarray) -> None:
        """Record a step of `ids` that ran: after a verify step the live plane is n planes on."""
        n = len(ids)
        self.valid_slots = n if self.ring(n) else 0
        if self.valid_slots:
            self._set_live(self.live + n)
        self._last = np.concatenate([self.ple_history, np.asarray(ids, np.int64)])
        if self.ple_keep:
            self.ple_history = self._last[-self.ple_keep:]

    def truncate(self, back: int) -> bool:
        """Drop the last `back` tokens of the last step (a verify step of more than `back`); False
        when it cannot (the caller must then recompute the sequence)."""
        if back == 0:
            return True
        if back >= self.valid_slots:
            return False
        kept = (self.live - back) % self.n_planes
        if self.in_place:
            self._set_live(kept)
        else:
            self._copy(kept, self.live)
        self.ple_history = self._last[: len(self._last) - back][-self.ple_keep:] if self.ple_keep else self.ple_history
        self.valid_slots = 0
        return True

    def _set_live(self, plane: int) -> None:
        self.live = plane % self.n_planes
        self.index.write(np.array([self.live], np.uint32))

    def _copy(self, src: int, dst: int) -> None:
        """Plane src → plane dst of every state, on the device (one recorded graph per pair)."""
        g = self._copies.get((src, dst))
        if g is None:
            g = Graph(self.gpu, f"rollback.copy.{src}>{dst}", split=False)
            for s in self.states():
                copy_words(g, s.buf, src * s.plane_words, s.buf, dst * s.plane_words, s.plane_words,
                           name=f"{s.buf.name}.restore")
            self._copies[(src, dst)] = g
        g.run()


def recurrent_of(state: object) -> RecurrentState | None:
    """The recurrent rows of an arch's per-sequence state (the state itself, or its `rec`)."""
    return state if isinstance(state, RecurrentState) else getattr(state, "rec", None)
