"""qwen2 (dense llama-style) reference forward: RMSNorm pre-norm blocks, NeoX RoPE attention with
q/k/v biases and no gate, SwiGLU FFN, output_norm. The real-weights regression model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vkflash.model.layers.attention import KVCache, dense_attention_layer
from vkflash.model.layers.common import RefOptions, Snapshots, emit, emit_global
from vkflash.model.layers.moe import dense_ffn
from vkflash.model.layers.norms import rms_norm
from vkflash.model.weights import Weights


@dataclass
class State(Snapshots):
    """Per-sequence state: position and one K/V cache per layer."""

    weights: Weights
    opts: RefOptions
    layers: list[KVCache]
    n: int = 0


def new_state(weights: Weights, **options: Any) -> State:
    """A fresh sequence: empty K/V caches."""
    opts = RefOptions(**options)
    return State(weights, opts, [KVCache.empty(weights.hp, np.dtype(opts.cache_dtype)) for _ in range(weights.hp.L)])


def prefill(tokens: Any, st: State) -> np.ndarray:
    """One ubatch through every block; updates st; logits (T, V)."""
    w, opts = st.weights, st.opts
    hp = w.hp
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    pos = st.n + np.arange(len(tokens))
    h = w.token_embd[tokens]
    emit_global(opts, "inp_embd", h)
    for i in range(hp.L):
        blk = w.blocks[i]
        u = rms_norm(h, blk.attn_norm, hp.eps)
        emit(opts, i, "attn_norm", u)
        a = dense_attention_layer(u, pos, blk.mixer, hp, st.layers[i], opts, i)
        emit(opts, i, "attn_out", a)
        h = h + a
        emit(opts, i, "attn_residual", h)
        u = rms_norm(h, blk.ffn_norm, hp.eps)
        emit(opts, i, "ffn_norm", u)
        f = dense_ffn(u, blk.ffn)
        emit(opts, i, "ffn_out", f)
        h = h + f
        emit(opts, i, "l_out", h)
    y = rms_norm(h, w.output_norm, hp.eps)
    emit_global(opts, "result_norm", y)
    logits = y @ w.output.T
    emit_global(opts, "result_output", logits)
    st.n += len(tokens)
    return logits
