"""Recurrent per-sequence state on the GPU (MODEL.md §6): GDN conv [K_c−1, C] and SSM [n_v, S·S]
states per GDN layer, the PLE conv state [(K_p−1)·N, hc·d] and the PLE token history, all f32
(history: host int64), with checkpoint slots for speculative rollback.

A step of 2 ≤ n ≤ n_slots tokens (verify) writes slot s = the state s tokens before its end, for
s < n; `truncate(s)` then restores slot s instead of recomputing. Slots are not written by decode
(n = 1, slot 0 would equal the state) nor by prefill ubatches (the chunked GDN has no slots).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.gdn import STEP_MAX_T
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams
from vkflash.settings import current

if TYPE_CHECKING:
    from vkflash.engine.step_params import StepParams
    from vkflash.gpu.context import Gpu


def n_draft() -> int:
    """Draft tokens a verify step may carry (DRAFT knob; 0 means 6, the longest default draft),
    sizing the checkpoint slots."""
    return int(current()["DRAFT"]) or 6


@dataclass(frozen=True)
class ConvState:
    """A causal-conv state of `hist` rows × `ch` channels and its `n_slots` checkpoint copies."""

    state: Buffer
    slots: Buffer
    hist: int
    ch: int
    n_slots: int

    @classmethod
    def allocate(cls, gpu: "Gpu", hist: int, ch: int, n_slots: int, name: str) -> "ConvState":
        return cls(gpu.buffer(4 * hist * ch, name), gpu.buffer(4 * max(1, n_slots) * hist * ch, name + ".slots"),
                   hist, ch, n_slots)

    def view(self) -> Rows:
        return Rows(self.state, self.hist, self.ch)

    def slot_view(self, n: int) -> Rows:
        """The first n slots (slot s = rows [s·hist, (s+1)·hist))."""
        return Rows(self.slots, n * self.hist, self.ch)

    def restore(self, s: int) -> None:
        """state = slot s."""
        words = self.hist * self.ch
        self.state.write(self.slots.read(np.float32, words, 4 * s * words))


@dataclass(frozen=True)
class SSMState:
    """A GDN state [n_v, S·S] (row = key index) and its checkpoint copies."""

    state: Buffer
    slots: Buffer
    n_v: int
    S: int
    n_slots: int

    @classmethod
    def allocate(cls, gpu: "Gpu", n_v: int, S: int, n_slots: int, name: str) -> "SSMState":
        return cls(gpu.buffer(4 * n_v * S * S, name), gpu.buffer(4 * max(1, n_slots) * n_v * S * S, name + ".slots"),
                   n_v, S, n_slots)

    def view(self) -> Rows:
        return Rows(self.state, self.n_v, self.S * self.S)

    def slot_view(self, n: int) -> Rows:
        return Rows(self.slots, n * self.n_v, self.S * self.S)

    def restore(self, s: int) -> None:
        words = self.n_v * self.S * self.S
        self.state.write(self.slots.read(np.float32, words, 4 * s * words))


@dataclass(frozen=True)
class GDNLayerState:
    """One GDN layer's conv and SSM states."""

    conv: ConvState
    ssm: SSMState


@dataclass
class RecurrentState:
    """Every recurrent row of one sequence; `valid_slots` = slots written by the last step."""

    n_slots: int
    gdn: dict[int, GDNLayerState]
    ple_conv: ConvState | None
    ple_keep: int  # N − 1 tokens of PLE history (0: no PLE)
    ple_history: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    valid_slots: int = 0
    _last: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def allocate(cls, gpu: "Gpu", hp: HParams, n_draft: int, ple_dilation_hist: int = 0) -> "RecurrentState":
        """States for hp's GDN layers (and its PLE layer, history rows `ple_dilation_hist`), with
        n_draft + 1 checkpoint slots each."""
        n_slots = n_draft + 1
        gdn = {i: GDNLayerState(ConvState.allocate(gpu, hp.K_c - 1, hp.C, n_slots, f"blk.{i}.conv_state"),
                                SSMState.allocate(gpu, hp.n_v, hp.S, n_slots, f"blk.{i}.ssm_state"))
               for i in range(hp.L) if hp.is_gdn[i]}
        ple = None
        if hp.has_ple:
            ple = ConvState.allocate(gpu, ple_dilation_hist, hp.hc * hp.d, n_slots, "ple_conv_state")
        st = cls(n_slots, gdn, ple, hp.N - 1 if hp.has_ple else 0)
        st.reset()
        return st

    def slots_for(self, n: int) -> int:
        """Slots a step of n tokens writes: n for a verify-sized step (2 ≤ n ≤ n_slots, step GDN), else 0."""
        return n if 2 <= n <= min(self.n_slots, STEP_MAX_T) else 0

    def reset(self) -> None:
        """A new sequence: every state zero, no history, no valid slot."""
        for layer in self.gdn.values():
            layer.conv.state.fill(0.0)
            layer.ssm.state.fill(0.0)
        if self.ple_conv is not None:
            self.ple_conv.state.fill(0.0)
        self.ple_history = np.zeros(0, np.int64)
        self.valid_slots = 0
        self._last = np.zeros(0, np.int64)

    def before_step(self, params: "StepParams", ids: np.ndarray) -> None:
        """Host work before a step's replay: none for the GDN states themselves."""

    def stepped(self, ids: np.ndarray) -> None:
        """Record a step of `ids` that ran: the slots it wrote and the PLE history after it."""
        self.valid_slots = self.slots_for(len(ids))
        self._last = np.concatenate([self.ple_history, np.asarray(ids, np.int64)])
        if self.ple_keep:
            self.ple_history = self._last[-self.ple_keep:]

    def truncate(self, back: int) -> bool:
        """Drop the last `back` tokens of the last step by restoring slot `back`; False when the
        slots cannot do it (the caller must then recompute the sequence)."""
        if back == 0:
            return True
        if back >= self.valid_slots:
            return False
        for layer in self.gdn.values():
            layer.conv.restore(back)
            layer.ssm.restore(back)
        if self.ple_conv is not None:
            self.ple_conv.restore(back)
        kept = self._last[: len(self._last) - back]
        self.ple_history = kept[-self.ple_keep:] if self.ple_keep else self.ple_history
        self.valid_slots = 0
        return True
