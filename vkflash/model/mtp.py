"""qwen4exp MTP draft head (MODEL.md §5.10 T1–T6) and the greedy drafting protocol (D1–D4).

Fork design, unverified against any llama.cpp (§1). Rollback of the target after a partial
accept restores a state snapshot and re-runs the accepted tokens, so the target state equals a
fresh run on the accepted prefix by construction.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vkflash.errors import ModelError
from vkflash.model import qwen4exp
from vkflash.model.layers.attention import KVCache, attention_output, project
from vkflash.model.layers.common import RefOptions, emit, emit_global
from vkflash.model.layers.hc import hc_combine, hc_mix
from vkflash.model.layers.moe import moe
from vkflash.model.layers.norms import grouped_rms_norm, rms, rms_norm
from vkflash.model.weights import AttnW, HCMixW, MTPW, Weights


@dataclass
class MTPState:
    """The draft head's weights (with borrowed embedding/head/mixer), own K/V cache and row positions."""

    mtp: MTPW
    embed: np.ndarray
    out: np.ndarray
    head: HCMixW
    hp: Any
    opts: RefOptions
    kv: KVCache
    kv_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # position of each cached row
    next_pos: int = 1  # first position without a row written from a target hidden (D1)

    def snapshot(self) -> MTPState:
        return copy.deepcopy(self, memo={id(self.mtp): self.mtp, id(self.embed): self.embed, id(self.out): self.out,
                                         id(self.head): self.head, id(self.hp): self.hp, id(self.opts): self.opts})

    def drop_after(self, p: int) -> None:
        """(D4) drop cached rows at positions > p."""
        keep = self.kv_pos <= p
        self.kv.k, self.kv.v, self.kv_pos = self.kv.k[keep], self.kv.v[keep], self.kv_pos[keep]


def new_mtp_state(target: Weights, draft: Weights | None = None, **options: Any) -> MTPState:
    """Draft state for a target; `draft` is an MTP-only file (else the target's own blk.L)."""
    src = draft if draft is not None else target
    if src.mtp is None:
        raise ModelError("no MTP block (blk.L.nextn.*) in the model or draft file")
    m = src.mtp
    embed = m.embed if m.embed is not None else target.token_embd
    out = m.out if m.out is not None else target.output
    head = m.head if m.head is not None else target.output_hc
    opts = RefOptions(**options)
    return MTPState(m, embed, out, head, target.hp, opts, KVCache.empty(target.hp, np.dtype(opts.cache_dtype)))


def mtp_rows(x: np.ndarray, H: np.ndarray, pos: np.ndarray, ms: MTPState) -> tuple[np.ndarray, np.ndarray]:
    """(T1)–(T5) for rows (x_p, H) at positions pos: draft logits (T, V) and R¹ (T, hc, d)."""
    hp, m, opts = ms.hp, ms.mtp, ms.opts
    T, d = len(x), hp.d
    e = rms_norm(ms.embed[np.asarray(x)], m.enorm, hp.eps)  # (T1)
    emit_global(opts, "mtp.inp_e", e)
    if opts.mtp_hnorm == "grouped":  # (T2)
        Hn = grouped_rms_norm(H, m.hnorm, hp.eps)
    else:
        Hn = (rms(H.reshape(T, -1), hp.eps) * m.hnorm).reshape(H.shape)
    emit_global(opts, "mtp.inp_h", Hn)
    R = (e @ m.eh_proj[:, :d].T)[:, None, :] + Hn @ m.eh_proj[:, d:].T  # (T3) embedding half first
    emit_global(opts, "mtp.eh", R)
    i, blk = hp.L, m.block
    u, iota = hc_mix(R, blk.hc_attn, hp.eps)  # (T4) one trunk-style block, dense attention
    emit(opts, i, "hc_attn_mix", u)
    attn: AttnW = blk.mixer  # type: ignore[assignment]
    P = project(u, pos, attn, hp, opts, i)
    ms.kv.append(P.k, P.v)
    ms.kv_pos = np.concatenate([ms.kv_pos, np.asarray(pos, np.int64)])
    mask = ms.kv_pos[None, :] <= np.asarray(pos)[:, None]
    a = attention_output(P, ms.kv, mask, attn, opts, i)
    emit(opts, i, "attn_out", a)
    R = hc_combine(R, a, iota)
    u, iota = hc_mix(R, blk.hc_ffn, hp.eps)
    f = moe(u, blk.ffn, hp.k, opts, i)  # type: ignore[arg-type]
    emit(opts, i, "ffn_out", f)
    R = hc_combine(R, f, iota)
    emit(opts, i, "l_out", R)
    y, _ = hc_mix(R, ms.head, hp.eps)  # (T5) own head mixer, no inject
    emit_global(opts, "mtp.result_norm", y)
    logits = y @ ms.out.T
    emit_global(opts, "mtp.result_output", logits)
    return logits, R  # (T6) R¹ is the next chained H


def confidence(logits: np.ndarray, token: int, top_k: int) -> float:
    """Draft confidence: softmax over the top-K_d logits, read at `token` (one of them)."""
    top = np.sort(logits)[-top_k:]
    return float(np.exp(logits[token] - top[-1]) / np.exp(top - top[-1]).sum())


def draft(target: qwen4exp.State, ms: MTPState, x_n: int, n_max: int = 3) -> list[int]:
    """(D1) catch-up rows, the draft row and chained rows: n_max greedy drafts, never cut by confidence
    (p_min 0; engine/speculate.py applies DRAFT_PMIN); (D4) then drops rows at positions > n."""
    if target.hidden is None:
        raise ModelError("MTP drafting needs the target state's hidden rows (new_state(..., keep_hidden=True))")
    n = target.n
    toks = np.asarray(target.tokens + [x_n], np.int64)
    p = np.arange(max(ms.next_pos, 1), n + 1)  # catch-up 1 ≤ p < n, then the draft row at p = n
    logits, R = mtp_rows(toks[p], target.hidden[p - 1], p, ms) if len(p) else (None, None)
    ms.next_pos = n + 1
    drafts: list[int] = []
    if logits is None:
        return drafts
    row, H = logits[-1], R[-1:]
    while len(drafts) < n_max:
        d_tok = int(np.argmax(row))
        drafts.append(d_tok)
        if len(drafts) == n_max:
            break
        lg, H = mtp_rows(np.array([d_tok]), H, np.array([n + len(drafts)]), ms)  # chained row
        row = lg[-1]
    ms.drop_after(n)  # (D4)
    return drafts


def verify(target: qwen4exp.State, x_n: int, drafts: list[int]) -> tuple[list[int], int]:
    """(D2)–(D3) verify [x_n, drafts] in one batch; keep the accepted prefix; returns (accepted, bonus)."""
    snap = target.snapshot()
    y = np.argmax(qwen4exp.forward([x_n, *drafts], target).logits, axis=1)
    a = 0
    while a < len(drafts) and int(y[a]) == drafts[a]:
        a += 1
    accepted = [x_n, *drafts[:a]]
    if a < len(drafts):  # roll back: restore the snapshot and re-run the accepted tokens
        target.__dict__.update(snap.__dict__)
        qwen4exp.forward(accepted, target)
    return accepted, int(y[a])


def generate(target: qwen4exp.State, ms: MTPState, prompt: list[int], n_new: int, n_max: int = 3) -> list[int]:
    """Greedy generation with MTP speculation: the same tokens as plain greedy decoding."""
    x = int(np.argmax(qwen4exp.forward(prompt, target).logits[-1]))
    out = [x]
    while len(out) < n_new:
        accepted, x = verify(target, x, draft(target, ms, x, n_max))
        out.extend(accepted[1:])
        out.append(x)
    return out[:n_new]
