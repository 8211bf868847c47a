"""qwen4exp (Qwen3.8-Flash-Next) reference forward (MODEL.md §5.1): HC residual streams, PLE,
GDN and QSA-gated attention layers, MoE, and the head mixer. Decode = prefill of one token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vkflash.model.hparams import HParams
from vkflash.model.layers.attention import KVCache, attention_output, causal_mask, project
from vkflash.model.layers.common import RefOptions, Snapshots, emit, emit_global
from vkflash.model.layers.gdn import GDNState, gdn_layer
from vkflash.model.layers.hc import hc_combine, hc_mix
from vkflash.model.layers.moe import moe
from vkflash.model.layers.ple import ple, ple_conv_history
from vkflash.model.layers.qsa import IndexerCache, block_scores, indexer_queries, qsa_mask
from vkflash.model.ple_hash import PleHashParams, next_history, ple_rows
from vkflash.model.weights import AttnW, Weights


@dataclass
class AttnState:
    """An attention layer's caches: K/V, and on QSA layers the indexer keys + summary rows."""

    kv: KVCache
    idx: IndexerCache | None


@dataclass
class State(Snapshots):
    """Per-sequence state: position, per-layer caches/states, PLE conv state and token history."""

    weights: Weights
    opts: RefOptions
    layers: list[GDNState | AttnState]
    ple_conv: np.ndarray | None
    ple_history: np.ndarray
    n: int = 0  # tokens processed = next position
    tokens: list[int] = field(default_factory=list)
    hidden: np.ndarray | None = None  # h_nextn rows (n, hc, d) when opts.keep_hidden


@dataclass
class Output:
    """One forward's logits (T, V) and wide residual h_nextn (T, hc, d)."""

    logits: np.ndarray
    hidden: np.ndarray


def ple_params(hp: HParams) -> PleHashParams:
    """The host-hashing constants of hp's PLE layer."""
    return PleHashParams(ngram_size=hp.N, heads_per_ngram=hp.h_g, eos=hp.ple_eos,
                         multipliers=np.array(hp.ple_mult, np.uint64),
                         head_offsets=np.array(hp.ple_offsets, np.uint64),
                         head_vocab_sizes=np.array(hp.ple_sizes, np.uint64))


def new_state(weights: Weights, **options: Any) -> State:
    """A fresh sequence: zero recurrent states, empty caches."""
    hp, opts = weights.hp, RefOptions(**options)
    dtype = weights.dtype
    layers: list[GDNState | AttnState] = []
    for i in range(hp.L):
        if hp.is_gdn[i]:
            layers.append(GDNState.zeros(hp, dtype))
        else:
            idx = IndexerCache.empty(hp, np.dtype(opts.cache_dtype), dtype) if hp.r[i] > 0 else None
            layers.append(AttnState(KVCache.empty(hp, np.dtype(opts.cache_dtype)), idx))
    ple_conv = np.zeros((ple_conv_history(hp), hp.hc * hp.d), dtype) if hp.has_ple else None
    hidden = np.zeros((0, hp.hc, hp.d), dtype) if opts.keep_hidden else None
    return State(weights, opts, layers, ple_conv, np.zeros(0, np.int64), hidden=hidden)


def attn_layer(u: np.ndarray, pos: np.ndarray, w: AttnW, hp: HParams, st: AttnState, r: int,
               opts: RefOptions, i: int) -> np.ndarray:
    """(A1)–(A8) with the QSA mask (Q1)–(Q9) when r > 0."""
    P = project(u, pos, w, hp, opts, i)
    st.kv.append(P.k, P.v)  # (A4)
    n_kv = len(st.kv)
    if r == 0 or st.idx is None or w.indexer is None:
        return attention_output(P, st.kv, causal_mask(pos, n_kv), w, opts, i)
    rho = u @ w.indexer.k_proj.T  # (Q1)
    emit(opts, i, "idx_k", rho)
    st.idx.append(rho, r, w.indexer, hp)  # (Q2)–(Q3)
    qI = indexer_queries(u, pos, w.indexer, hp)  # (Q4)
    emit(opts, i, "idx_q", qI)
    scores = block_scores(qI, st.idx.summary)  # (Q5)
    if opts.select is not None:
        scores = opts.select(i, pos, scores)
    if opts.dump is not None:
        visible = np.arange(scores.shape[1])[None, :] < ((pos + 1) // r)[:, None]
        emit(opts, i, "idx_scores", np.where(visible, scores, -np.inf))
    mask = qsa_mask(pos, scores, n_kv, r, hp.B, opts.qsa_mode, opts.tie_rule)  # (Q6)–(Q9)
    emit(opts, i, "qsa_mask", mask)
    return attention_output(P, st.kv, mask, w, opts, i)


def forward(tokens: Any, st: State) -> Output:
    """(E1), (H0), (L1)–(L7), (O1)–(O3) for one ubatch of one sequence; updates st."""
    w, opts = st.weights, st.opts
    hp = w.hp
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    T = len(tokens)
    pos = st.n + np.arange(T)
    x = w.token_embd[tokens]  # (E1)
    emit_global(opts, "inp_embd", x)
    R = np.repeat(x[:, None, :], hp.hc, axis=1)  # (H0)
    for i in range(hp.L):
        blk = w.blocks[i]
        if blk.ple is not None:  # (L1)
            rows = ple_rows(tokens, st.ple_history, ple_params(hp))
            emit(opts, i, "ple_rows", rows)
            R, st.ple_conv = ple(R, rows, blk.ple, hp, st.ple_conv, opts, i)
            emit(opts, i, "ple_out", R)
        u, iota = hc_mix(R, blk.hc_attn, hp.eps)  # (L2)
        emit(opts, i, "hc_attn_mix", u)
        emit(opts, i, "hc_attn_inject", iota)
        layer_st = st.layers[i]
        if isinstance(layer_st, GDNState):  # (L3)
            a = gdn_layer(u, blk.mixer, hp, layer_st, opts, i)
        else:
            a = attn_layer(u, pos, blk.mixer, hp, layer_st, hp.r[i], opts, i)
        emit(opts, i, "attn_out", a)
        R = hc_combine(R, a, iota)  # (L4)
        emit(opts, i, "attn_residual", R)
        u, iota = hc_mix(R, blk.hc_ffn, hp.eps)  # (L5)
        emit(opts, i, "hc_ffn_mix", u)
        emit(opts, i, "hc_ffn_inject", iota)
        f = moe(u, blk.ffn, hp.k, opts, i)  # (L6)
        emit(opts, i, "ffn_out", f)
        R = hc_combine(R, f, iota)  # (L7)
        emit(opts, i, "l_out", R)
    if hp.has_ple:
        st.ple_history = next_history(st.ple_history, tokens, ple_params(hp))
    emit_global(opts, "h_nextn", R)  # (O1)
    y, _ = hc_mix(R, w.output_hc, hp.eps)  # (O2)
    emit_global(opts, "result_norm", y)
    logits = y @ w.output.T  # (O3)
    emit_global(opts, "result_output", logits)
    st.n += T
    st.tokens.extend(int(t) for t in tokens)
    if st.hidden is not None:
        st.hidden = np.concatenate([st.hidden, R])
    return Output(logits, R)


def prefill(tokens: Any, st: State) -> np.ndarray:
    """Logits (T, V) of one ubatch (decode = prefill of one token)."""
    return forward(tokens, st).logits
