"""Sublayers shared by the qwen3next and qwen4exp step graphs: GDN (MODEL.md §5.4 G1–G10), gated
attention with RoPE (§5.5 A1–A8, with QSA §5.6: masked, per-query or per-tile gathered prefill, gathered
decode, `block` or `cell` selection, lazy or re-pooled summary rows), and MoE with the σ-gated
shared expert (§5.7 M1–M4); plus the upload-time re-layouts their weights need.

Every sublayer takes the step's n normed rows u and returns its output rows (the reference's
`attn_out` / `ffn_out`), in whole-ubatch ops (no per-token loops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Container

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.engine.caches import IndexerCache
from vkflash.engine.graphs.common import StepModel, project, run_stacks
from vkflash.engine.qsa_config import QSAConfig
from vkflash.engine.state import GDNLayerState
from vkflash.engine.weights_gpu import Stack, Transform, as_f32, permute_rows
from vkflash.formats.gguf_file import GGUFFile
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops import gdn
from vkflash.gpu.ops.attention import (CellList, CellMask, DenseHead, Heads, attention, kv_append, q_and_gate,
                                       row_lists_possible)
from vkflash.gpu.ops.matmul import QWeight, matmul
from vkflash.gpu.ops.moe import ExpertStack, RoutedExperts, moe_combine, moe_routed, moe_router, split_gate_up
from vkflash.gpu.ops.norm import rms_norm
from vkflash.gpu.ops.qsa import qsa_pool, qsa_scores, qsa_select, qsa_union
from vkflash.gpu.ops.rope import rope_neox
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


# ------------------------------------------------------------------ upload-time re-layouts


def _ssm_in_order(hp: HParams) -> np.ndarray:
    """Rows of the legacy `ssm_in` (per group g: q_g S, k_g S, v_g ρS, z_g ρS) as [all q | all k |
    all v | all z], i.e. attn_qkv's rows followed by attn_gate's (N3)."""
    n_k, S, rho = hp.n_k, hp.S, hp.rho
    base = np.arange(n_k)[:, None] * (2 * S + 2 * rho * S)
    parts = [(0, S), (S, S), (2 * S, rho * S), (2 * S + rho * S, rho * S)]
    return np.concatenate([(base + off + np.arange(n)[None, :]).reshape(-1) for off, n in parts])


def _ssm_ba_order(hp: HParams) -> np.ndarray:
    """Rows of `ssm_ba` ([g, 0, i] = b, [g, 1, i] = a of v-head g·ρ+i) as [all b | all a]."""
    g = np.arange(hp.n_k)[:, None] * 2 * hp.rho + np.arange(hp.rho)[None, :]
    return np.concatenate([g.reshape(-1), (g + hp.rho).reshape(-1)])


GDN_PROJECTIONS = (("ssm_in.weight", "gdn_qkvz"), ("attn_qkv.weight", "gdn_qkv"), ("attn_gate.weight", "gdn_z"),
                   ("ssm_ba.weight", "gdn_ba"), ("ssm_beta.weight", "gdn_b"), ("ssm_alpha.weight", "gdn_a"))
"""The GDN input projections a file may hold, in the column order of the proj row [m | z | b | a]."""


def gdn_projections(names: Container[str], b: str) -> list[tuple[str, str]]:
    """(tensor leaf, op name) of layer b's GDN projections present in the file, in proj order."""
    return [(t, op) for t, op in GDN_PROJECTIONS if b + t in names]


def hybrid_stacks(gf: GGUFFile, hp: HParams) -> list[Stack]:
    """Projections that share an input, stacked where the file's types allow: the GDN inputs (any
    run of neighbours in proj order), the router with the shared-expert gate row (z gets E + 1
    columns), the shared expert's gate/up and the routed experts' gate/up (one fused pass)."""
    out: list[Stack] = []
    for i in range(hp.L):
        b = f"blk.{i}."
        if hp.is_gdn[i]:
            out += run_stacks([b + t for t, _ in gdn_projections(gf.tensors, b)])
        out += moe_stacks(b)
    return out


def moe_stacks(b: str) -> list[Stack]:
    """Block b's MoE projections of one input: the router with the shared-expert gate row, the
    shared expert's gate/up, the routed experts' gate/up."""
    return [Stack(b + "+".join(pair), tuple(b + t for t in pair))
            for pair in (("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"),
                         ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
                         ("ffn_gate_exps.weight", "ffn_up_exps.weight"))]


def hybrid_transforms(gf: GGUFFile, hp: HParams) -> dict[str, Transform]:
    """Re-layouts for the GDN tensors of either arch (see each helper)."""
    out: dict[str, Transform] = {}
    for name, info in gf.tensors.items():
        leaf = name.split(".", 2)[-1]
        if leaf == "ssm_in.weight":
            out[name] = lambda i, o=_ssm_in_order(hp): permute_rows(i, o)
        elif leaf == "ssm_ba.weight":
            out[name] = lambda i, o=_ssm_ba_order(hp): permute_rows(i, o)
        elif leaf == "ssm_conv1d.weight" and info.ggml_type is not Q.F32:
            out[name] = as_f32  # gdn_conv reads its kernel as plain f32
    return out


# ------------------------------------------------------------------ GDN


def gdn_sublayer(g: "Graph", m: StepModel, i: int, u: Rows, st: GDNLayerState, ring: bool,
                 head_map: gdn.HeadMap, act: gdn.Gate) -> Rows:
    """(G1)–(G10) on the rows u: W_o gated_norm(delta(conv(W_qkv u)), W_z u); the live state planes
    updated in place, or (`ring`, a verify step) one plane per token written (engine/state.py)."""
    hp, w, n = m.hp, m.weights, u.n_rows
    b = f"blk.{i}."
    C, Z, n_v = hp.C, hp.n_v * hp.S, hp.n_v
    proj = g.tensor(n, C + Z + 2 * n_v, b + "gdn_proj")  # [m | z | b | a] per token
    project(g, w, u, proj, [(b + t, b + op) for t, op in gdn_projections(w.tensors, b)])  # (G1)
    mq, z, raw_b, raw_a = proj.cols(0, C), proj.cols(C, Z), proj.cols(C + Z, n_v), proj.cols(C + Z + n_v, n_v)
    beta, gate = g.tensor(n, n_v, b + "gdn_beta"), g.tensor(n, n_v, b + "gdn_g")
    gdn.gates(g, raw_b, raw_a, w[b + "ssm_dt.bias"].vector(), w[b + "ssm_a"].vector(), beta, gate,
              name=b + "gdn_gates")  # (G2, G3)
    c = g.tensor(n, C, b + "gdn_conv")
    gdn.conv(g, mq, Rows(w[b + "ssm_conv1d.weight"].buf, C, hp.K_c), st.conv.planes(), c, ring,
             name=b + "gdn_conv")  # (G4)
    o = g.tensor(n, Z, b + "gdn_o")
    gdn.delta(g, c, beta, gate, st.ssm.planes(), o, gdn.GDNShape(hp.n_k, n_v, hp.S, head_map), hp.eps,
              ring=ring, name=b + "gdn_o")  # (G5)–(G8)
    gdn.gated_norm(g, o, z, w[b + "ssm_norm.weight"].vector(), o, hp.S, hp.eps, act, name=b + "gdn_gated")  # (G9)
    a = g.tensor(n, hp.d, b + "attn_out")
    matmul(g, w[b + "ssm_out.weight"].matrix(), o, a, name=b + "attn_out")  # (G10)
    return a


# ------------------------------------------------------------------ attention


GATHER_TILE = 64  # queries per gathered-prefill tile (S1): one union list each, all tiles in one attention dispatch


@dataclass(frozen=True)
class GatheredCells:
    """Gathered attention (Q8): row t's sorted selected cells and its gather params (position, count)
    at params[2t]; decode and verify attend row by row, a prefill step all rows at once (the rows
    before W, whose lists hold every earlier cell, may attend densely: attention's dense_head)."""

    cells: Rows
    params: Buffer
    capacity: int  # the layer's W = B + r − 1

    def row(self, t: int) -> CellList:
        """Row t's cell list."""
        return CellList(self.cells.buf, self.capacity, self.cells.off + t * self.cells.stride)

    def rows(self) -> CellList:
        """Every row's list, the rows `capacity` apart as attention(row_lists=True) reads them."""
        return CellList(self.cells.buf, self.cells.stride, self.cells.off)


@dataclass(frozen=True)
class GatheredTiles:
    """Gathered prefill (S2–S3): tile k (queries k·tile …) attends through cells[k·cap …] with its
    slot rows, params (first position, |U_k|) at gp[2k]."""

    cells: Buffer
    gp: Buffer
    slots: Rows
    tile: int
    cap: int


def qsa_select_cells(g: "Graph", m: StepModel, i: int, u: Rows, idx: IndexerCache,
                     cfg: QSAConfig) -> CellMask | GatheredCells | GatheredTiles:
    """(Q1)–(Q8): write ρ, pool the blocks this step completes (or all, POOLED=0), score the visible
    blocks and select: a gathered cell list per row (positions in its gather params) for decode and
    verify-sized steps, and for prefill steps with VKFLASH_QSA_ROWS where the kernels run this
    shape's row lists (attention.row_lists_possible); else per-query bit rows, turned
    into per-tile union lists (GP=1) or used as the mask of dense attention (GP=0)."""
    hp, w, p, n = m.hp, m.weights, m.params, u.n_rows
    b = f"blk.{i}."
    D, n_I, r, n_ctx = hp.D_I, hp.n_I, idx.r, idx.keys.n_ctx
    rho = g.tensor(n, D, b + "idx_k")
    matmul(g, w[b + "indexer.k_proj.weight"].matrix(), u, rho, name=b + "idx_k")  # (Q1)
    kv_append(g, p.buf, p.pos, Heads(rho, 1, D), idx.keys, name=b + "cache_idx")
    summary = idx.summary_rows() if cfg.pooled else g.tensor(idx.n_blocks, D, b + "qsa_pool")
    qsa_pool(g, p.buf, 0, idx.keys, w[b + "indexer.k_norm.weight"].buf, summary, r=r, T=n, n_rot=hp.n_rot,
             theta=hp.theta, eps=hp.eps, repool=not cfg.pooled, name=b + "qsa_pool")  # (Q2)–(Q3)
    qI = g.tensor(n, n_I * D, b + "idx_q")
    matmul(g, w[b + "indexer.q_proj.weight"].matrix(), u, qI, name=b + "idx_q")  # (Q4)
    heads = Rows(qI.buf, n * n_I, D, qI.off)
    rms_norm(g, heads, heads, hp.eps, w[b + "indexer.q_norm.weight"].buf, name=b + "idx_q_norm")
    rope_neox(g, heads, heads, n_I, hp.n_rot, hp.theta, p.buf, p.rope, name=b + "idx_q_rope")
    g.expose(b + "idx_q", qI.buf, qI.off, n, n_I * D, qI.stride, after=b + "idx_q_rope")  # final after norm + RoPE
    scores = g.tensor(n, idx.n_blocks, b + "idx_scores")
    qsa_scores(g, p.buf, 0, qI, summary, scores, n_I=n_I, r=r, name=b + "idx_scores")  # (Q5)
    W = hp.B + max(hp.r) - 1
    rows = cfg.gathered and cfg.rows and row_lists_possible(g, n, hp.H, hp.H_kv, hp.Dh, m.kv[i].k.type)
    if n <= p.row_steps or rows:  # one cell list per row
        cells, gp = g.tensor(n, W, b + "qsa_select"), g.temp(8 * n, b + "qsa_select.gp")
        qsa_select(g, p.buf, 0, scores, cells, r=r, B=hp.B, cell=cfg.cell, gather_params=gp,
                   name=b + "qsa_select")  # (Q6)–(Q8)
        return GatheredCells(cells, gp, hp.W(i))
    words = -(-n_ctx // 32)
    sel = g.tensor(n, words, b + "qsa_mask")
    qsa_select(g, p.buf, 0, scores, sel, r=r, B=hp.B, cell=cfg.cell, name=b + "qsa_mask")
    if not cfg.gathered:
        return CellMask(sel.buf, sel.stride)
    n_tiles = -(-n // GATHER_TILE)
    t = GatheredTiles(g.temp(4 * n_tiles * n_ctx, b + "qsa_union"), g.temp(8 * n_tiles, b + "qsa_union.gp"),
                      g.tensor(n, words, b + "qsa_union.slots"), GATHER_TILE, n_ctx)
    qsa_union(g, p.buf, 0, sel, t.gp, t.cells, n_ctx, t.slots, tile=t.tile, name=b + "qsa_union")  # (S1)–(S2)
    g.expose(b + "qsa_union.gp", t.gp, 0, 1, 2 * n_tiles, 2 * n_tiles, after=b + "qsa_union")
    return t


def attention_sublayer(g: "Graph", m: StepModel, i: int, u: Rows, qsa: tuple[IndexerCache, QSAConfig] | None = None
                       ) -> Rows:
    """(A1)–(A8) on the rows u: W_o(attn(RoPE(rms(q)), RoPE(rms(k)), v) ⊙ σ(gate)), masked or
    gathered by the QSA selection (§5.6) when `qsa` is given."""
    hp, w, p, n = m.hp, m.weights, m.params, u.n_rows
    H, H_kv, Dh = hp.H, hp.H_kv, hp.Dh
    b = f"blk.{i}."
    qg, k, v = g.tensor(n, 2 * H * Dh, b + "attn_qg"), g.tensor(n, H_kv * Dh, b + "Kcur"), g.tensor(n, H_kv * Dh, b + "Vcur")
    fused = w.get(b + "attn_qkv.weight")
    if fused is not None:  # qwen3next's optional fused form: [q+gate | k | v] rows
        full = fused.matrix()
        for y, row0, rows, nm in ((qg, 0, 2 * H * Dh, "attn_q"), (k, 2 * H * Dh, H_kv * Dh, "attn_k"),
                                  (v, 2 * H * Dh + H_kv * Dh, H_kv * Dh, "Vcur")):
            matmul(g, QWeight(full.buf, full.qtype, full.k, rows, row0), u, y, name=b + nm)
    else:  # (A1)
        matmul(g, w[b + "attn_q.weight"].matrix(), u, qg, name=b + "attn_q")
        matmul(g, w[b + "attn_k.weight"].matrix(), u, k, name=b + "attn_k")
        matmul(g, w[b + "attn_v.weight"].matrix(), u, v, name=b + "Vcur")
    q_rows, k_rows = Rows(qg.buf, n * H, Dh, qg.off, 2 * Dh), Rows(k.buf, n * H_kv, Dh, k.off)  # q between the gates
    for rows, heads, nm in ((q_rows, H, "Q"), (k_rows, H_kv, "K")):  # (A2), (A3)
        rms_norm(g, rows, rows, hp.eps, w[b + f"attn_{nm.lower()}_norm.weight"].buf, name=b + f"{nm}norm")
        rope_neox(g, rows, rows, heads, hp.n_rot, hp.theta, p.buf, p.rope, name=b + f"{nm}cur")
    cache = m.kv[i]
    kv_append(g, p.buf, p.pos, Heads(k, H_kv, Dh), cache.k, name=b + "cache_k")  # (A4)
    kv_append(g, p.buf, p.pos, Heads(v, H_kv, Dh), cache.v, name=b + "cache_v")
    sel = qsa_select_cells(g, m, i, u, *qsa) if qsa is not None else None
    # (A5)–(A7) with the gate applied in the attention kernel: "attn_gated", not the reference's
    # pre-gate "kqv_out"
    o = g.tensor(n, H * Dh, b + "attn_gated")
    if isinstance(sel, GatheredTiles):  # (S3) every query tile's gathered, slot-masked attention in one dispatch
        q, gate = q_and_gate(qg, H, Dh)
        attention(g, sel.gp, 0, q, cache.k, cache.v, Heads(o, H, Dh), gate=gate,
                  mask=CellMask(sel.slots.buf, sel.slots.stride, sel.slots.off),
                  cells=CellList(sel.cells, sel.cap), tile=sel.tile, name=b + "attn_gated")
    elif isinstance(sel, GatheredCells) and n > p.row_steps:  # (S3) per query: its own list, all at once
        q, gate = q_and_gate(qg, H, Dh)
        attention(g, sel.params, 0, q, cache.k, cache.v, Heads(o, H, Dh), gate=gate, cells=sel.rows(),
                  row_lists=True, dense_head=DenseHead(p.buf, 0, sel.capacity),  # (Q6): before W, every cell
                  name=b + "attn_gated")
    elif n == 1 or n > p.row_steps:
        q, gate = q_and_gate(qg, H, Dh)
        listed = isinstance(sel, GatheredCells)
        attention(g, sel.params if listed else p.buf, 0, q, cache.k, cache.v, Heads(o, H, Dh), gate=gate,
                  mask=sel if isinstance(sel, CellMask) else None,
                  cells=sel.row(0) if listed else None,
                  name=b + "attn_gated")
    else:  # a verify-sized step attends row by row with each row's own params, exactly as decode
        for t in range(n):
            q, gate = q_and_gate(qg.rows(t, 1), H, Dh)
            if isinstance(sel, GatheredCells):
                params, off, cells = sel.params, 2 * t, sel.row(t)
            else:
                params, off, cells = p.buf, p.row(t), None
            attention(g, params, off, q, cache.k, cache.v, Heads(o.rows(t, 1), H, Dh), gate=gate, cells=cells,
                      name=b + f"attn_gated.{t}")
    a = g.tensor(n, hp.d, b + "attn_out")
    matmul(g, w[b + "attn_output.weight"].matrix(), o, a, name=b + "attn_out")  # (A8)
    return a


# ------------------------------------------------------------------ MoE


def _experts(m: StepModel, b: str) -> RoutedExperts:
    """Layer b's routed expert stacks as stored: gate/up {d, F, E} (or the fused {d, 2F, E}), down {F, d, E}."""
    w, hp = m.weights, m.hp
    fused = w.get(b + "ffn_gate_up_exps.weight")
    if fused is not None:
        gate, up = split_gate_up(fused.buf, int(fused.qtype), hp.d, hp.F, hp.E)
    else:
        gt, ut = w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"]  # stacked: one buffer, fused pass
        gate = ExpertStack(gt.buf, int(gt.qtype), hp.d, hp.F, hp.E, gt.row0, gt.expert_rows)
        up = ExpertStack(ut.buf, int(ut.qtype), hp.d, hp.F, hp.E, ut.row0, ut.expert_rows)
    dt = w[b + "ffn_down_exps.weight"]
    return RoutedExperts(gate, up, ExpertStack(dt.buf, int(dt.qtype), hp.F, hp.d, hp.E, dt.row0, dt.expert_rows))


def moe_sublayer(g: "Graph", m: StepModel, i: int, u: Rows) -> Rows:
    """(M1)–(M4) on the rows u: Σ_j w_j·W_d^{(I_j)}(silu(W_g^{(I_j)}u) ⊙ W_u^{(I_j)}u) + σ(w_sg·u)·shared(u)."""
    hp, w, n = m.hp, m.weights, u.n_rows
    b = f"blk.{i}."
    n_e, k, F_s, d = hp.E, hp.k, hp.F_s, hp.d
    z = g.tensor(n, n_e + 1, b + "ffn_moe_logits")  # router logits z and the shared-expert gate logit w_sg·u
    project(g, w, u, z, [(b + "ffn_gate_inp.weight", b + "ffn_moe_logits"),
                         (b + "ffn_gate_inp_shexp.weight", b + "ffn_shexp_g")])  # (M1)
    ids, wts = g.tensor(n, k, b + "ffn_moe_topk"), g.tensor(n, k, b + "ffn_moe_weights")
    moe_router(g, z.cols(0, n_e), ids, wts, k, name=b + "ffn_moe_topk")  # (M1)–(M3)
    ys = g.tensor(n * k, d, b + "ffn_moe")  # w_j·expert_j(u), one row per (token, slot)
    moe_routed(g, u, ids, wts, _experts(m, b), ys, name=b + "ffn_moe")  # (M4), routed
    gate, up = g.tensor(n, F_s, b + "ffn_shexp_gate"), g.tensor(n, F_s, b + "ffn_shexp_up")
    h, sh = g.tensor(n, F_s, b + "ffn_shexp_h"), g.tensor(n, d, b + "ffn_shexp_down")
    matmul(g, w[b + "ffn_gate_shexp.weight"].matrix(), u, gate, name=b + "ffn_shexp_gate")
    E.silu(g, gate, gate, name=b + "ffn_shexp_silu")
    matmul(g, w[b + "ffn_up_shexp.weight"].matrix(), u, up, name=b + "ffn_shexp_up")
    E.mul(g, gate, up, h, name=b + "ffn_shexp_h")
    matmul(g, w[b + "ffn_down_shexp.weight"].matrix(), h, sh, name=b + "ffn_shexp_down")
    f = g.tensor(n, d, b + "ffn_out")
    moe_combine(g, ys, f, k, shared=sh, gate=z.cols(n_e, 1), name=b + "ffn_out")  # (M4) Σ slots + σ(w_sg·u)·shared
    return f
