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
from vkflash.engine.graphs.common import Head, StepModel, embed_tokens, head_rows, logits_and_argmax, project
from vkflash.engine.graphs.hybrid import (attention_sublayer, gdn_sublayer, hybrid_stacks, hybrid_transforms,
                                          moe_stacks, moe_sublayer)
from vkflash.engine.qsa_config import QSAConfig
from vkflash.engine.state import RecurrentState, n_draft
from vkflash.engine.step_params import StepParams
from vkflash.engine.weights_gpu import Stack, Stored, Transform, as_f32, host_row_gather, raw_row_gather
from vkflash.formats.gguf_file import GGUFFile, TensorInfo
from vkflash.formats.quant_blocks import BLOCK, row_bytes
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops import gdn
from vkflash.gpu.ops.attention import CacheType
from vkflash.gpu.ops.embed import TABLE_TYPES, decode_rows
from vkflash.gpu.ops.hc import hc_broadcast, hc_combine, hc_mix, hc_pre
from vkflash.gpu.ops.matmul import matmul
from vkflash.gpu.ops.norm import grouped_rms_norm
from vkflash.gpu.ops.ple import ple_gate
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams
from vkflash.model.ple_hash import PleHashParams, ple_row_one, ple_rows
from vkflash.model.qwen4exp import ple_params
from vkflash.settings import current

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.graph import Graph

LR_ALIGN = 32  # matmul rows are whole 32-element groups: a smaller HC low rank is zero-padded


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


def eh_halves(info: TensorInfo) -> Stored:
    """nextn.eh_proj {2d, d} (W_eh ∈ R^{d×2d}) as {d, 2d}: rows [0, d) = W_fe, rows [d, 2d) = W_fh, so
    each half is a matrix of its own (raw blocks moved when d is whole blocks, else decoded to f32)."""
    k2, d = info.ne
    qtype, raw = Q(info.ggml_type), info.data
    if (k2 // 2) % BLOCK[qtype][0]:
        qtype, raw = Q.F32, as_f32(info).data.view(np.uint8)
    rows = np.asarray(raw).reshape(d, -1)
    half = row_bytes(qtype, k2 // 2)
    return Stored(np.ascontiguousarray(np.vstack([rows[:, :half], rows[:, half:]])), qtype, (k2 // 2, 2 * d))


@dataclass
class Qwen4State:
    """Per-sequence state beyond K/V: recurrent rows (engine/state.py), QSA indexer caches and the
    QSA knobs in effect when it was made, and the host side of PLE (hash constants, table row gather)."""

    rec: RecurrentState
    idx: dict[int, IndexerCache]
    qsa: QSAConfig
    ple_hash: PleHashParams | None
    ple_gather: Callable[[np.ndarray], np.ndarray] | None
    ple_type: Q | None = None  # rows travel as stored (this type), decoded by the graph; None: f32

    def reset(self) -> None:
        self.rec.reset()

    def before_step(self, params: StepParams, ids: np.ndarray) -> None:
        """(P1)–(P4) on the host: hash the n-gram rows of the step's tokens and write the table rows e
        (as f32, or as stored for the graph to decode)."""
        if self.ple_hash is None or self.ple_gather is None:
            return
        if len(ids) == 1:  # decode: the hash in Python ints, no NumPy calls
            rows = np.array(ple_row_one(int(ids[0]), self.rec.ple_history, self.ple_hash), np.int64)
        else:
            rows = ple_rows(np.asarray(ids, np.int64), self.rec.ple_history, self.ple_hash)
        params.set_extra(self.ple_gather(rows.reshape(-1)).reshape(len(ids), -1))

    def stepped(self, ids: np.ndarray) -> None:
        self.rec.stepped(ids)

    def truncate(self, back: int) -> bool:
        """Recurrent rows from a state plane; K/V, indexer keys and summary rows need nothing (positions)."""
        return self.rec.truncate(back)


def mix(g: "Graph", m: StepModel, R: Rows, prefix: str, name: str, inject: bool) -> tuple[Rows, Rows | None]:
    """(H1)–(H5): u = Mix(R) with the mixer's weights `prefix`_*; for block mixers also ι = W_inj X."""
    hp, w, n = m.hp, m.weights, R.n_rows
    hc, d, lr = hp.hc, hp.d, lr_padded(hp)
    X = g.tensor(n, hc * d, f"{name}.norm")
    grouped_rms_norm(g, R, X, hc, hp.eps, w[prefix + "_norm.weight"].buf, name=f"{name}.norm")  # (H1)
    ell_iota = g.tensor(n, lr + hc * inject, f"{prefix}_lr")  # [ℓ | ι] per token
    ell = ell_iota.cols(0, lr)
    parts = [(prefix + "_down.weight", f"{name}.down")]
    if inject:  # named after its weight, not as a part of `name`: u is the mix's output, ι a second one
        parts.append((prefix + "_inject.weight", f"{prefix}_inject"))
    project(g, w, X, ell_iota, parts)  # (H2) ℓ_pre = W_dn X, (H5) ι = W_inj X
    hc_pre(g, ell, ell, hc, name=f"{name}.pre")  # (H2) ℓ = silu(ℓ_pre / hc)
    g_pre = g.tensor(n, hc * d, f"{name}.up")
    matmul(g, w[prefix + "_up.weight"].matrix(), ell, g_pre, name=f"{name}.up")  # (H3)
    u = g.tensor(n, d, name)
    hc_mix(g, g_pre, X, u, hc, name=name)  # (H3)+(H4)
    return u, ell_iota.cols(lr, hc) if inject else None


def ple_block(g: "Graph", m: StepModel, i: int, R: Rows, st: RecurrentState, ring: bool) -> None:
    """(P5)–(P10): R += V + silu(dilated conv of Ṽ) with the gate λ from K̃·Q̃; conv state in place
    (or one plane per token: `ring`)."""
    hp, w, p, n = m.hp, m.weights, m.params, R.n_rows
    hc, d = hp.hc, hp.d
    b = f"blk.{i}."
    raw = m.state.ple_type
    if raw is None:
        e = Rows(p.buf, n, d, p.extra)
    else:  # (P4) the rows as stored, decoded here
        e = g.tensor(n, d, b + "ple_rows")
        decode_rows(g, p.buf, raw, Rows(e.buf, n * hp.n_p, hp.D_p, e.off), 4 * p.extra, name=b + "ple_rows")
    kv = g.tensor(n, hc * d + d, b + "ple_kv")  # [k_p | v_p] per token
    project(g, w, e, kv, [(b + "ple_key.weight", b + "ple_key"), (b + "ple_value.weight", b + "ple_value")])  # (P5)
    kp, vp = kv.cols(0, hc * d), kv.cols(hc * d, d)
    Kt, Qt = g.tensor(n, hc * d, b + "ple_norm_key"), g.tensor(n, hc * d, b + "ple_norm_query")
    grouped_rms_norm(g, kp, Kt, hc, hp.eps, w[b + "ple_norm_key.weight"].buf, name=b + "ple_norm_key")  # (P6)
    grouped_rms_norm(g, R, Qt, hc, hp.eps, w[b + "ple_norm_query.weight"].buf, name=b + "ple_norm_query")
    lam, V = g.tensor(n, hc, b + "ple_gate"), g.tensor(n, hc * d, b + "ple_V")
    ple_gate(g, Kt, Qt, vp, lam, V, hc, name=b + "ple_gate")  # (P7)–(P8)
    Vt, y = g.tensor(n, hc * d, b + "ple_norm_conv"), g.tensor(n, hc * d, b + "ple_conv")
    grouped_rms_norm(g, V, Vt, hc, hp.eps, w[b + "ple_norm_conv.weight"].buf, name=b + "ple_norm_conv")  # (P9)
    conv = st.ple_conv
    assert conv is not None
    gdn.conv(g, Vt, Rows(w[b + "ple_conv1d.weight"].buf, hc * d, ple_taps(hp)), conv.planes(), y, ring,
             name=b + "ple_conv")
    E.add(g, V, y, y, name=b + "ple_vy")  # (P10) V + y, then onto R
    E.add(g, R, y, R, name=b + "ple_out")


PLE_TABLE = "per_layer_token_embd.weight"


def ple_raw_type(gf: GGUFFile, hp: HParams) -> Q | None:
    """The PLE table's type when its rows travel as stored (VKFLASH_PLE_RAW, a type the embed kernel
    decodes, n_p rows a whole number of words), else None (f32 rows from the host)."""
    qt = Q(gf.tensors[PLE_TABLE].ggml_type)
    ok = current()["VKFLASH_PLE_RAW"] and qt in TABLE_TYPES and hp.n_p * row_bytes(qt, hp.D_p) % 4 == 0
    return qt if ok else None


class Qwen4ExpGraph:
    """ArchGraph of qwen4exp: HC residual streams around GDN / QSA-attention and MoE sublayers, PLE."""

    def attention_layers(self, hp: HParams) -> list[int]:
        """The trunk layers that are not GDN."""
        return [i for i in range(hp.L) if not hp.is_gdn[i]]

    def weight_transforms(self, gf: GGUFFile, hp: HParams) -> dict[str, Transform]:
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
            elif name.endswith("nextn.eh_proj.weight"):
                out[name] = eh_halves
            elif name.endswith("norm.weight") and (len(info.ne) > 1 or info.ggml_type is not Q.F32):
                out[name] = as_f32
        return out

    def weight_stacks(self, gf: GGUFFile, hp: HParams) -> list[Stack]:
        """hybrid_stacks, and each block mixer's W_dn (padded) with its W_inj: both read X."""
        out = hybrid_stacks(gf, hp)
        for i in range(hp.L_all):  # the trunk and an MTP block (its MoE stacks like a trunk block's)
            for X in ("attn", "ffn"):
                p = f"blk.{i}.hc_{X}_"
                out.append(Stack(p + "down+inject", (p + "down.weight", p + "inject.weight")))
        for i in range(hp.L, hp.L_all):
            out += moe_stacks(f"blk.{i}.")
        if hp.has_ple:
            b = f"blk.{hp.ple_layer}."
            out.append(Stack(b + "ple_key+value", (b + "ple_key.weight", b + "ple_value.weight")))
        return out

    def host_tables(self, hp: HParams) -> list[str]:
        """The PLE n-gram table (tens of GB in the real model): its rows travel in the step params."""
        return [PLE_TABLE] if hp.has_ple else []

    def extra_dim(self, gf: GGUFFile, hp: HParams) -> int:
        """The PLE rows e travel in the step-params buffer: n_p table rows as stored (words), or
        n_p·D_p = d floats."""
        if not hp.has_ple:
            return 0
        raw = ple_raw_type(gf, hp)
        return hp.n_p * row_bytes(raw, hp.D_p) // 4 if raw is not None else hp.d

    def allocate_state(self, gpu: "Gpu", gf: GGUFFile, hp: HParams, n_ctx: int, kv: CacheType,
                       ub: int, held: int) -> Qwen4State:
        """Recurrent rows in n_draft+2 planes, indexer caches (`held` positions backed), the QSA
        knobs in effect now (BLKTOPK, GP, POOLED), PLE host side."""
        rec = RecurrentState.allocate(gpu, hp, n_draft(), ple_taps(hp) - 1 if hp.has_ple else 0)
        idx = allocate_indexer(gpu, hp, n_ctx, kv, held)
        if hp.has_ple:
            raw = ple_raw_type(gf, hp)
            gather = raw_row_gather(gf, PLE_TABLE) if raw is not None else host_row_gather(gf, PLE_TABLE)
            return Qwen4State(rec, idx, QSAConfig.from_settings(), ple_params(hp), gather, raw)
        return Qwen4State(rec, idx, QSAConfig.from_settings(), None, None)

    def build(self, g: "Graph", m: StepModel, n: int, head: Head) -> None:
        """The whole forward of an n-token step (tokens, positions and PLE rows from the params buffer);
        the residual R is m.hidden when the draft head needs it (h_nextn, O1)."""
        hp, st = m.hp, m.state
        R = Rows(m.hidden, n, hp.hc * hp.d) if m.hidden is not None else g.tensor(n, hp.hc * hp.d, "R")
        ring = st.rec.ring(n)
        hc_broadcast(g, embed_tokens(g, m, n), R, hp.hc, name="hc_copy")  # (E1), (H0)
        for i in range(hp.L):
            b = f"blk.{i}."
            if i == hp.ple_layer:  # (L1)
                ple_block(g, m, i, R, st.rec, ring)
            u, iota = mix(g, m, R, b + "hc_attn", b + "hc_attn_mix", True)  # (L2)
            if hp.is_gdn[i]:  # (L3)
                a = gdn_sublayer(g, m, i, u, st.rec.gdn[i], ring, gdn.HeadMap.TILED, gdn.Gate.SIGMOID)
            else:
                a = attention_sublayer(g, m, i, u, (st.idx[i], st.qsa) if i in st.idx else None)
            assert iota is not None
            hc_combine(g, R, a, iota, name=b + "attn_residual")  # (L4)
            u, iota = mix(g, m, R, b + "hc_ffn", b + "hc_ffn_mix", True)  # (L5)
            assert iota is not None
            hc_combine(g, R, moe_sublayer(g, m, i, u), iota, name=b + "l_out")  # (L6), (L7)
        if head is not Head.NONE:  # (O2), (O3)
            y, _ = mix(g, m, head_rows(R, head), "output_hc", "result_norm", False)
            logits_and_argmax(g, m, y)
