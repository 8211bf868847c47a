"""The qwen4exp step graph (MODEL.md §5.1–§5.7): for n tokens,

    x = token_embd[ids];  R = [x; …; x]                                       (E1, H0)
    for each layer i:  if i is the PLE layer:  R += V + y  (P4–P10; rows hashed on the host)
                       (u, ι) = Mix(R; hc_attn);  R = Combine(R, GDN(u) | Attn(u), ι)
                       (u, ι) = Mix(R; hc_ffn);   R = Combine(R, MoE(u), ι)
    logits = W_out Mix(R; output_hc) for the rows the head asks for, and their argmax.   (O2, O3)

GDN uses the tiled head map and the σ gate; attention layers with r > 0 select cells with QSA
(`block` mode, or `cell` with BLKTOPK=0): summary rows of blocks a step completes are pooled once
(re-pooled every step with POOLED=0), prefill attends per query tile through the union of the
tile's selections with per-query slot masks (masked dense with GP=0), decode through a gathered
cell list (all dense while t+1 ≤ W). The PLE table rows (n_p per token, host-hashed with
model/ple_hash.py) are gathered from the mmapped file into the step-params buffer; its dilated
conv runs as a contiguous conv with zero taps between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.engine.caches import IndexerCache, allocate_indexer
from vkflash.engine.graphs.common import Head, StepModel, embed_tokens, projections
from vkflash.engine.graphs.hybrid import (HybridScratch, QSABuffers, QSAConfig, attention_sublayer, moe_sublayer,
                                          gdn_sublayer, hybrid_stacks, hybrid_transforms)
from vkflash.engine.state import RecurrentState, n_draft
from vkflash.engine.step_params import StepParams
from vkflash.engine.weights_gpu import Stack, Stored, Transform, as_f32, host_row_gather
from vkflash.formats.gguf_file import GGUFFile, TensorInfo
from vkflash.formats.quant_blocks import row_bytes
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops import argmax as argmax_op
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops import gdn
from vkflash.gpu.ops.attention import CacheType
from vkflash.gpu.ops.hc import fuse_hc, hc_broadcast, hc_combine, hc_mix, hc_pre
from vkflash.gpu.ops.matmul import GEMV_MAX_COLS, hc_mix_matmul, matmul
from vkflash.gpu.ops.norm import MAX_HC, grouped_rms_norm
from vkflash.gpu.ops.ple import ple_gate
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams
from vkflash.model.ple_hash import PleHashParams, ple_rows

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.graph import Graph

LR_ALIGN = 32  # matmul rows are whole 32-element groups: a smaller HC low rank is zero-padded


def attention_layers(hp: HParams) -> list[int]:
    """The trunk layers that are not GDN."""
    return [i for i in range(hp.L) if not hp.is_gdn[i]]


def lr_padded(hp: HParams) -> int:
    """lr rounded up to LR_ALIGN (the padding is exact: zero rows of W_dn give silu(0) = 0)."""
    return -(-hp.lr // LR_ALIGN) * LR_ALIGN


def ple_taps(hp: HParams) -> int:
    """K' = (K_p−1)·N + 1 taps of the dilated PLE conv written as a contiguous one."""
    return (hp.K_p - 1) * hp.N + 1


def _pad_down(hp: HParams) -> Transform:
    """W_dn {hc·d, lr} with zero rows up to lr_padded (all-zero bytes decode to 0 in every type)."""
    def tf(info: TensorInfo) -> Stored:
        k, lr = info.ne
        pad = np.zeros((lr_padded(hp) - lr) * row_bytes(info.ggml_type, k), np.uint8)
        return Stored(np.concatenate([info.data.reshape(-1), pad]), info.ggml_type, (k, lr_padded(hp)))
    return tf


def _pad_up(hp: HParams) -> Transform:
    """W_up {lr, hc·d} with every row zero-extended to lr_padded elements (float types: lr < 32
    cannot be a block quant)."""
    def tf(info: TensorInfo) -> Stored:
        lr, n_out = info.ne
        rows = info.data.reshape(n_out, -1)
        pad = np.zeros((n_out, row_bytes(info.ggml_type, lr_padded(hp)) - rows.shape[1]), np.uint8)
        return Stored(np.ascontiguousarray(np.hstack([rows, pad])), info.ggml_type, (lr_padded(hp), n_out))
    return tf


def _ple_conv_taps(hp: HParams) -> Transform:
    """ple_conv1d {K_p, hc·d} (any float type) as f32 (hc·d, K') with w'[:, k·N] = w[:, k], 0 elsewhere."""
    def tf(info: TensorInfo) -> Stored:
        K_p, ch = info.ne
        w = as_f32(info).data.reshape(ch, K_p)
        out = np.zeros((ch, ple_taps(hp)), np.float32)
        out[:, :: hp.N] = w
        return Stored(out, Q.F32, (ple_taps(hp), ch))
    return tf


def weight_transforms(gf: GGUFFile, hp: HParams) -> dict[str, Transform]:
    """GDN/MoE re-layouts, zero-padded HC low rank, 2-D gains as flat f32, expanded PLE conv taps."""
    out = hybrid_transforms(gf, hp)
    pad = lr_padded(hp) != hp.lr
    for name, info in gf.tensors.items():
        if pad and (name.endswith("_down.weight") and ("hc_" in name or "output_hc" in name)):
            out[name] = _pad_down(hp)
        elif pad and (name.endswith("_up.weight") and ("hc_" in name or "output_hc" in name)):
            out[name] = _pad_up(hp)
        elif name.endswith("ple_conv1d.weight"):
            out[name] = _ple_conv_taps(hp)
        elif name.endswith("norm.weight") and (len(info.ne) > 1 or info.ggml_type is not Q.F32):
            out[name] = as_f32
    return out


def weight_stacks(gf: GGUFFile, hp: HParams) -> list[Stack]:
    """hybrid_stacks, and each block mixer's W_dn (padded) with its W_inj: both read X."""
    out = hybrid_stacks(gf, hp)
    for i in range(hp.L):
        for X in ("attn", "ffn"):
            p = f"blk.{i}.hc_{X}_"
            out.append(Stack(p + "down+inject", (p + "down.weight", p + "inject.weight")))
    if hp.has_ple:
        b = f"blk.{hp.ple_layer}."
        out.append(Stack(b + "ple_key+value", (b + "ple_key.weight", b + "ple_value.weight")))
    return out


def extra_dim(hp: HParams) -> int:
    """The PLE rows e (n_p·D_p = d floats per token) travel in the step-params buffer."""
    return hp.d if hp.has_ple else 0


def _hash_params(hp: HParams) -> PleHashParams:
    return PleHashParams(ngram_size=hp.N, heads_per_ngram=hp.h_g, eos=hp.ple_eos,
                         multipliers=np.array(hp.ple_mult, np.uint64),
                         head_offsets=np.array(hp.ple_offsets, np.uint64),
                         head_vocab_sizes=np.array(hp.ple_sizes, np.uint64))


@dataclass
class Qwen4State:
    """Per-sequence state beyond K/V: recurrent rows (engine/state.py), QSA indexer caches and
    scratch, and the host side of PLE (hash constants, table row gather)."""

    rec: RecurrentState
    idx: dict[int, IndexerCache]
    qsa: QSABuffers | None
    ple_hash: PleHashParams | None
    ple_gather: Callable[[np.ndarray], np.ndarray] | None

    def reset(self) -> None:
        self.rec.reset()

    def before_step(self, params: StepParams, ids: np.ndarray) -> None:
        """(P1)–(P4) on the host: hash the n-gram rows of the step's tokens and write the table rows e."""
        if self.ple_hash is None or self.ple_gather is None:
            return
        rows = ple_rows(np.asarray(ids, np.int64), self.rec.ple_history, self.ple_hash)
        params.set_extra(self.ple_gather(rows.reshape(-1)).reshape(len(ids), -1))

    def stepped(self, ids: np.ndarray) -> None:
        self.rec.stepped(ids)

    def truncate(self, back: int) -> bool:
        """Recurrent rows from a slot; K/V, indexer keys and summary rows need nothing (positions)."""
        return self.rec.truncate(back)


def allocate_state(gpu: "Gpu", gf: GGUFFile, hp: HParams, n_ctx: int, kv: CacheType, ub: int) -> Qwen4State:
    """Recurrent rows with n_draft+1 slots, indexer caches and QSA scratch (for the QSA knobs in
    effect now: BLKTOPK, GP, POOLED), PLE host side."""
    rec = RecurrentState.allocate(gpu, hp, n_draft(), ple_taps(hp) - 1 if hp.has_ple else 0)
    idx = allocate_indexer(gpu, hp, n_ctx, kv)
    qsa = QSABuffers.allocate(gpu, hp, ub, n_ctx, min(c.r for c in idx.values()), QSAConfig.from_settings()) \
        if idx else None
    if hp.has_ple:
        return Qwen4State(rec, idx, qsa, _hash_params(hp), host_row_gather(gf, "per_layer_token_embd.weight"))
    return Qwen4State(rec, idx, qsa, None, None)


@dataclass
class Scratch:
    """The wide residual R [ub, hc·d] and the HC, PLE and sublayer activations."""

    ub: int
    R: Buffer
    x: Buffer  # embedding rows, [ub, d]
    a: Buffer  # block output b of a Combine, [ub, d]
    X: Buffer  # grouped-normed R, [ub, hc·d]
    ell: Buffer  # [ℓ (lr_padded) | ι (hc)] per token: W_dn X and W_inj X side by side
    gpre: Buffer  # W_up ℓ, [ub, hc·d]
    kvp: Buffer  # PLE [k_p (normalised in place to K̃), hc·d | v_p, d]
    qt: Buffer  # PLE Q̃, [ub, hc·d]
    lam: Buffer  # λ, [ub, hc]
    V: Buffer  # [ub, hc·d]
    Vt: Buffer  # Ṽ, [ub, hc·d]
    y: Buffer  # conv output, [ub, hc·d]
    hy: HybridScratch

    @classmethod
    def allocate(cls, gpu: "Gpu", hp: HParams, ub: int, n_split: int) -> "Scratch":
        wide, d = hp.hc * hp.d, hp.d

        def buf(cols: int, name: str) -> Buffer:
            return gpu.buffer(4 * ub * cols, name)

        ple = 1 if hp.has_ple else 0
        return cls(ub, buf(wide, "R"), buf(d, "x"), buf(d, "a"), buf(wide, "hc.X"), buf(lr_padded(hp) + -(-hp.hc // 4) * 4, "hc.ell"),
                   buf(wide, "hc.gpre"), buf((wide + d) * ple or 1, "ple.kv"),
                   buf(wide * ple or 1, "ple.q"), buf(hp.hc * ple or 1, "ple.gate"), buf(wide * ple or 1, "ple.V"),
                   buf(wide * ple or 1, "ple.Vt"), buf(wide * ple or 1, "ple.y"),
                   HybridScratch.allocate(gpu, hp, ub, n_split))


@dataclass(frozen=True)
class Pending:
    """A Combine (H6) R += 2σ(ι/hc)·b not yet applied: the next Mix's norm applies it on the way
    (one dispatch, VKFLASH_HC_FUSE), or `apply` does on its own. Named like the reference's op."""

    b: Rows
    iota: Rows
    name: str

    def last_row(self) -> Pending:
        """The Combine of the last token only (a head that reads one row)."""
        n = self.b.n_rows - 1
        return Pending(Rows(self.b.buf, 1, self.b.n_cols, self.b.off + n * self.b.stride, self.b.stride),
                       Rows(self.iota.buf, 1, self.iota.n_cols, self.iota.off + n * self.iota.stride,
                            self.iota.stride), self.name)

    def apply(self, g: "Graph", R: Rows) -> None:
        hc_combine(g, R, self.b, self.iota, name=self.name)


def hc_mixer(g: "Graph", m: StepModel, s: Scratch, R: Rows, prefix: str, u: Rows, inject: bool,
             name: str, pending: Pending | None = None) -> Rows | None:
    """(H1)–(H5): u = Mix(R) after the pending Combine; for block mixers also ι = W_inj X, returned
    as a view. W_dn and W_inj read the same X: one matmul when the two are stacked; in decode an
    unstacked f32 W_inj (as real files store it) rides on the norm instead."""
    hp, w = m.hp, m.weights
    n, hc, d, lr = R.n_rows, hp.hc, hp.d, lr_padded(hp)
    X = Rows(s.X, n, hc * d)
    width = lr + -(-hc // 4) * 4  # ℓ rows stay 16-byte aligned for the vec4 loads of the up matmul
    iota = Rows(s.ell, n, hc, lr, width) if inject else None
    fuse = fuse_hc()
    norm_inject = None  # (W_inj, ι) when an unstacked f32 W_inj rides on the norm (decode)
    if iota is not None and fuse and n <= GEMV_MAX_COLS and hc <= MAX_HC:
        inj = w[prefix + "_inject.weight"]
        if inj.qtype is Q.F32 and w.stacked(prefix + "_down.weight", prefix + "_inject.weight") is None:
            norm_inject = (Rows(inj.buf, hc, hc * d), iota)
    gamma = w[prefix + "_norm.weight"].buf
    norm_name = pending.name if pending is not None and fuse else f"{name}.norm"
    if pending is not None and fuse:
        grouped_rms_norm(g, R, X, hc, hp.eps, gamma, name=norm_name, combine=(pending.iota, pending.b),
                         inject=norm_inject)
        g.expose(pending.name, R.buf, R.off, R.n_rows, R.n_cols, R.stride)  # R after the Combine
    else:
        if pending is not None:
            pending.apply(g, R)
        grouped_rms_norm(g, R, X, hc, hp.eps, gamma, name=norm_name, inject=norm_inject)
    parts = [(prefix + "_down.weight", f"{name}.down")]
    if norm_inject is not None:
        g.expose(f"{prefix}_inject", s.ell, lr, n, hc, width, after=norm_name)
    elif inject:  # named after its weight, not as a part of `name`: u is the mix's output, ι a second one
        parts.append((prefix + "_inject.weight", f"{prefix}_inject"))
    projections(g, w, X, Rows(s.ell, n, lr + hc * (len(parts) > 1), 0, width), parts)
    ell, up = Rows(s.ell, n, lr, 0, width), w[prefix + "_up.weight"].matrix()
    if n <= GEMV_MAX_COLS and fuse:  # decode: silu, W_up and the mix in one GEMV
        hc_mix_matmul(g, up, ell, X, u, hc, name=name)
    else:
        hc_pre(g, ell, ell, hc, name=f"{name}.pre")
        gpre = Rows(s.gpre, n, hc * d)
        matmul(g, up, ell, gpre, name=f"{name}.up")
        hc_mix(g, gpre, X, u, hc, name=name)
    return iota


def ple_block(g: "Graph", m: StepModel, s: Scratch, i: int, n: int, R: Rows, st: RecurrentState, n_slots: int) -> None:
    """(P5)–(P10): R += V + silu(dilated conv of Ṽ) with the gate λ from K̃·Q̃; conv state in place."""
    hp, w, p = m.hp, m.weights, m.params
    hc, d = hp.hc, hp.d
    b = f"blk.{i}."
    e = Rows(p.buf, n, d, p.extra)
    width = hc * d + d  # [k_p | v_p] per token: both read e (one matmul when stacked)
    kp, vp = Rows(s.kvp, n, hc * d, 0, width), Rows(s.kvp, n, d, hc * d, width)
    projections(g, w, e, Rows(s.kvp, n, width), [(b + "ple_key.weight", b + "ple_key"),
                                                 (b + "ple_value.weight", b + "ple_value")])  # (P5)
    grouped_rms_norm(g, kp, kp, hc, hp.eps, w[b + "ple_norm_key.weight"].buf, name=b + "ple_norm_key")  # (P6)
    qt = Rows(s.qt, n, hc * d)
    grouped_rms_norm(g, R, qt, hc, hp.eps, w[b + "ple_norm_query.weight"].buf, name=b + "ple_norm_query")
    V = Rows(s.V, n, hc * d)
    ple_gate(g, kp, qt, vp, Rows(s.lam, n, hc), V, hc, name=b + "ple_gate")  # (P7)–(P8)
    Vt, y = Rows(s.Vt, n, hc * d), Rows(s.y, n, hc * d)
    grouped_rms_norm(g, V, Vt, hc, hp.eps, w[b + "ple_norm_conv.weight"].buf, name=b + "ple_norm_conv")  # (P9)
    conv = st.ple_conv
    assert conv is not None
    gdn.conv(g, Vt, Rows(w[b + "ple_conv1d.weight"].buf, hc * d, ple_taps(hp)), conv.view(), y,
             conv.slot_view(n_slots) if n_slots else None, name=b + "ple_conv")
    E.add(g, V, y, y, name=b + "ple_vy")  # (P10) V + y, then onto R
    E.add(g, R, y, R, name=b + "ple_out")


def head(g: "Graph", m: StepModel, s: Scratch, n: int, which: Head, pending: Pending) -> None:
    """(O2)–(O3): logits = W_out Mix(R; output_hc) for the rows `which` asks for, then their argmax;
    the last layer's Combine is applied to those rows on the way (to all rows without a head)."""
    hp, wide = m.hp, m.hp.hc * m.hp.d
    if which is Head.NONE:
        pending.apply(g, Rows(s.R, n, wide))
        return
    R = Rows(s.R, n, wide) if which is Head.ALL else Rows(s.R, 1, wide, (n - 1) * wide)
    rows = R.n_rows
    if rows > m.head.rows:
        raise ValueError(f"head: {rows} logit rows, the buffers hold {m.head.rows}")
    y = Rows(s.x, rows, hp.d)
    hc_mixer(g, m, s, R, "output_hc", y, False, "result_norm", pending if rows == n else pending.last_row())
    out = m.weights.get("output.weight") or m.weights["token_embd.weight"]
    logits = Rows(m.head.logits, rows, hp.V)
    matmul(g, out.matrix(), y, logits, name="result_output")
    argmax_op.argmax(g, logits, m.head.scratch, m.head.ids, name="argmax")


def build(g: "Graph", m: StepModel, s: Scratch, n: int, which: Head) -> None:
    """The whole forward of an n-token step (tokens, positions and PLE rows from the params buffer).
    Each Combine rides on the next Mix's norm (Pending)."""
    if not 1 <= n <= s.ub:
        raise ValueError(f"qwen4exp step of {n} tokens; the scratch holds 1..{s.ub}")
    hp, st = m.hp, m.state
    hc, d = hp.hc, hp.d
    R, x, a, u = Rows(s.R, n, hc * d), Rows(s.x, n, d), Rows(s.a, n, d), Rows(s.hy.u, n, d)
    n_slots = st.rec.slots_for(n)
    embed_tokens(g, m, x)  # (E1)
    hc_broadcast(g, x, R, hc, name="hc_copy")  # (H0) hc identical copies
    pending: Pending | None = None
    for i in range(hp.L):
        b = f"blk.{i}."
        if i == hp.ple_layer:  # (L1) on the combined R
            if pending is not None:
                pending.apply(g, R)
                pending = None
            ple_block(g, m, s, i, n, R, st.rec, n_slots)
        iota = hc_mixer(g, m, s, R, b + "hc_attn", u, True, b + "hc_attn_mix", pending)  # (L2)
        if hp.is_gdn[i]:  # (L3)
            gdn_sublayer(g, m, s.hy, i, n, u, a, False, st.rec.gdn[i], n_slots, gdn.HeadMap.TILED, gdn.Gate.SIGMOID)
        else:
            qsa = (st.idx[i], st.qsa) if i in st.idx else None
            attention_sublayer(g, m, s.hy, i, n, u, a, False, qsa)
        assert iota is not None
        pending = Pending(a, iota, b + "attn_residual")  # (L4)
        iota = hc_mixer(g, m, s, R, b + "hc_ffn", u, True, b + "hc_ffn_mix", pending)  # (L5)
        moe_sublayer(g, m, s.hy, i, n, u, a, False)  # (L6)
        assert iota is not None
        pending = Pending(a, iota, b + "l_out")  # (L7)
    assert pending is not None
    head(g, m, s, n, which, pending)
