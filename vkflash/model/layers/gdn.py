"""Gated DeltaNet layer (MODEL.md §5.4 G1–G10): causal conv with state, decode recurrence (G8)
and the exactly equal chunked prefill (GC1–GC6)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vkflash.model.hparams import HParams
from vkflash.model.layers.common import RefOptions, emit, sigmoid, silu, softplus
from vkflash.model.layers.norms import l2_norm, rms
from vkflash.model.weights import GDNW


@dataclass
class GDNState:
    """Per-layer GDN state: conv (K_c−1, C) of raw m, SSM S (n_v, S, S) with row = key index."""

    conv: np.ndarray
    ssm: np.ndarray

    @classmethod
    def zeros(cls, hp: HParams, dtype: np.dtype) -> GDNState:
        return cls(np.zeros((hp.K_c - 1, hp.C), dtype), np.zeros((hp.n_v, hp.S, hp.S), dtype))


def causal_conv(m: np.ndarray, state: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(G4) c[t, ch] = silu(Σ_k w[ch,k]·X[t+k, ch]) over X = [state; m]; new state = last K−1 rows of X."""
    K = w.shape[1]
    X = np.concatenate([state, m])
    T = len(m)
    acc = np.zeros_like(m)
    for k in range(K):
        acc += w[:, k] * X[k: k + T]
    return silu(acc), X[len(X) - (K - 1):].copy()


def recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, g: np.ndarray,
              S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(G8) token by token: S ← e^g S; δ = β(v − Sᵀk); S ← S + k δᵀ; o = Sᵀq. Inputs (T, n_v, S)."""
    S = S.copy()
    o = np.empty_like(v)
    for t in range(len(v)):
        S *= np.exp(g[t])[:, None, None]
        delta = beta[t][:, None] * (v[t] - np.einsum("jab,ja->jb", S, k[t]))
        S += k[t][:, :, None] * delta[:, None, :]
        o[t] = np.einsum("jab,ja->jb", S, q[t])
    return o, S


def _forward_subst(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Solve A X = B for unit lower-triangular A (heads, n, n), B (heads, n, S), row by row."""
    X = B.copy()
    for i in range(1, A.shape[1]):
        X[:, i] -= np.einsum("jl,jls->js", A[:, i, :i], X[:, :i])
    return X


def chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, g: np.ndarray,
            S: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(GC1)–(GC6) chunk by chunk, all heads at once; equal to `recurrent` up to rounding."""
    o = np.empty_like(v)
    for c0 in range(0, len(v), chunk):
        sl = slice(c0, min(c0 + chunk, len(v)))
        Q, K, V = (x[sl].transpose(1, 0, 2) for x in (q, k, v))  # (n_v, n, S)
        b, gg = beta[sl].T, g[sl].T  # (n_v, n)
        n = Q.shape[1]
        gam = np.cumsum(gg, axis=1)  # (GC1) γ_i = Σ_{l≤i} g_l
        lower = np.tril(np.ones((n, n), dtype=bool))
        diff = np.where(lower, gam[:, :, None] - gam[:, None, :], -np.inf)
        Gam = np.exp(diff)  # Γ_il = e^{γ_i−γ_l} for l ≤ i, else 0
        KK = K @ K.transpose(0, 2, 1)
        A = np.eye(n, dtype=b.dtype) + np.tril(b[:, :, None] * KK * Gam, -1)  # (GC2)
        U = _forward_subst(A, b[:, :, None] * V)  # (GC3)
        Wk = _forward_subst(A, (b * np.exp(gam))[:, :, None] * K)
        Vp = U - Wk @ S  # (GC4)
        O = np.exp(gam)[:, :, None] * (Q @ S) + ((Q @ K.transpose(0, 2, 1)) * Gam) @ Vp  # (GC5)
        last = gam[:, -1]
        S = np.exp(last)[:, None, None] * S + (K * np.exp(last[:, None] - gam)[:, :, None]).transpose(0, 2, 1) @ Vp
        o[sl] = O.transpose(1, 0, 2)  # (GC6) above
    return o, S


def head_map(hp: HParams) -> np.ndarray:
    """(G7) π(j): tiled j mod n_k for qwen4exp, grouped ⌊j/ρ⌋ for qwen3next."""
    j = np.arange(hp.n_v)
    return j % hp.n_k if hp.arch == "qwen4exp" else j // hp.rho


def gdn_layer(u: np.ndarray, w: GDNW, hp: HParams, st: GDNState, opts: RefOptions, i: int) -> np.ndarray:
    """(G1)–(G10) for a ubatch u (T, d); updates st in place; returns out (T, d)."""
    T, S, n_k, n_v = len(u), hp.S, hp.n_k, hp.n_v
    m = u @ w.wqkv.T  # (G1)
    z = u @ w.wz.T
    beta = sigmoid(u @ w.wbeta.T)  # (G2)
    g = softplus(u @ w.walpha.T + w.dt_bias) * w.a  # (G3)
    for op, x in (("gdn_qkv", m), ("gdn_z", z), ("gdn_beta", beta), ("gdn_g", g)):
        emit(opts, i, op, x)
    c, st.conv = causal_conv(m, st.conv, w.conv)  # (G4)
    emit(opts, i, "gdn_conv", c)
    q, k, v = np.split(c, [n_k * S, 2 * n_k * S], axis=1)  # (G5)
    q = l2_norm(q.reshape(T, n_k, S), hp.eps) / math.sqrt(S)  # (G6)
    k = l2_norm(k.reshape(T, n_k, S), hp.eps)
    v = v.reshape(T, n_v, S)
    emit(opts, i, "gdn_q", q)
    emit(opts, i, "gdn_k", k)
    pi = head_map(hp)  # (G7)
    if T > 1 and opts.gdn_chunk > 0:
        o, st.ssm = chunked(q[:, pi], k[:, pi], v, beta, g, st.ssm, opts.gdn_chunk)
    else:
        o, st.ssm = recurrent(q[:, pi], k[:, pi], v, beta, g, st.ssm)  # (G8)
    emit(opts, i, "gdn_o", o)
    act = sigmoid if hp.arch == "qwen4exp" else silu
    y = rms(o, hp.eps) * w.norm * act(z.reshape(T, n_v, S))  # (G9)
    emit(opts, i, "gdn_gated", y)
    return y.reshape(T, n_v * S) @ w.wo.T  # (G10)
