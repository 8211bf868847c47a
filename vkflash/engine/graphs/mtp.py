"""The qwen4exp MTP draft head as step graphs (MODEL.md §5.10 T1–T6, drafting protocol D1), stated
like the trunk's step graph with its sublayers. For one row (token x at position p, hidden H):

    ê = rms(emb[x]) ⊙ enorm;  Ĥ_c = rms(H_c) ⊙ hnorm_c                                  (T1, T2)
    R_c = W_fe ê + W_fh Ĥ_c   per stream (W_eh = [W_fe | W_fh], the embedding half first)  (T3)
    (u, ι) = Mix(R; hc_attn);  R = Combine(R, Attn(u), ι)   dense, the head's own K/V     (T4)
    (u, ι) = Mix(R; hc_ffn);   R = Combine(R, MoE(u), ι)
    logits = W_out' Mix(R; nextn.hc_head), their argmax; R is the next chained row's H    (T5, T6)

Catch-up rows (D1: positions whose target hidden is known) matter only through the K/V they leave
in the head's cache, so they stop after (A4). A round of drafting is one graph: the catch-up rows
that are pending, the draft row (x_n, H_target[n−1]), then k−1 chained rows, each reading the
token the row before it drafted from the device (no host round trip between drafted tokens).
The head's cache has no row for position 0 (D1 starts at p = 1), so its cell c holds position
c + 1 (StepParams.cell_shift).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from vkflash.engine.graphs.common import StepModel, embed_tokens
from vkflash.engine.graphs.hybrid import attention_sublayer, moe_sublayer
from vkflash.engine.graphs.qwen4exp import mix
from vkflash.engine.step_params import StepParams
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops import argmax as argmax_op
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.attention import Heads, kv_append
from vkflash.gpu.ops.embed import embed
from vkflash.gpu.ops.hc import hc_broadcast, hc_combine
from vkflash.gpu.ops.matmul import QWeight, matmul
from vkflash.gpu.ops.norm import grouped_rms_norm, rms_norm
from vkflash.gpu.ops.rope import rope_neox
from vkflash.gpu.ops.views import Rows

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph

CELL_SHIFT = 1
"""The head's cache cell c holds position c + 1 (no row for position 0)."""


@dataclass
class DraftModel:
    """What the draft graphs are built from. `model` is a StepModel over the MTP block's weights
    (borrowed embedding, LM head and head mixer under their own names: `token_embd.weight`,
    `output.weight`, blk.L.nextn.hc_head_*), the head's K/V cache of layer L, the catch-up rows'
    step params and head buffers of one row per drafted token. `hidden` holds the target's
    h_nextn rows of its last step, `chain` the R¹ of the last drafted row; `rows[j]` are the
    params of draft row j of a round (the draft row, then the chained rows)."""

    model: StepModel
    hidden: Buffer
    chain: Buffer
    rows: list[StepParams]


def _eh(m: StepModel) -> tuple[QWeight, QWeight]:
    """W_fe and W_fh (rows of eh_proj as re-laid at upload: qwen4exp.eh_halves)."""
    W = m.weights[f"blk.{m.hp.L}.nextn.eh_proj.weight"].matrix()
    d = m.hp.d
    return QWeight(W.buf, W.qtype, d, d, W.row0), QWeight(W.buf, W.qtype, d, d, W.row0 + d)


def draft_inputs(g: "Graph", m: StepModel, e: Rows, H: Rows, R: Rows) -> None:
    """(T1)–(T3) R = W_fe rms(e)⊙enorm + W_fh rms(H_c)⊙hnorm_c per stream, for the rows of e (n × d)
    and H (n × hc·d); R (n × hc·d) may be H's own view (H is read first)."""
    hp, w = m.hp, m.weights
    n, hc, d = e.n_rows, hp.hc, hp.d
    b = f"blk.{hp.L}.nextn."
    en, Hn = g.tensor(n, d, "mtp.inp_e"), g.tensor(n, hc * d, "mtp.inp_h")
    rms_norm(g, e, en, hp.eps, w[b + "enorm.weight"].buf, name="mtp.inp_e")  # (T1)
    grouped_rms_norm(g, H, Hn, hc, hp.eps, w[b + "hnorm.weight"].buf, name="mtp.inp_h")  # (T2)
    W_fe, W_fh = _eh(m)
    fe, E_b = g.tensor(n, d, "mtp.eh_e"), g.tensor(n, hc * d, "mtp.eh_e.streams")
    matmul(g, W_fe, en, fe, name="mtp.eh_e")  # (T3) the embedding half, once for every stream
    hc_broadcast(g, fe, E_b, hc, name="mtp.eh_e.streams")
    streams = Rows(R.buf, n * hc, d, R.off)  # R and Ĥ as one row per stream
    matmul(g, W_fh, Rows(Hn.buf, n * hc, d, Hn.off), streams, name="mtp.eh")
    E.add(g, streams, Rows(E_b.buf, n * hc, d, E_b.off), streams, name="mtp.eh")


def cache_rows(g: "Graph", m: StepModel, u: Rows) -> None:
    """(A1)–(A4) for catch-up rows: only their K and V (RoPE'd, appended to the head's cache) are
    ever read, so the rest of the block does not run for them."""
    hp, w, p, n = m.hp, m.weights, m.params, u.n_rows
    H_kv, Dh = hp.H_kv, hp.Dh
    b = f"blk.{hp.L}."
    k, v = g.tensor(n, H_kv * Dh, b + "Kcur"), g.tensor(n, H_kv * Dh, b + "Vcur")
    matmul(g, w[b + "attn_k.weight"].matrix(), u, k, name=b + "attn_k")
    matmul(g, w[b + "attn_v.weight"].matrix(), u, v, name=b + "Vcur")
    rows = Rows(k.buf, n * H_kv, Dh, k.off)
    rms_norm(g, rows, rows, hp.eps, w[b + "attn_k_norm.weight"].buf, name=b + "Knorm")
    rope_neox(g, rows, rows, H_kv, hp.n_rot, hp.theta, p.buf, p.rope, name=b + "Kcur")
    cache = m.kv[hp.L]
    kv_append(g, p.buf, p.pos, Heads(k, H_kv, Dh), cache.k, name=b + "cache_k")
    kv_append(g, p.buf, p.pos, Heads(v, H_kv, Dh), cache.v, name=b + "cache_v")


def catch_up(g: "Graph", d: DraftModel, n: int) -> None:
    """(D1) catch-up rows: tokens and positions in the model's params, hidden rows [0, n) of the
    target's last step; each row's K/V into the head's cache."""
    m, hp = d.model, d.model.hp
    H = Rows(d.hidden, n, hp.hc * hp.d)
    R = g.tensor(n, hp.hc * hp.d, "mtp.R")
    draft_inputs(g, m, embed_tokens(g, m, n), H, R)
    u, _ = mix(g, m, R, f"blk.{hp.L}.hc_attn", f"blk.{hp.L}.hc_attn_mix", False)
    cache_rows(g, m, u)


def draft_row(g: "Graph", d: DraftModel, j: int, H: Rows, device_token: bool) -> None:
    """(T1)–(T6) for draft row j of a round (params rows[j]): its token from the params, or with
    `device_token` the one row j−1 drafted; H its hidden row. Logits into head row j, their argmax
    into head.ids[j], R¹ into `chain`."""
    hp = d.model.hp
    m = replace(d.model, params=d.rows[j])
    b = f"blk.{hp.L}."
    if device_token:
        t = m.weights["token_embd.weight"]
        e = g.tensor(1, hp.d, "inp_embd")
        embed(g, t.buf, int(t.qtype), hp.V, m.head.ids, 1, e, ids_off=j - 1, name="inp_embd")
    else:
        e = embed_tokens(g, m, 1)
    R = Rows(d.chain, 1, hp.hc * hp.d)
    draft_inputs(g, m, e, H, R)
    u, iota = mix(g, m, R, b + "hc_attn", b + "hc_attn_mix", True)  # (T4)
    assert iota is not None
    hc_combine(g, R, attention_sublayer(g, m, hp.L, u), iota, name=b + "attn_residual")
    u, iota = mix(g, m, R, b + "hc_ffn", b + "hc_ffn_mix", True)
    assert iota is not None
    hc_combine(g, R, moe_sublayer(g, m, hp.L, u), iota, name=b + "l_out")
    y, _ = mix(g, m, R, b + "nextn.hc_head", "mtp.result_norm", False)  # (T5)
    out = m.weights["output.weight"]
    logits = Rows(m.head.logits, 1, hp.V, j * hp.V)
    matmul(g, out.matrix(), y, logits, name="mtp.result_output")
    argmax_op.argmax(g, logits, m.head.ids, out_off=j, name="mtp.argmax")


def draft_round(g: "Graph", d: DraftModel, c: int, k: int, device_chain: bool) -> None:
    """One round of drafting: c − 1 pending catch-up rows (hidden rows [0, c−1)), the draft row
    (hidden row c − 1), and with `device_chain` k − 1 chained rows (each on the R¹ before it)."""
    hp = d.model.hp
    if c > 1:
        catch_up(g, d, c - 1)
    draft_row(g, d, 0, Rows(d.hidden, 1, hp.hc * hp.d, (c - 1) * hp.hc * hp.d), False)
    for j in range(1, k if device_chain else 1):
        draft_row(g, d, j, Rows(d.chain, 1, hp.hc * hp.d), True)


def chained_row(g: "Graph", d: DraftModel, j: int) -> None:
    """Chained draft row j alone, its token written by the host (a sampled draft)."""
    hp = d.model.hp
    draft_row(g, d, j, Rows(d.chain, 1, hp.hc * hp.d), False)
