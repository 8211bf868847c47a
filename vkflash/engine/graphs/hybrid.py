"""Sublayers shared by the qwen3next and qwen4exp step graphs: GDN (MODEL.md §5.4 G1–G10), gated
attention with RoPE (§5.5 A1–A8, with QSA §5.6: masked or per-tile gathered prefill, gathered
decode, `block` or `cell` selection, lazy or re-pooled summary rows), and MoE with the σ-gated
shared expert (§5.7 M1–M4); plus the upload-time re-layouts their weights need.

Every sublayer covers the step's n tokens in whole-ubatch dispatches (no per-token loops) and
either adds its output to `out` (residual) or stores it there (qwen4exp's block output b).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Container

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.engine.caches import IndexerCache
from vkflash.engine.graphs.common import StepModel, append_kv, projections, run_stacks
from vkflash.engine.state import GDNLayerState
from vkflash.engine.weights_gpu import Stack, Transform, as_f32, permute_rows
from vkflash.formats.gguf_file import GGUFFile
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops import gdn
from vkflash.gpu.ops.attention import CellList, CellMask, Heads, attention, kv_append, q_and_gate
from vkflash.gpu.ops.matmul import Epilogue, QWeight, glu_matmul, matmul
from vkflash.gpu.ops.moe import (TILES, ExpertStack, MoEPlan, RoutedExperts, moe_routed, moe_router, shared_out_combine,
                                 plan_words, split_gate_up, tile_width)
from vkflash.gpu.ops.moe import DECODE_MAX_T as MOE_GEMV_MAX_T
from vkflash.gpu.ops.norm import Rope, rms_norm
from vkflash.gpu.ops.qsa import qsa_pool, qsa_scores, qsa_select, qsa_union
from vkflash.gpu.ops.rope import rope_neox
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams
from vkflash.settings import current

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
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
        for pair in (("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"),
                     ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
                     ("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            out.append(Stack(b + "+".join(pair), tuple(b + t for t in pair)))
    return out


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


# ------------------------------------------------------------------ scratch


@dataclass
class HybridScratch:
    """Activations of up to `ub` tokens for the GDN, attention and MoE sublayers."""

    ub: int
    u: Buffer  # sublayer input, [ub, d]
    proj: Buffer  # GDN [m (C) | z (n_v·S) | b (n_v) | a (n_v)] per token
    conv: Buffer  # GDN conv output c, [ub, C]
    gates: Buffer  # GDN [β | g], [ub, 2·n_v]
    o: Buffer  # GDN o / attention output, [ub, max(n_v·S, H·Dh)]
    qg: Buffer  # attention q+gate interleaved, [ub, 2·H·Dh]
    k: Buffer  # [ub, H_kv·Dh]
    v: Buffer  # [ub, H_kv·Dh]
    partial: Buffer  # flash-decode partials
    z: Buffer  # router logits and the shared-expert gate logit w_sg·u, [ub, E + 1]
    ids: Buffer  # router top-k ids (int32), [ub, k]
    w: Buffer  # router weights, [ub, k]
    plan: Buffer  # routing plan of a prefill step (moe_prepass)
    h: Buffer  # routed expert hidden silu(W_g u) ⊙ W_u u, [ub·k, F]
    ys: Buffer  # weighted expert outputs, one row per (token, slot), [ub·k, d]
    f: Buffer  # MoE output before a residual add, [ub, d]
    sh_gate: Buffer  # shared expert silu(W_g^s u), [ub, F_s]
    sh_h: Buffer  # [ub, F_s]
    sh_out: Buffer  # W_d^s(…), [ub, d]

    @classmethod
    def allocate(cls, gpu: "Gpu", hp: HParams, ub: int, n_split: int) -> "HybridScratch":
        from vkflash.engine.graphs.common import SPLIT_MAX_TOKENS
        from vkflash.gpu.ops.attention import partial_bytes

        d, Z, n_e, k = hp.d, hp.n_v * hp.S, hp.E, hp.k

        def buf(cols: int, name: str) -> Buffer:
            return gpu.buffer(4 * ub * cols, name)

        part = partial_bytes(min(ub, SPLIT_MAX_TOKENS), hp.H, hp.Dh, n_split) if n_split > 1 else 4
        plan = max(plan_words(ub, k, n_e, bn) for bn in TILES)
        return cls(ub, buf(d, "u"), buf(hp.C + Z + 2 * hp.n_v, "gdn.proj"), buf(hp.C, "gdn.conv"),
                   buf(2 * hp.n_v, "gdn.gates"), buf(max(Z, hp.H * hp.Dh), "o"), buf(2 * hp.H * hp.Dh, "attn.qg"),
                   buf(hp.H_kv * hp.Dh, "attn.k"), buf(hp.H_kv * hp.Dh, "attn.v"), gpu.buffer(part, "attn.partial"),
                   buf(n_e + 1, "moe.z"), buf(k, "moe.ids"), buf(k, "moe.w"), gpu.buffer(4 * plan, "moe.plan"),
                   buf(k * hp.F, "moe.h"), buf(k * d, "moe.ys"), buf(d, "moe.f"), buf(hp.F_s, "shexp.gate"),
                   buf(hp.F_s, "shexp.h"), buf(d, "shexp.out"))


# ------------------------------------------------------------------ GDN


def _out_name(residual: bool) -> str:
    """A sublayer's output projection is named after what it stores: the residual stream after the
    add (fused into the store) or the sublayer output alone, as the reference names them."""
    return "attn_residual" if residual else "attn_out"


def gdn_sublayer(g: "Graph", m: StepModel, s: HybridScratch, i: int, n: int, u: Rows, out: Rows,
                 residual: bool, st: GDNLayerState, n_slots: int, head_map: gdn.HeadMap, act: gdn.Gate) -> None:
    """(G1)–(G10) on n tokens: out (+)= W_o gated_norm(delta(conv(W_qkv u)), W_z u); states in place,
    `n_slots` checkpoint slots written (0: none)."""
    hp, w = m.hp, m.weights
    b = f"blk.{i}."
    C, Z, n_v = hp.C, hp.n_v * hp.S, hp.n_v
    W = C + Z + 2 * n_v
    projections(g, w, u, Rows(s.proj, n, W), [(b + t, b + op) for t, op in gdn_projections(w.tensors, b)])
    conv_w = w[b + "ssm_conv1d.weight"]
    c = Rows(s.conv, n, C)
    gdn.conv(g, Rows(s.proj, n, C, 0, W), Rows(conv_w.buf, C, hp.K_c), st.conv.view(), c,
             st.conv.slot_view(n_slots) if n_slots else None, name=b + "gdn_conv")
    raw_b, raw_a = Rows(s.proj, n, n_v, C + Z, W), Rows(s.proj, n, n_v, C + Z + n_v, W)
    dt_bias, ssm_a = w[b + "ssm_dt.bias"].vector(), w[b + "ssm_a"].vector()
    if current()["VKFLASH_DISABLE_FUSION"]:  # (G2, G3) as their own dispatch
        beta, gate = Rows(s.gates, n, n_v, 0, 2 * n_v), Rows(s.gates, n, n_v, n_v, 2 * n_v)
        gdn.gates(g, raw_b, raw_a, dt_bias, ssm_a, beta, gate, name=b + "gdn_gates")
        raw = None
    else:  # computed where the delta rule reads them
        beta, gate, raw = raw_b, raw_a, (dt_bias, ssm_a)
    o = Rows(s.o, n, Z)
    gdn.delta(g, c, beta, gate, st.ssm.view(), o, gdn.GDNShape(hp.n_k, n_v, hp.S, head_map), hp.eps,
              variant=gdn.Variant.STEP if n_slots else None, slots=st.ssm.slot_view(n_slots) if n_slots else None,
              raw_gates=raw, name=b + "gdn_o")
    gdn.gated_norm(g, o, Rows(s.proj, n, Z, C, W), w[b + "ssm_norm.weight"].vector(), o, hp.S, hp.eps, act,
                   name=b + "gdn_gated")
    matmul(g, w[b + "ssm_out.weight"].matrix(), o, out, Epilogue(res=out) if residual else Epilogue(),
           name=b + _out_name(residual))


# ------------------------------------------------------------------ attention


GATHER_TILE = 64  # queries per gathered-prefill tile (S1): one union, one attention dispatch each


@dataclass(frozen=True)
class QSAConfig:
    """The QSA revert knobs, read once when the state is allocated: `cell` selection (BLKTOPK=0),
    gathered sparse prefill (GP=1), the lazy summary cache (POOLED=1; else re-pool every step)."""

    cell: bool
    gathered: bool
    pooled: bool

    @classmethod
    def from_settings(cls) -> "QSAConfig":
        s = current()
        return cls(cell=not s["BLKTOPK"], gathered=bool(s["GP"]), pooled=bool(s["POOLED"]))


@dataclass(frozen=True)
class QSABuffers:
    """Per-sequence QSA scratch sized by the context: raw keys ρ, indexer queries, block scores,
    prefill bit rows, the decode cell list with its gather params, and per the config the tile
    lists + slot rows of gathered prefill and the re-pooled summary rows."""

    cfg: QSAConfig
    rho: Buffer  # [ub, D_I]
    qI: Buffer  # [ub, n_I·D_I]
    scores: Buffer  # [ub, n_blocks]
    mask: Buffer  # [ub, ⌈n_ctx/32⌉] words over positions
    cells: Buffer  # [W] cell positions (decode)
    gp: Buffer  # (position, count) of the decode query
    tile_cells: Buffer  # [⌈ub/tile⌉, n_ctx] union lists (gathered prefill)
    tile_gp: Buffer  # (first position, |U|) per tile
    slots: Buffer  # [ub, ⌈n_ctx/32⌉] words over list slots
    pooled: Buffer  # [n_blocks, D_I] re-pooled κ (POOLED=0), shared by the layers
    tile: int  # queries per gathered-prefill tile
    n_ctx: int
    n_blocks: int
    mask_words: int
    W: int

    @classmethod
    def allocate(cls, gpu: "Gpu", hp: HParams, ub: int, n_ctx: int, r_min: int, cfg: QSAConfig) -> "QSABuffers":
        n_blocks = n_ctx // r_min + 1
        words = -(-n_ctx // 32)
        W = hp.B + max(hp.r) - 1
        tiles = -(-ub // GATHER_TILE) if cfg.gathered else 0  # the tile is fixed here, with the buffers
        return cls(cfg, gpu.buffer(4 * ub * hp.D_I, "qsa.rho"), gpu.buffer(4 * ub * hp.n_I * hp.D_I, "qsa.qI"),
                   gpu.buffer(4 * ub * n_blocks, "qsa.scores"), gpu.buffer(4 * ub * words, "qsa.mask"),
                   gpu.buffer(4 * W, "qsa.cells"), gpu.buffer(8, "qsa.gp"),
                   gpu.buffer(4 * max(1, tiles * n_ctx), "qsa.tile_cells"),
                   gpu.buffer(8 * max(1, tiles), "qsa.tile_gp"),
                   gpu.buffer(4 * (ub * words if cfg.gathered else 1), "qsa.slots"),
                   gpu.buffer(4 * (1 if cfg.pooled else n_blocks * hp.D_I), "qsa.pooled"), GATHER_TILE, n_ctx,
                   n_blocks, words, W)


@dataclass(frozen=True)
class GatheredTiles:
    """Gathered prefill (S2–S3): tile k (queries k·tile …) attends through tile_cells[k·n_ctx …]
    with its slot rows, params (first position, |U_k|) at tile_gp[2k]."""

    qb: QSABuffers
    n_tiles: int


def _qsa_select(g: "Graph", m: StepModel, i: int, n: int, u: Rows, idx: IndexerCache,
                qb: QSABuffers) -> CellMask | CellList | GatheredTiles:
    """(Q1)–(Q8): write ρ, pool the blocks this step completes (or all, POOLED=0), score the visible
    blocks and select: a gathered cell list (positions in qb.gp) for decode; for n > 1 per-query bit
    rows, turned into per-tile union lists (GP=1) or used as the mask of dense attention (GP=0)."""
    hp, w, p, cfg = m.hp, m.weights, m.params, qb.cfg
    b = f"blk.{i}."
    D, n_I, r = hp.D_I, hp.n_I, idx.r
    rho = Rows(qb.rho, n, D)
    matmul(g, w[b + "indexer.k_proj.weight"].matrix(), u, rho, name=b + "idx_k")
    kv_append(g, p.buf, p.pos, Heads(rho, 1, D), idx.keys, name=b + "cache_idx")
    summary = idx.summary_rows() if cfg.pooled else Rows(qb.pooled, idx.n_blocks, D)
    qsa_pool(g, p.buf, 0, idx.keys, w[b + "indexer.k_norm.weight"].buf, summary, r=r, T=n, n_rot=hp.n_rot,
             theta=hp.theta, eps=hp.eps, repool=not cfg.pooled, name=b + "qsa_pool")
    qI = Rows(qb.qI, n, n_I * D)
    matmul(g, w[b + "indexer.q_proj.weight"].matrix(), u, qI, name=b + "idx_q")
    heads = Rows(qb.qI, n * n_I, D)
    norm_rope(g, m, heads, n_I, w[b + "indexer.q_norm.weight"].buf, b + "idx_q_norm", b + "idx_q_rope")
    g.expose(b + "idx_q", qb.qI, 0, n, n_I * D, n_I * D, after=b + "idx_q_rope")  # final after norm + RoPE
    scores = Rows(qb.scores, n, qb.n_blocks)
    qsa_scores(g, p.buf, 0, qI, summary, scores, n_I=n_I, r=r, name=b + "idx_scores")
    g.expose(b + "idx_scores", qb.scores, 0, n, qb.n_blocks, qb.n_blocks)
    if n == 1:
        qsa_select(g, p.buf, 0, scores, Rows(qb.cells, 1, qb.W), r=r, B=hp.B, cell=cfg.cell, gather_params=qb.gp,
                   name=b + "qsa_select")
        return CellList(qb.cells, hp.W(i))
    sel = Rows(qb.mask, n, qb.mask_words)
    qsa_select(g, p.buf, 0, scores, sel, r=r, B=hp.B, cell=cfg.cell, name=b + "qsa_mask")
    if not cfg.gathered:
        return CellMask(qb.mask, qb.mask_words)
    tiles = qsa_union(g, p.buf, 0, sel, qb.tile_gp, qb.tile_cells, qb.n_ctx, Rows(qb.slots, n, qb.mask_words),
                      tile=qb.tile, name=b + "qsa_union")
    return GatheredTiles(qb, tiles)


def norm_rope(g: "Graph", m: StepModel, heads: Rows, n_heads: int, gamma: Buffer, norm_name: str,
              rope_name: str) -> None:
    """(A2)+(A3) in place on head rows: RMSNorm ⊙ γ then NeoX RoPE at the step's positions; one
    dispatch named `rope_name` (two with VKFLASH_DISABLE_FUSION=1)."""
    hp, p = m.hp, m.params
    if current()["VKFLASH_DISABLE_FUSION"]:
        rms_norm(g, heads, heads, hp.eps, gamma, name=norm_name)
        rope_neox(g, heads, heads, n_heads, hp.n_rot, hp.theta, p.buf, p.pos, name=rope_name)
        return
    rms_norm(g, heads, heads, hp.eps, gamma, name=rope_name, rope=Rope(n_heads, hp.n_rot, hp.theta, p.buf, p.pos))


def attention_sublayer(g: "Graph", m: StepModel, s: HybridScratch, i: int, n: int, u: Rows, out: Rows,
                       residual: bool, qsa: tuple[IndexerCache, QSABuffers] | None = None) -> None:
    """(A1)–(A8) on n tokens: out (+)= W_o(attn(RoPE(rms(q)), RoPE(rms(k)), v) ⊙ σ(gate)), masked or
    gathered by the QSA selection (§5.6) when `qsa` is given."""
    hp, w, p = m.hp, m.weights, m.params
    H, H_kv, Dh = hp.H, hp.H_kv, hp.Dh
    b = f"blk.{i}."
    qg, k, v = Rows(s.qg, n, 2 * H * Dh), Rows(s.k, n, H_kv * Dh), Rows(s.v, n, H_kv * Dh)
    fused = w.get(b + "attn_qkv.weight")
    if fused is not None:  # qwen3next's optional fused form: [q+gate | k | v] rows
        full = fused.matrix()
        for y, row0, rows, nm in ((qg, 0, 2 * H * Dh, "attn_q"), (k, 2 * H * Dh, H_kv * Dh, "attn_k"),
                                  (v, 2 * H * Dh + H_kv * Dh, H_kv * Dh, "Vcur")):
            matmul(g, QWeight(full.buf, full.qtype, full.k, rows, row0), u, y, name=b + nm)
    else:
        matmul(g, w[b + "attn_q.weight"].matrix(), u, qg, name=b + "attn_q")
        matmul(g, w[b + "attn_k.weight"].matrix(), u, k, name=b + "attn_k")
        matmul(g, w[b + "attn_v.weight"].matrix(), u, v, name=b + "Vcur")
    q_rows, k_rows = Rows(s.qg, n * H, Dh, 0, 2 * Dh), Rows(s.k, n * H_kv, Dh)
    norm_rope(g, m, q_rows, H, w[b + "attn_q_norm.weight"].buf, b + "Qnorm", b + "Qcur")
    g.expose(b + "Qcur", s.qg, 0, n * H, Dh, 2 * Dh)  # q rows between the gate rows
    norm_rope(g, m, k_rows, H_kv, w[b + "attn_k_norm.weight"].buf, b + "Knorm", b + "Kcur")
    cache = m.kv[i]
    append_kv(g, m, i, Heads(k, H_kv, Dh), Heads(v, H_kv, Dh), b)
    sel = _qsa_select(g, m, i, n, u, *qsa) if qsa is not None else None
    o = Rows(s.o, n, H * Dh)
    n_split = m.splits(n)
    partial = s.partial if n_split > 1 else None
    # (A5)–(A7) with the gate applied in the attention kernel: "attn_gated", not the reference's
    # pre-gate "kqv_out"
    if isinstance(sel, GatheredTiles):  # (S3) one gathered, slot-masked attention per query tile
        qb, words = sel.qb, sel.qb.mask_words
        for k in range(sel.n_tiles):
            t0 = k * qb.tile
            nt = min(n, t0 + qb.tile) - t0
            q, gate = q_and_gate(Rows(s.qg, nt, 2 * H * Dh, t0 * 2 * H * Dh), H, Dh)
            attention(g, qb.tile_gp, 2 * k, q, cache.k, cache.v, Heads(Rows(s.o, nt, H * Dh, t0 * H * Dh), H, Dh),
                      gate=gate, mask=CellMask(qb.slots, words, t0 * words),
                      cells=CellList(qb.tile_cells, qb.n_ctx, k * qb.n_ctx), n_split=n_split, partial=partial,
                      name=b + "attn_gated" + (f".{k}" if sel.n_tiles > 1 else ""))
    else:
        q, gate = q_and_gate(qg, H, Dh)
        params = qsa[1].gp if qsa is not None and isinstance(sel, CellList) else p.buf
        attention(g, params, 0, q, cache.k, cache.v, Heads(o, H, Dh), gate=gate,
                  mask=sel if isinstance(sel, CellMask) else None, cells=sel if isinstance(sel, CellList) else None,
                  n_split=n_split, partial=partial, name=b + "attn_gated")
    matmul(g, w[b + "attn_output.weight"].matrix(), o, out, Epilogue(res=out) if residual else Epilogue(),
           name=b + _out_name(residual))


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


def moe_sublayer(g: "Graph", m: StepModel, s: HybridScratch, i: int, n: int, u: Rows, out: Rows,
                 residual: bool) -> None:
    """(M1)–(M4): out (+)= Σ_j w_j·W_d^{(I_j)}(silu(W_g^{(I_j)}u) ⊙ W_u^{(I_j)}u) + σ(w_sg·u)·shared(u).
    Prefill routes through a GPU prepass plan and the tiled expert GEMM, decode through the expert GEMV."""
    hp, w = m.hp, m.weights
    b = f"blk.{i}."
    n_e, k, F, F_s, d = hp.E, hp.k, hp.F, hp.F_s, hp.d
    z, ids, wts = Rows(s.z, n, n_e, 0, n_e + 1), Rows(s.ids, n, k), Rows(s.w, n, k)
    sg = Rows(s.z, n, 1, n_e, n_e + 1)  # w_sg·u beside the router logits (σ applied by moe_combine)
    projections(g, w, u, Rows(s.z, n, n_e + 1), [(b + "ffn_gate_inp.weight", b + "ffn_moe_logits"),
                                                  (b + "ffn_gate_inp_shexp.weight", b + "ffn_shexp_g")])  # (M1)
    moe_router(g, z, ids, wts, k, name=b + "ffn_moe_topk")  # (M1)–(M3)
    plan = None if n <= MOE_GEMV_MAX_T else MoEPlan(s.plan, n, k, n_e, tile_width(n, k, n_e))
    ys = Rows(s.ys, n * k, d)
    moe_routed(g, u, ids, wts, _experts(m, b), Rows(s.h, n * k, F), ys, plan, name=b + "ffn_moe")
    gs, hs, sh = Rows(s.sh_gate, n, F_s), Rows(s.sh_h, n, F_s), Rows(s.sh_out, n, d)
    glu = w.stacked(b + "ffn_gate_shexp.weight", b + "ffn_up_shexp.weight")
    if glu is not None:  # silu(gate) ⊙ up in one pass
        glu_matmul(g, glu, u, hs, name=b + "ffn_shexp_glu")
    else:
        matmul(g, w[b + "ffn_gate_shexp.weight"].matrix(), u, gs, Epilogue(act="silu"), name=b + "ffn_shexp_gate")
        matmul(g, w[b + "ffn_up_shexp.weight"].matrix(), u, hs, Epilogue(mul=gs), name=b + "ffn_shexp_up")
    f = Rows(s.f, n, d) if residual else out
    shared_out_combine(g, w[b + "ffn_down_shexp.weight"].matrix(), hs, ys, sg, f, k, sh, name=b + "ffn_out")  # (M4)
    if residual:
        E.add(g, out, f, out, name=b + "l_out")
