"""MoE with shared expert (MODEL.md §5.7 M1–M4) and the dense SwiGLU FFN of qwen2."""

from __future__ import annotations

import numpy as np

from vkflash.model.layers.common import RefOptions, emit, sigmoid, silu, softmax
from vkflash.model.weights import DenseFFNW, MoEW

DENOM_CLAMP = 6.103515625e-5  # 2⁻¹⁴


def moe(u: np.ndarray, w: MoEW, k: int, opts: RefOptions, i: int) -> np.ndarray:
    """f = Σ_i w_i·expert_{I_i}(u) + σ(w_sg·u)·shared(u) for u (T, d)."""
    z = u @ w.router.T  # (M1)
    p = softmax(z)
    I = np.argsort(-p, axis=1, kind="stable")[:, :k]  # (M2) ties → lower index
    if opts.route is not None:
        I = opts.route(i, p, I)
    pI = np.take_along_axis(p, I, axis=1)
    wts = pI / np.maximum(pI.sum(axis=1, keepdims=True), DENOM_CLAMP)  # (M3)
    for op, x in (("ffn_moe_logits", z), ("ffn_moe_probs", p), ("ffn_moe_topk", I), ("ffn_moe_weights", wts)):
        emit(opts, i, op, x)
    routed = np.zeros_like(u)
    for e in np.unique(I):  # (M4), grouped by expert
        rows, slot = np.nonzero(I == e)
        x = u[rows]
        h = silu(x @ w.gate[e].T) * (x @ w.up[e].T)
        routed[rows] += wts[rows, slot][:, None] * (h @ w.down[e].T)
    shared = sigmoid(u @ w.sh_gate_inp)[:, None] * ((silu(u @ w.sh_gate.T) * (u @ w.sh_up.T)) @ w.sh_down.T)
    emit(opts, i, "ffn_moe_out", routed)
    emit(opts, i, "ffn_shexp_out", shared)
    return routed + shared


def dense_ffn(u: np.ndarray, w: DenseFFNW) -> np.ndarray:
    """qwen2 SwiGLU: W_d(silu(W_g u) ⊙ W_u u)."""
    return (silu(u @ w.gate.T) * (u @ w.up.T)) @ w.down.T
