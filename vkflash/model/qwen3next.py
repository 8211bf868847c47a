"""qwen3next (Qwen3-Next) reference forward (MODEL.md §5.9 N1–N4): pre-norm residual, grouped-head
GDN with silu gate, NeoX gated attention, MoE, output_norm. Decode = prefill of one token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vkflash.model.layers.attention import KVCache, dense_attention_layer
from vkflash.model.layers.common import RefOptions, Snapshots, emit, emit_global
from vkflash.model.layers.gdn import GDNState, gdn_layer
from vkflash.model.layers.moe import moe
from vkflash.model.layers.norms import rms_norm
from vkflash.model.weights import Weights


@dataclass
class State(Snapshots):
    """Per-sequence state: position and per-layer GDN states or K/V caches."""

    weights: Weights
    opts: RefOptions
    layers: list[GDNState | KVCache]
    n: int = 0


def new_state(weights: Weights, **options: Any) -> State:
    """A fresh sequence: zero recurrent states, empty caches."""
    hp, opts = weights.hp, RefOptions(**options)
    layers: list[GDNState | KVCache] = [
        GDNState.zeros(hp, weights.dtype) if hp.is_gdn[i] else KVCache.empty(hp, np.dtype(opts.cache_dtype))
        for i in range(hp.L)]
    return State(weights, opts, layers)


def prefill(tokens: Any, st: State) -> np.ndarray:
    """(E1), (N1), (N2) for one ubatch; updates st; logits (T, V)."""
    w, opts = st.weights, st.opts
    hp = w.hp
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    pos = st.n + np.arange(len(tokens))
    h = w.token_embd[tokens]  # (E1)
    emit_global(opts, "inp_embd", h)
    for i in range(hp.L):
        blk = w.blocks[i]
        u = rms_norm(h, blk.attn_norm, hp.eps)  # (N1)
        emit(opts, i, "attn_norm", u)
        layer_st = st.layers[i]
        if isinstance(layer_st, GDNState):
            a = gdn_layer(u, blk.mixer, hp, layer_st, opts, i)  # (N3)
        else:
            a = dense_attention_layer(u, pos, blk.mixer, hp, layer_st, opts, i)  # (N4)
        emit(opts, i, "attn_out", a)
        h = h + a
        emit(opts, i, "attn_residual", h)
        u = rms_norm(h, blk.ffn_norm, hp.eps)
        emit(opts, i, "ffn_norm", u)
        f = moe(u, blk.ffn, hp.k, opts, i)
        emit(opts, i, "ffn_out", f)
        h = h + f
        emit(opts, i, "l_out", h)
    y = rms_norm(h, w.output_norm, hp.eps)  # (N2)
    emit_global(opts, "result_norm", y)
    logits = y @ w.output.T
    emit_global(opts, "result_output", logits)
    st.n += len(tokens)
    return logits
