"""Attention (MODEL.md §5.5 A1–A8): gated qwen4exp/qwen3next heads, plain qwen2 heads with biases,
a KV cache rounded at write, and the masked and gathered (S1–S3) executions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vkflash.model.hparams import HParams
from vkflash.model.layers.common import RefOptions, emit, sigmoid, softmax
from vkflash.model.layers.norms import rms_norm
from vkflash.model.layers.rope import rope_neox
from vkflash.model.weights import AttnW


@dataclass
class KVCache:
    """K and V rows by sequence position, (n, H_kv, Dh), stored in the cache dtype (rounded at write)."""

    k: np.ndarray
    v: np.ndarray

    @classmethod
    def empty(cls, hp: HParams, dtype: np.dtype) -> KVCache:
        return cls(np.zeros((0, hp.H_kv, hp.Dh), dtype), np.zeros((0, hp.H_kv, hp.Dh), dtype))

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """(A4) write k, v at the next positions."""
        self.k = np.concatenate([self.k, k.astype(self.k.dtype)])
        self.v = np.concatenate([self.v, v.astype(self.v.dtype)])

    def __len__(self) -> int:
        return len(self.k)


@dataclass
class Projected:
    """One ubatch's roped q (T, H, Dh), k, v (T, H_kv, Dh) and the gate (T, H, Dh) or None."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    gate: np.ndarray | None


def project(u: np.ndarray, pos: np.ndarray, w: AttnW, hp: HParams, opts: RefOptions, i: int) -> Projected:
    """(A1)–(A3): q, gate, k, v; q/k norms when present; NeoX RoPE on q and k after the norm."""
    T, H, H_kv, Dh = len(u), hp.H, hp.H_kv, hp.Dh
    q = u @ w.wq.T
    k = u @ w.wk.T
    v = u @ w.wv.T
    if w.bq is not None:
        q, k, v = q + w.bq, k + w.bk, v + w.bv
    q, k, v = q.reshape(T, H, Dh), k.reshape(T, H_kv, Dh), v.reshape(T, H_kv, Dh)
    gate = None if w.wgate is None else (u @ w.wgate.T).reshape(T, H, Dh)
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, hp.eps), rms_norm(k, w.k_norm, hp.eps)  # (A2)
    q, k = rope_neox(q, pos, hp.n_rot, hp.theta), rope_neox(k, pos, hp.n_rot, hp.theta)  # (A3)
    emit(opts, i, "Qcur", q)
    emit(opts, i, "Kcur", k)
    emit(opts, i, "Vcur", v)
    if gate is not None:
        emit(opts, i, "attn_gate", gate)
    return Projected(q, k, v, gate)


def attend(q: np.ndarray, K: np.ndarray, V: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(A5)–(A6): o_h = softmax(q_h·k_{g,j}/√Dh + M)·v_g with g = ⌊h/(H/H_kv)⌋; mask (T, n) bool."""
    H, H_kv, Dh = q.shape[1], K.shape[1], q.shape[2]
    g = np.arange(H) // (H // H_kv)
    s = np.einsum("thd,nhd->htn", q, K[:, g]) / math.sqrt(Dh)
    s = np.where(mask[None], s, -np.inf)
    return np.einsum("htn,nhd->thd", softmax(s, axis=-1), V[:, g])


def attend_gathered(q: np.ndarray, K: np.ndarray, V: np.ndarray, mask: np.ndarray, tile: int) -> np.ndarray:
    """(S1)–(S3): per query tile, gather the union U of selected cells and attend over U with the
    per-query mask restricted to U; equal to `attend` up to summation order."""
    out = np.empty_like(q)
    for t0 in range(0, len(q), tile):
        sl = slice(t0, t0 + tile)
        U = np.flatnonzero(mask[sl].any(axis=0))  # (S2) sorted union
        out[sl] = attend(q[sl], K[U], V[U], mask[sl][:, U])  # (S3)
    return out


def causal_mask(pos: np.ndarray, n_kv: int) -> np.ndarray:
    """M_t[j] = (j ≤ p_t), (T, n_kv) bool."""
    return np.arange(n_kv)[None, :] <= np.asarray(pos)[:, None]


def attention_output(P: Projected, kv: KVCache, mask: np.ndarray, w: AttnW, opts: RefOptions, i: int) -> np.ndarray:
    """(A5)–(A8) over the cache (after P was written): attention, σ(gate), W_o."""
    dtype = P.q.dtype
    K, V = kv.k.astype(dtype), kv.v.astype(dtype)
    o = attend_gathered(P.q, K, V, mask, opts.gather_tile) if opts.gathered else attend(P.q, K, V, mask)
    emit(opts, i, "kqv_out", o)
    if P.gate is not None:
        o = o * sigmoid(P.gate)  # (A7)
    return o.reshape(len(o), -1) @ w.wo.T  # (A8)


def dense_attention_layer(u: np.ndarray, pos: np.ndarray, w: AttnW, hp: HParams, kv: KVCache,
                          opts: RefOptions, i: int) -> np.ndarray:
    """(A1)–(A8) with the causal mask only (qwen3next, qwen2, the MTP block, QSA layers with r = 0)."""
    P = project(u, pos, w, hp, opts, i)
    kv.append(P.k, P.v)  # (A4)
    return attention_output(P, kv, causal_mask(pos, len(kv)), w, opts, i)
