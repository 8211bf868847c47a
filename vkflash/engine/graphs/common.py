"""What every arch's step graph shares: the `ArchGraph` protocol the arch modules implement, the
model's GPU parts a step is built from, the output head choice, the token embedding (E1) and
the LM head with device argmax (O3 / N2, greedy sampling).

A step graph states the model one plain op at a time, as the reference does, on intermediates
made with `Graph.tensor` and named like the reference's dump names; how the ops run (fusions,
buffers, submissions) is gpu/'s business (gpu/fuse.py, gpu/alloc.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from vkflash.engine.caches import KVCaches
from vkflash.engine.step_params import StepParams
from vkflash.engine.weights_gpu import GpuWeights, Stack, Transform
from vkflash.errors import NumericFault
from vkflash.formats.gguf_file import GGUFFile
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops import argmax as argmax_op
from vkflash.gpu.ops.attention import CacheType
from vkflash.gpu.ops.copy import copy_words
from vkflash.gpu.ops.embed import embed
from vkflash.gpu.ops.matmul import matmul
from vkflash.gpu.ops.norm import rms_norm
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.graph import Graph


class Head(Enum):
    """Which rows of a step get logits: none (inner prefill pieces), the last row, or all rows."""

    NONE = "none"
    LAST = "last"
    ALL = "all"


@dataclass
class HeadBuffers:
    """LM head outputs the host reads: logits [rows, V] f32 and the argmax ids (host-visible),
    read back checked: a NaN or +inf logit is a NumericFault, never a token."""

    rows: int
    V: int
    logits: Buffer
    ids: Buffer

    @classmethod
    def allocate(cls, gpu: "Gpu", V: int, rows: int) -> "HeadBuffers":
        return cls(rows, V, gpu.buffer(4 * rows * V, "logits"), gpu.buffer(4 * rows, "argmax.ids", host=True))

    def read_logits(self, n: int, first: int = 0) -> np.ndarray:
        """Logits of rows first..first+n, (n, V) float32."""
        z = self.logits.read(np.float32, n * self.V, 4 * first * self.V).reshape(n, self.V)
        top = z.max()  # NaN if any is
        if np.isnan(top) or top == np.inf:
            raise NumericFault(NON_FINITE)
        return z

    def read_ids(self, n: int) -> np.ndarray:
        """Argmax ids of the first n rows (int64); the kernel's NO_INDEX marks a row with NaN or +inf."""
        ids = self.ids.read(np.uint32, n).astype(np.int64)
        if ids.max() >= self.V:
            raise NumericFault(NON_FINITE)
        return ids


NON_FINITE = ("the model produced NaN or infinite logits (damaged weights, or values overflowing float32); "
              "no token can be drawn from them")


@dataclass
class StepModel:
    """Everything a step graph is built from: weights, caches, step params, head buffers and
    `state`, the arch's other per-sequence state (recurrent states, QSA caches: see the arch's
    `allocate_state`), None for qwen2; `hidden` (qwen4exp with MTP): where the step leaves its
    rows of h_nextn (O1) for the draft head, ub rows of hc·d."""

    gpu: "Gpu"
    hp: HParams
    weights: GpuWeights
    kv: KVCaches
    params: StepParams
    head: HeadBuffers
    state: Any = None
    hidden: Buffer | None = None

    @property
    def host_embed(self) -> bool:
        """Embedding rows come from the host (params) instead of the embed kernel."""
        return self.params.emb_dim > 0


class SequenceState(Protocol):
    """An arch's per-sequence state beyond K/V (recurrent rows, indexer caches, PLE history)."""

    def reset(self) -> None:
        """A new, empty sequence."""

    def before_step(self, params: StepParams, ids: Any) -> None:
        """Host work before a step's replay (e.g. PLE rows into the params)."""

    def stepped(self, ids: Any) -> None:
        """A step of `ids` ran."""

    def truncate(self, back: int) -> bool:
        """Drop the last `back` tokens of a verify step (state planes); False when it cannot."""


class ArchGraph(Protocol):
    """What the GPU forward needs from an arch: its layers, weight layout, state and step graph."""

    def attention_layers(self, hp: HParams) -> list[int]:
        """Layers with a K/V cache."""

    def weight_transforms(self, gf: GGUFFile, hp: HParams) -> dict[str, Transform]:
        """Upload-time re-layouts of file tensors, by name."""

    def weight_stacks(self, gf: GGUFFile, hp: HParams) -> list[Stack]:
        """Projections of one input that may share a buffer (taken where the types allow)."""

    def host_tables(self, hp: HParams) -> list[str]:
        """Tables whose rows the host gathers from the mmapped file: never uploaded."""

    def extra_dim(self, gf: GGUFFile, hp: HParams) -> int:
        """32-bit words per token the host writes into the step params before each step (0: none)."""

    def allocate_state(self, gpu: "Gpu", gf: GGUFFile, hp: HParams, n_ctx: int, kv: CacheType,
                       ub: int, held: int) -> SequenceState | None:
        """The per-sequence state beyond K/V (None: the arch has none); caches that grow with the
        context hold memory for `held` positions."""

    def build(self, g: "Graph", m: StepModel, n: int, head: Head) -> None:
        """The ops of an n-token step with `head`'s logits."""


def embed_tokens(g: "Graph", m: StepModel, n: int) -> Rows:
    """(E1) x_t = token_embd[id_t] for the step's n tokens (ids in the params buffer)."""
    x = g.tensor(n, m.hp.d, "inp_embd")
    if m.host_embed:
        copy_words(g, m.params.buf, m.params.emb, x.buf, x.off, n * x.n_cols, name="inp_embd")
        return x
    t = m.weights["token_embd.weight"]
    embed(g, t.buf, int(t.qtype), m.hp.V, m.params.buf, n, x, ids_off=m.params.ids, name="inp_embd")
    return x


def head_rows(h: Rows, head: Head) -> Rows:
    """The rows of h the head computes logits for."""
    return h if head is Head.ALL else h.rows(h.n_rows - 1, 1)


def logits_and_argmax(g: "Graph", m: StepModel, y: Rows) -> None:
    """(O3) logits = W_out y for the head's rows, and their argmax (greedy sampling on the device)."""
    if y.n_rows > m.head.rows:
        raise ValueError(f"head: {y.n_rows} logit rows, the buffers hold {m.head.rows}")
    out = m.weights.get("output.weight") or m.weights["token_embd.weight"]
    logits = Rows(m.head.logits, y.n_rows, m.hp.V)
    matmul(g, out.matrix(), y, logits, name="result_output")
    argmax_op.argmax(g, logits, m.head.ids, name="argmax")


def lm_head(g: "Graph", m: StepModel, h: Rows, head: Head) -> None:
    """(N2) logits = W_out(rms(h) ⊙ output_norm) for the rows `head` asks for, then their argmax."""
    if head is Head.NONE:
        return
    h = head_rows(h, head)
    y = g.tensor(h.n_rows, h.n_cols, "result_norm")
    rms_norm(g, h, y, m.hp.eps, m.weights["output_norm.weight"].buf, name="result_norm")
    logits_and_argmax(g, m, y)


def run_stacks(members: list[str]) -> list[Stack]:
    """Stacks for projections whose outputs are consecutive columns of one activation row, in
    that order: every run of ≥ 2 neighbours, longest first (the upload takes the first that fits
    the file's types and skips runs that overlap a taken one)."""
    out = []
    for size in range(len(members), 1, -1):
        for i in range(len(members) - size + 1):
            run = members[i:i + size]
            out.append(Stack("+".join(run), tuple(run)))
    return out


def project(g: "Graph", w: GpuWeights, x: Rows, y: Rows, parts: list[tuple[str, str]]) -> None:
    """y's columns, in order, are x times each (tensor, op name) of `parts` (one matmul each);
    each part is tappable under its op name as its own columns, not as all of y's buffer."""
    col = 0
    for t, op in parts:
        W = w[t].matrix()
        part = y.cols(col, W.n_out)
        matmul(g, W, x, part, name=op)
        g.expose(op, part.buf, part.off, part.n_rows, part.n_cols, part.stride)
        col += W.n_out
    if col != y.n_cols:
        raise ValueError(f"project: {col} columns for a {y.n_cols}-column output")
