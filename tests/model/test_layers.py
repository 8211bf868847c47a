"""Invariants of the reference layers: chunked GDN = recurrent, conv state, RoPE, QSA selection rules
(heap ties vs an independent libstdc++ transcription, block vs cell, dense threshold), gathered =
masked attention, MoE tie order."""

from __future__ import annotations

import numpy as np
import pytest

import tiny_models  # noqa: F401  (pins BLAS threads)
from vkflash.model.layers.attention import attend, attend_gathered
from vkflash.model.layers.common import RefOptions
from vkflash.model.layers.gdn import causal_conv, chunked, recurrent
from vkflash.model.layers.moe import moe
from vkflash.model.layers.qsa import heap_select, select_cells
from vkflash.model.layers.rope import rope_neox
from vkflash.model.weights import MoEW


def _gdn_inputs(rng, T, n_v, S):
    q = rng.normal(size=(T, n_v, S))
    k = rng.normal(size=(T, n_v, S))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(S)
    v = rng.normal(size=(T, n_v, S))
    beta = rng.uniform(0, 1, (T, n_v))
    g = -rng.uniform(0, 2, (T, n_v))
    S0 = rng.normal(size=(n_v, S, S))
    return q, k, v, beta, g, S0


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 64), (64, 64), (65, 64), (200, 64), (131, 7)])
def test_chunked_gdn_equals_recurrent(rng, T, chunk):
    q, k, v, beta, g, S0 = _gdn_inputs(rng, T, 3, 16)
    o_r, S_r = recurrent(q, k, v, beta, g, S0)
    o_c, S_c = chunked(q, k, v, beta, g, S0, chunk)
    assert np.abs(o_c - o_r).max() <= 1e-10 * np.abs(o_r).max()
    assert np.abs(S_c - S_r).max() <= 1e-10 * np.abs(S_r).max()


def test_chunked_gdn_detects_wrong_decay(rng):
    q, k, v, beta, g, S0 = _gdn_inputs(rng, 70, 2, 8)
    o_r, _ = recurrent(q, k, v, beta, g, S0)
    o_c, _ = chunked(q, k, v, beta, g * 1.01, S0, 64)
    assert np.abs(o_c - o_r).max() > 1e-6


def test_causal_conv_state_and_taps(rng):
    T, C, K = 23, 5, 4
    m = rng.normal(size=(T, C))
    w = rng.normal(size=(C, K))
    full, state_full = causal_conv(m, np.zeros((K - 1, C)), w)
    X = np.vstack([np.zeros((K - 1, C)), m])
    direct = np.array([[sum(w[ch, k] * X[t + k, ch] for k in range(K)) for ch in range(C)] for t in range(T)])
    assert np.allclose(full, direct / (1 + np.exp(-direct)), rtol=1e-12, atol=1e-14)
    state, parts = np.zeros((K - 1, C)), []
    for cut in np.split(np.arange(T), [1, 3, 4, 11]):  # chunks shorter than K−1 included
        out, state = causal_conv(m[cut], state, w)
        parts.append(out)
    assert np.allclose(np.vstack(parts), full, rtol=1e-12, atol=1e-14)
    assert np.array_equal(state, state_full) and np.array_equal(state_full, m[-(K - 1):])


def test_rope_neox_pairs_and_relative(rng):
    T, H, D, n_rot, theta = 9, 2, 12, 8, 1e4
    x = rng.normal(size=(T, H, D))
    pos = rng.integers(0, 1000, T)
    y = rope_neox(x, pos, n_rot, theta)
    half = n_rot // 2
    z = (x[..., :half] + 1j * x[..., half:n_rot]) * np.exp(1j * pos[:, None, None] * theta ** (-2 * np.arange(half) / n_rot))
    assert np.allclose(y[..., :half], z.real) and np.allclose(y[..., half:n_rot], z.imag)
    assert np.array_equal(y[..., n_rot:], x[..., n_rot:])
    a, b = rng.normal(size=(1, 1, D)), rng.normal(size=(1, 1, D))
    d1 = (rope_neox(a, np.array([50]), n_rot, theta) * rope_neox(b, np.array([47]), n_rot, theta)).sum()
    d2 = (rope_neox(a, np.array([503]), n_rot, theta) * rope_neox(b, np.array([500]), n_rot, theta)).sum()
    assert np.isclose(d1, d2, rtol=1e-10)


# ----------------------------------------------------------- libstdc++ partial_sort, transcribed


def _push_heap(a, hole, top, value, comp):
    parent = (hole - 1) // 2
    while hole > top and comp(a[parent], value):
        a[hole] = a[parent]
        hole = parent
        parent = (hole - 1) // 2
    a[hole] = value


def _adjust_heap(a, hole, length, value, comp):
    top = second = hole
    while second < (length - 1) // 2:
        second = 2 * (second + 1)
        if comp(a[second], a[second - 1]):
            second -= 1
        a[hole] = a[second]
        hole = second
    if (length & 1) == 0 and second == (length - 2) // 2:
        second = 2 * (second + 1)
        a[hole] = a[second - 1]
        hole = second - 1
    _push_heap(a, hole, top, value, comp)


def _make_heap(a, length, comp):
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(a, parent, length, a[parent], comp)
        if parent == 0:
            return
        parent -= 1


def _partial_sort_kept(c, k):
    """std::partial_sort(idx, idx+k, idx+n, [&](a, b){ return c[a] > c[b]; }): the first k indices."""
    a = list(range(len(c)))
    comp = lambda x, y: c[x] > c[y]  # noqa: E731
    _make_heap(a, k, comp)
    for i in range(k, len(a)):
        if comp(a[i], a[0]):  # __pop_heap(first, middle, i)
            value = a[i]
            a[i] = a[0]
            _adjust_heap(a, 0, k, value, comp)
    return set(a[:k])


@pytest.mark.parametrize("W", [1, 2, 7, 8, 35, 36])
def test_heap_select_matches_libstdcxx(rng, W):
    for _ in range(60):
        n = int(rng.integers(W, 4 * W + 20))
        levels = int(rng.integers(1, 5))
        c = rng.integers(0, levels, n).astype(float)  # many exact ties
        c[n - int(rng.integers(0, min(W, 3) + 1)):] = np.inf  # a tail of +inf cells
        kept = heap_select(c.tolist(), W)
        assert len(set(kept)) == W
        assert set(kept) == _partial_sort_kept(c.tolist(), W)
        threshold = np.sort(c)[::-1][W - 1]
        assert all(c[j] >= threshold for j in kept) and set(np.flatnonzero(c > threshold)) <= set(kept)


def test_heap_ties_differ_from_lower_index(rng):
    """The heap order is not lower-index-first: on tie-heavy vectors the kept sets often differ."""
    differ = 0
    for _ in range(1000):
        c = rng.integers(0, 3, 40).astype(float)
        lower_first = set(np.lexsort((np.arange(40), -c))[:9].tolist())
        differ += set(heap_select(c.tolist(), 9)) != lower_first
    assert differ >= 5  # about 3.5 % of such vectors differ


# ------------------------------------------------------------------------- QSA selection


def test_dense_below_threshold_and_block_vs_cell(rng):
    r, B = 4, 32
    W = B + r - 1
    n = 300
    s_all = rng.permutation(n // r).astype(float) + rng.uniform(0, 0.5, n // r)  # distinct block scores
    for t in range(n):
        nb = (t + 1) // r
        tau = (t + 1) % r
        blk = select_cells(t, s_all[:nb], r, B, "block", "heap")
        for tie in ("heap", "index"):
            cell = select_cells(t, s_all[:nb], r, B, "cell", tie)
            if t + 1 <= W:
                assert np.array_equal(blk, np.arange(t + 1)) and np.array_equal(cell, blk)
                continue
            assert len(cell) == W and len(blk) == W - (r - 1 - tau)
            assert set(blk) <= set(cell)
            assert (not np.array_equal(blk, cell)) == (tau < r - 1)
            assert set(range(nb * r, t + 1)) <= set(blk)  # the tail is always kept
        best = np.argsort(-s_all[:nb])[: B // r] if t + 1 > W else np.arange(nb)
        if t + 1 > W:
            assert set(blk) == set((best[:, None] * r + np.arange(r)).ravel()) | set(range(nb * r, t + 1))


def test_block_mode_ties_go_to_lower_block():
    r, B = 4, 8
    s = np.array([1.0, 2.0, 2.0, 2.0, 0.5])  # blocks 1..3 tie, kb = 2
    sel = select_cells(19, s, r, B, "block", "heap")
    assert set(sel) == set(range(4, 12))  # blocks 1 and 2; t = 19 has τ = 0


# ------------------------------------------------------------------- attention executions


def test_gathered_equals_masked(rng):
    T, n, H, H_kv, Dh = 50, 90, 6, 2, 16
    q = rng.normal(size=(T, H, Dh))
    K, V = rng.normal(size=(n, H_kv, Dh)), rng.normal(size=(n, H_kv, Dh))
    mask = rng.uniform(size=(T, n)) < 0.3
    mask[np.arange(T), n - T + np.arange(T)] = True  # every query sees at least itself
    dense = attend(q, K, V, mask)
    for tile in (1, 7, 64):
        assert np.allclose(attend_gathered(q, K, V, mask, tile), dense, rtol=1e-12, atol=1e-13)
    union = mask.any(axis=0)
    wrong = attend(q, K, V, np.broadcast_to(union, mask.shape))  # union without per-query mask
    assert not np.allclose(wrong, dense)


def test_gqa_head_map(rng):
    """Query head h reads kv head ⌊h/(H/H_kv)⌋ (not h mod H_kv)."""
    T, n, H, H_kv, Dh = 1, 4, 6, 2, 8
    q = rng.normal(size=(T, H, Dh))
    K, V = rng.normal(size=(n, H_kv, Dh)), rng.normal(size=(n, H_kv, Dh))
    mask = np.ones((T, n), bool)
    o = attend(q, K, V, mask)
    for h in range(H):
        g = h // 3
        s = K[:, g] @ q[0, h] / np.sqrt(Dh)
        p = np.exp(s - s.max())
        assert np.allclose(o[0, h], (p / p.sum()) @ V[:, g])


def test_moe_ties_to_lower_index(rng):
    d, E, F, k = 8, 6, 4, 2
    router = rng.normal(size=(E, d))
    router[4] = router[1]  # experts 1 and 4 always tie
    w = MoEW(router=router, gate=rng.normal(size=(E, F, d)), up=rng.normal(size=(E, F, d)),
             down=rng.normal(size=(E, d, F)), sh_gate_inp=rng.normal(size=d), sh_gate=rng.normal(size=(F, d)),
             sh_up=rng.normal(size=(F, d)), sh_down=rng.normal(size=(d, F)))
    u = rng.normal(size=(200, d))
    seen = {}
    moe(u, w, k, RefOptions(dump=lambda name, x: seen.setdefault(name, x)), 0)
    top = seen["blk.0.ffn_moe_topk"]
    both = np.any(top == 1, axis=1) | np.any(top == 4, axis=1)
    assert np.all(np.any(top == 1, axis=1)[both])  # 1 always wins the tie with 4
    wts = seen["blk.0.ffn_moe_weights"]
    assert np.allclose(wts.sum(axis=1), 1.0)
