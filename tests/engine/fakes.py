"""Test doubles for the engine: a byte-level codec and forwards with known logits (no model needed)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class ByteStreamer:
    """Incremental UTF-8 decoding of byte tokens (id < 256 is that byte)."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(bytes([token_id]) if token_id < 256 else b"")

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


@dataclass
class ByteCodec:
    """Tokens 0..255 are bytes; `eog` ends generation; ids above 255 print nothing."""

    eog: int

    def streamer(self) -> ByteStreamer:
        return ByteStreamer()

    def is_eog(self, token_id: int) -> bool:
        return token_id == self.eog


@dataclass
class TableForward:
    """Logits of the next token = table[last token] + position drift; refuses to pass n_ctx."""

    table: np.ndarray  # (V, V) float32
    n_ctx: int
    fail_at: int | None = None  # raise at this n_past (fault injection)
    seq: list[int] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    @property
    def n_vocab(self) -> int:
        return self.table.shape[1]

    @property
    def n_past(self) -> int:
        return len(self.seq)

    def reset(self) -> None:
        self.seq = []

    def logits(self) -> np.ndarray:
        """The logits after the current sequence (a pure function of it)."""
        return (self.table[self.seq[-1]] + 0.01 * len(self.seq)).astype(np.float32)

    def _feed(self, ids: Sequence[int]) -> None:
        if self.n_past + len(ids) > self.n_ctx:
            raise AssertionError(f"wrote past the context: {self.n_past}+{len(ids)} > {self.n_ctx}")
        if self.fail_at is not None and self.n_past + len(ids) > self.fail_at:
            raise RuntimeError("injected backend failure")
        self.seq.extend(int(i) for i in ids)

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        self.calls.append(f"prefill {len(ids)}")
        self._feed(ids)
        return self.logits()

    def decode(self, token: int) -> np.ndarray:
        self.calls.append("decode")
        self._feed([token])
        return self.logits()

    def truncate(self, n: int) -> None:
        del self.seq[n:]


class ArgmaxTableForward(TableForward):
    """TableForward with the device-argmax fast path."""

    def prefill_argmax(self, ids: Sequence[int]) -> int:
        return int(np.argmax(self.prefill(ids)))

    def decode_argmax(self, token: int) -> int:
        return int(np.argmax(self.decode(token)))


class ScriptForward(TableForward):
    """Greedy output is `script` exactly: the logits after n_past tokens peak at script[n_past − P]."""

    def __init__(self, script: Sequence[int], n_prompt: int, V: int, n_ctx: int) -> None:
        super().__init__(np.zeros((1, V), np.float32), n_ctx)
        self.script, self.n_prompt = list(script), n_prompt

    def logits(self) -> np.ndarray:
        z = np.zeros(self.n_vocab, np.float32)
        k = len(self.seq) - self.n_prompt
        z[self.script[k] if k < len(self.script) else 0] = 50.0
        return z


class VerifyTableForward(ArgmaxTableForward):
    """ArgmaxTableForward with the speculator's verify step: logits (or argmax) after every fed token."""

    logits_step = 64  # the most tokens a verify step holds, as GpuForward.logits_step

    def verify(self, ids: Sequence[int], logits: bool = False) -> np.ndarray:
        self.calls.append(f"verify {len(ids)}")
        rows = []
        for t in ids:
            self._feed([t])
            rows.append(self.logits())
        out = np.stack(rows)
        return out if logits else out.argmax(axis=1)


@dataclass
class TableDrafter:
    """The draft head's interface over a table: the draft logits after token t are table[t] (a
    Markov chain of its own); `proposals` counts the tokens it drafted."""

    table: np.ndarray
    k_max: int
    device_chain: bool = True
    pending: int = 1
    proposals: int = 0

    def _row(self, t: int) -> np.ndarray:
        return self.table[t].astype(np.float32)

    def draft(self, x: int, k: int, logits: bool = False):
        from vkflash.engine.draft import Drafted

        ids, rows, t = [], [], x
        for _ in range(k):
            rows.append(self._row(t))
            t = int(np.argmax(rows[-1]))
            ids.append(t)
        self.proposals += k
        return Drafted(ids, np.stack(rows) if logits else None)

    def first(self, x: int) -> np.ndarray:
        self.proposals += 1
        return self._row(x)

    def next(self, j: int, token: int) -> np.ndarray:
        self.proposals += 1
        return self._row(token)

    def truncated(self, n: int) -> None:
        pass
