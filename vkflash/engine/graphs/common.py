"""What every arch's step graph shares: the model's GPU parts, the output head choice, the
token embedding (E1) and the LM head with device argmax (O3 / N2, greedy sampling)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from vkflash.engine.caches import KVCaches
from vkflash.engine.step_params import StepParams
from vkflash.engine.weights_gpu import GpuWeights, Stack
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops import argmax as argmax_op
from vkflash.gpu.ops.copy import copy_words
from vkflash.gpu.ops.embed import embed
from vkflash.gpu.ops.attention import Heads, kv_append
from vkflash.gpu.ops.matmul import matmul
from vkflash.gpu.ops.norm import rms_norm
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams
from vkflash.settings import current

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.graph import Graph

SPLIT_MAX_TOKENS = 8
"""Steps of at most this many tokens (decode, MTP verify) use flash-decode (split KV + combine)."""


class Head(Enum):
    """Which rows of a step get logits: none (inner prefill pieces), the last row, or all rows."""

    NONE = "none"
    LAST = "last"
    ALL = "all"


@dataclass
class HeadBuffers:
    """LM head outputs: logits [rows, V] f32, argmax scratch, and the argmax ids (host-visible)."""

    rows: int
    logits: Buffer
    scratch: Buffer
    ids: Buffer

    @classmethod
    def allocate(cls, gpu: "Gpu", V: int, rows: int) -> "HeadBuffers":
        return cls(rows, gpu.buffer(4 * rows * V, "logits"),
                   gpu.buffer(argmax_op.scratch_bytes(gpu.caps, V, rows), "argmax.scratch"),
                   gpu.buffer(4 * rows, "argmax.ids", host=True))


@dataclass
class StepModel:
    """Everything a step graph is built from: weights, caches, step params, head buffers,
    `n_split` (the KV splits of flash-decode) and `state`, the arch's other per-sequence state
    (recurrent states, QSA caches: see the arch's `allocate_state`), None for qwen2."""

    gpu: "Gpu"
    hp: HParams
    weights: GpuWeights
    kv: KVCaches
    params: StepParams
    head: HeadBuffers
    n_split: int
    state: Any = None

    @property
    def host_embed(self) -> bool:
        """Embedding rows come from the host (params) instead of the embed kernel."""
        return self.params.emb_dim > 0

    def splits(self, n: int) -> int:
        """KV splits of the attention of an n-token step."""
        return self.n_split if n <= SPLIT_MAX_TOKENS else 1


def decode_splits(n_ctx: int) -> int:
    """Flash-decode splits for a cache of n_ctx positions: about one per 128 positions, at most 64
    (× kv heads workgroups: about one wave on a GPU of 100+ compute units; 16 left the H200 idle)."""
    return max(1, min(64, -(-n_ctx // 128)))


def embed_tokens(g: "Graph", m: StepModel, x: Rows) -> None:
    """(E1) x_t = token_embd[id_t] for the step's tokens (ids in the params buffer)."""
    n = x.n_rows
    if m.host_embed:
        copy_words(g, m.params.buf, m.params.emb, x.buf, x.off, n * x.n_cols, name="inp_embd")
        return
    t = m.weights["token_embd.weight"]
    embed(g, t.buf, int(t.qtype), m.hp.V, m.params.buf, n, x, ids_off=m.params.ids, name="inp_embd")


def lm_head(g: "Graph", m: StepModel, h: Rows, tmp: Rows, head: Head, norm: str = "output_norm.weight") -> None:
    """(N2) logits = W_out(rms(h) ⊙ output_norm) for the rows `head` asks for, then their argmax.

    h: the residual of the step's n rows; tmp: an n-row scratch view of the same width.
    """
    if head is Head.NONE:
        return
    n, d = h.n_rows, h.n_cols
    if head is Head.LAST:
        h, tmp = Rows(h.buf, 1, d, h.off + (n - 1) * h.stride), Rows(tmp.buf, 1, d, tmp.off)
    rows = h.n_rows
    if rows > m.head.rows:
        raise ValueError(f"lm_head: {rows} logit rows, the buffers hold {m.head.rows}")
    rms_norm(g, h, tmp, m.hp.eps, m.weights[norm].buf, name="result_norm")
    out = m.weights.get("output.weight") or m.weights["token_embd.weight"]
    logits = Rows(m.head.logits, rows, m.hp.V)
    matmul(g, out.matrix(), tmp, logits, name="result_output")
    argmax_op.argmax(g, logits, m.head.scratch, m.head.ids, name="argmax")


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


def projections(g: "Graph", w: GpuWeights, x: Rows, y: Rows, parts: list[tuple[str, str]]) -> None:
    """y's columns, in order, are x times each (tensor, op name) of `parts`; neighbours that are
    consecutive rows of one stacked buffer run as one matmul, named e.g. `blk.0.gdn_qkv+gdn_z`.
    Each part's columns stay tappable under its own op name."""
    col, i = 0, 0
    while i < len(parts):
        j = i + 1  # the longest run of parts from i that is one stacked weight
        while j < len(parts) and w.stacked(*(t for t, _ in parts[i:j + 1])) is not None:
            j += 1
        W = w.stacked(*(t for t, _ in parts[i:j]))
        assert W is not None
        run = parts[i:j]
        name = "+".join([run[0][1]] + [op.rsplit(".", 1)[-1] for _, op in run[1:]])
        matmul(g, W, x, Rows(y.buf, x.n_rows, W.n_out, y.off + col, y.stride), name=name)
        for t, op in run:
            cols = w[t].matrix().n_out
            g.expose(op, y.buf, y.off + col, x.n_rows, cols, y.stride, after=name)
            col += cols
        i = j
    if col != y.n_cols:
        raise ValueError(f"projections: {col} columns for a {y.n_cols}-column output")


def append_kv(g: "Graph", m: StepModel, i: int, k: Heads, v: Heads, b: str) -> None:
    """(A4) layer i's K and V rows into its caches at the step's positions: one dispatch
    (`cache_kv`), two (`cache_k`, `cache_v`) with VKFLASH_DISABLE_FUSION=1."""
    p, cache = m.params, m.kv[i]
    if current()["VKFLASH_DISABLE_FUSION"]:
        kv_append(g, p.buf, p.pos, k, cache.k, name=b + "cache_k")
        kv_append(g, p.buf, p.pos, v, cache.v, name=b + "cache_v")
        return
    kv_append(g, p.buf, p.pos, k, cache.k, name=b + "cache_kv", second=(v, cache.v))
