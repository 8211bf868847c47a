"""QSA kernels vs the NumPy reference (vkflash.model.layers): pooled summary rows (Q2–Q3), block
scores (Q5), block- and cell-mode selection (Q6–Q8; ties to the lower index, kb beyond 1024) as cell
lists and as bit rows, a selection feeding gathered decode attention end to end, and the per-tile
union of gathered prefill (S1–S3) with its one-dispatch attention on each flash kernel."""

from __future__ import annotations

import numpy as np
import pytest

import flash_cm
from attention_ref import attend, check_out, make_cache, pack_bits
from vkflash.gpu.ops.attention import CacheType, CellList, CellMask, Heads, attention
from vkflash.gpu.ops.qsa import qsa_pool, qsa_scores, qsa_select, qsa_union
from vkflash.gpu.ops.views import Rows
from vkflash.model.layers.norms import rms_norm
from vkflash.model.layers.qsa import select_cells
from vkflash.model.layers.rope import rope_neox

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ctype,D,r", [(CacheType.F16, 128, 4), (CacheType.Q8_0, 64, 3), (CacheType.F32, 64, 4)])
def test_pool_summary_rows(gpu, rng, ctype, D, r):
    """Rows of the blocks this ubatch completes equal RoPE_{br}(rms(mean of the stored keys) ⊙ gain);
    other rows stay poisoned. Bound: f32 sums/rms ≈ 1e-6 relative; GLSL sin/cos may err by 2^-11
    absolute (Vulkan precision), so rotated dims get 1e-3·max|κ|, unrotated 1e-5·max|κ|. A wrong
    position (≥ r rad in the fastest pair), pooling window or norm is off by O(max|κ|)."""
    p0, T = int(rng.integers(0, 90)), int(rng.integers(1, 40))
    n_ctx, n_rot, theta, eps = p0 + T + 4, 2 * int(rng.integers(4, D // 4 + 1)), 1e4, 1e-6
    keys, kf = make_cache(gpu, rng, n_ctx, 1, D, ctype, "ik")
    gain = (1 + rng.uniform(-0.1, 0.1, D)).astype(np.float32)
    n_blocks = n_ctx // r + 1
    sbuf = gpu.buffer(4 * n_blocks * D, "summary")
    sbuf.fill(np.nan)
    params = gpu.upload(np.array([p0, p0 + T], np.int32), "params")
    g = gpu.graph("pool")
    qsa_pool(g, params, 0, keys, gpu.upload(gain, "gain"), Rows(sbuf, n_blocks, D), r=r, T=T, n_rot=n_rot,
             theta=theta, eps=eps)
    g.run()
    got = sbuf.read(np.float32).reshape(n_blocks, D)
    new = np.arange(p0 // r, (p0 + T) // r)
    assert np.isnan(np.delete(got, new, axis=0)).all(), "a row outside the completed blocks was written"
    if len(new) == 0:
        return
    P = kf[:, 0].astype(np.float64)[new[0] * r: (new[-1] + 1) * r].reshape(len(new), r, D).sum(axis=1) / r
    want = rope_neox(rms_norm(P, gain.astype(np.float64), eps)[:, None, :], new * r, n_rot, theta)[:, 0]
    err = np.abs(got[new] - want)
    scale = np.abs(want).max()
    assert err[:, :n_rot].max() <= 1e-3 * scale and err[:, n_rot:].max(initial=0) <= 1e-5 * scale, err.max()


@pytest.mark.parametrize("ctype", [CacheType.F16, CacheType.Q8_0])
def test_repool_equals_summary_cache(gpu, rng, ctype):
    """POOLED=0: re-pooling every complete block in one step gives the same bits as the summary rows
    the lazy path wrote ubatch by ubatch (same rounded keys, same order, same arithmetic); rows of
    incomplete blocks stay poisoned."""
    D, r = 64, int(rng.integers(2, 6))
    steps = np.cumsum(rng.integers(1, 3 * r + 5, int(rng.integers(2, 6))))
    n = int(steps[-1])
    keys, _ = make_cache(gpu, rng, n + r, 1, D, ctype, "ik")
    gain = gpu.upload((1 + rng.uniform(-0.1, 0.1, D)).astype(np.float32), "gain")
    n_blocks = (n + r) // r + 1
    lazy, again = gpu.buffer(4 * n_blocks * D, "lazy"), gpu.buffer(4 * n_blocks * D, "again")
    lazy.fill(np.nan)
    again.fill(np.nan)
    kw = dict(r=r, n_rot=D // 2, theta=1e4, eps=1e-6)
    p0 = 0
    for end in steps:
        g = gpu.graph("pool")
        qsa_pool(g, gpu.upload(np.array([p0, end], np.int32), "params"), 0, keys, gain, Rows(lazy, n_blocks, D),
                 T=int(end - p0), **kw)
        g.run()
        p0 = int(end)
    g = gpu.graph("repool")
    qsa_pool(g, gpu.upload(np.array([n - 1, n], np.int32), "params"), 0, keys, gain, Rows(again, n_blocks, D),
             T=1, repool=True, **kw)
    g.run()
    a, b = lazy.read(np.uint32).reshape(n_blocks, D), again.read(np.uint32).reshape(n_blocks, D)
    nb = n // r
    assert np.array_equal(a[:nb], b[:nb]), "re-pooled rows differ from the summary cache"
    assert np.isnan(again.read(np.float32).reshape(n_blocks, D)[nb:]).all(), "an incomplete block was pooled"


@pytest.mark.parametrize("T_max", [8, 70])
def test_block_scores(gpu, rng, T_max):
    """s_{t,b} = Σ_h relu(qI_{t,h}·κ_b) for visible blocks only, one query per workgroup (T ≤ 8) and
    in query tiles (ragged T up to 70, two or three n_I, more blocks than a tile). Bound: f32 dot
    products, 1e-5 of Σ_h Σ_d |q κ|; a missing relu or head changes scores by O(the dots)."""
    n_I, D, r = int(rng.choice([2, 4])), 64, int(rng.integers(1, 5))
    p0, T = int(rng.integers(0, 300)), int(rng.integers(1, T_max + 1))
    n_blocks = (p0 + T) // r + 3
    qI = rng.standard_normal((T, n_I * D)).astype(np.float32)
    kappa = rng.standard_normal((n_blocks, D)).astype(np.float32)
    got = _scores(gpu, p0, qI, kappa, n_I, r, gpu.options)
    dots = np.einsum("thd,bd->tbh", qI.reshape(T, n_I, D).astype(np.float64), kappa.astype(np.float64))
    bound = 1e-5 * np.abs(np.einsum("thd,bd->tb", np.abs(qI.reshape(T, n_I, D)), np.abs(kappa)))
    want = np.maximum(dots, 0).sum(axis=-1)
    for t in range(T):
        nb = (p0 + t + 1) // r
        assert (np.abs(got[t, :nb] - want[t, :nb]) <= bound[t, :nb]).all(), f"query {t}"
        assert np.isnan(got[t, nb:]).all(), f"query {t}: an invisible block was scored"


def _scores(gpu, p0: int, qI: np.ndarray, kappa: np.ndarray, n_I: int, r: int, options) -> np.ndarray:
    """qsa_scores of queries at p0.. against summary rows kappa, into poisoned rows of spare width."""
    T, (n_blocks, D) = len(qI), kappa.shape
    width = n_blocks + 3
    sbuf = gpu.buffer(4 * T * width, "scores")
    sbuf.fill(np.nan)
    params = gpu.upload(np.array([p0, p0 + T], np.int32), "params")
    g = gpu.with_options(options).graph("scores")
    qsa_scores(g, params, 0, Rows(gpu.upload(qI, "qI"), T, n_I * D), Rows(gpu.upload(kappa, "kappa"), n_blocks, D),
               Rows(sbuf, T, width), n_I=n_I, r=r)
    g.run()
    return sbuf.read(np.float32).reshape(T, width)


def test_block_scores_tiled_equals_per_query(gpu, rng):
    """Prefill scores in query tiles are the per-query kernel's bits (VKFLASH_QSA_SCORE_TILE=0): the
    same dots in the same order, the same visible entries written."""
    from dataclasses import replace
    n_I, D, r = 4, 32 * int(rng.integers(1, 5)), int(rng.integers(1, 9))
    p0, T = int(rng.integers(0, 2000)), int(rng.integers(9, 90))
    kappa = rng.standard_normal(((p0 + T) // r + 2, D)).astype(np.float32)
    qI = rng.standard_normal((T, n_I * D)).astype(np.float32)
    a = _scores(gpu, p0, qI, kappa, n_I, r, gpu.options)
    b = _scores(gpu, p0, qI, kappa, n_I, r, replace(gpu.options, qsa_score_tile=False))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("r,B,n_max", [(4, 16, 300), (3, 12, 200), (4, 4800, 6500)])
@pytest.mark.parametrize("listing", [True, False])
@pytest.mark.parametrize("mode", ["block", "cell"])
def test_select(gpu, rng, r, B, n_max, listing, mode):
    """Sel_t equals the reference's `block` mode, or `cell` mode with tie rule `index` (BLKTOPK=0), with
    ties to the lower block/cell index. Scores come from a handful of values (many exact ties between
    blocks and relu zeros, so the partial (kb+1)-th block of cell mode is decided by ties);
    kb = 1200 checks there is no 1024 limit."""
    W = B + r - 1
    T = int(rng.integers(1, 5))
    p0 = int(rng.integers(max(0, W - 3 - T), n_max - T))  # both dense (t+1 ≤ W) and sparse queries when close
    n = p0 + T
    nb_cap = n // r + 2
    scores = rng.integers(0, 6, (T, nb_cap)).astype(np.float32) * np.float32(rng.uniform(0.5, 2))
    scores[rng.random((T, nb_cap)) < 0.2] = -0.0
    params = gpu.upload(np.array([p0, n], np.int32), "params")
    cols = W + int(rng.integers(0, 4)) if listing else -(-n // 32) + 1
    obuf = gpu.buffer(4 * T * cols, "sel")
    obuf.fill(0xDEADBEEF, np.uint32)
    gp = gpu.buffer(4 * (2 * T + 1), "gp")
    g = gpu.graph("select")
    qsa_select(g, params, 0, Rows(gpu.upload(scores, "s"), T, nb_cap), Rows(obuf, T, cols), r=r, B=B,
               cell=mode == "cell", gather_params=gp if listing else None, gp_off=1)
    g.run()
    got = obuf.read(np.uint32).reshape(T, cols)
    for t in range(T):
        tp = p0 + t
        want = select_cells(tp, np.abs(scores[t, : (tp + 1) // r]).astype(np.float64), r, B, mode, "index")
        if listing:
            count = gp.read(np.int32, 2, 4 * (1 + 2 * t))
            assert list(count) == [tp, len(want)], f"query at {tp}: gather params {count}"
            assert np.array_equal(got[t, : len(want)], want), f"query at {tp}: cell list differs"
        else:
            words = -(-(tp + 1) // 32)
            bits = ((got[t, :words, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(-1)[: tp + 1]
            assert np.array_equal(np.flatnonzero(bits), want), f"query at {tp}: mask differs"
            assert (got[t, words:] == 0xDEADBEEF).all(), "mask words past the query were written"


@pytest.mark.parametrize("B", [0, 6])
def test_select_refuses_a_budget_of_no_whole_blocks(gpu, B):
    """B = 0 (no block: the wide kernel's radix select would read unset digits) and a B that is not
    a multiple of r are refused before dispatch."""
    g = gpu.graph("bad_select")
    s, o = gpu.buffer(4 * 64, "s"), gpu.buffer(4 * 64, "o")
    with pytest.raises(ValueError, match="positive multiple of the block size r=4"):
        qsa_select(g, s, 0, Rows(s, 1, 16), Rows(o, 1, 16), r=4, B=B)
    assert not g.ops


def test_select_then_gathered_decode(gpu, rng):
    """Decode over the selected cells: qsa_select's list and gather params drive attn_flash (GATHER)
    with no host step; equals the reference masked attention (tolerance as in test_attention)."""
    H, H_kv, Dh, r, B = 4, 2, 64, 4, 32
    n = int(rng.integers(B + r, 400))
    K, Kf = make_cache(gpu, rng, n + 3, H_kv, Dh, CacheType.F16, "K")
    V, Vf = make_cache(gpu, rng, n + 3, H_kv, Dh, CacheType.F16, "V")
    nb = n // r
    s = np.maximum(rng.standard_normal((1, nb + 1)), 0).astype(np.float32)
    q = rng.standard_normal((1, H, Dh)).astype(np.float32)
    W = B + r - 1
    cells, gp = gpu.buffer(4 * W, "cells"), gpu.buffer(8, "gp")
    out = gpu.buffer(4 * H * Dh, "o")
    out.fill(np.nan)
    g = gpu.graph("qsa_decode")
    qsa_select(g, gpu.upload(np.array([n - 1, n], np.int32)), 0, Rows(gpu.upload(s, "s"), 1, nb + 1),
               Rows(cells, 1, W), r=r, B=B, gather_params=gp)
    attention(g, gp, 0, Heads(Rows(gpu.upload(q, "q"), 1, H * Dh), H, Dh), K, V, Heads(Rows(out, 1, H * Dh), H, Dh),
              cells=CellList(cells, W))
    g.run()
    sel = select_cells(n - 1, s[0, : n // r].astype(np.float64), r, B, "block", "index")
    vis = np.zeros((1, n), bool)
    vis[0, sel] = True
    want = attend(q, Kf[:n], Vf[:n], vis, 1 / np.sqrt(Dh))
    got = out.read(np.float32).reshape(1, H, Dh)
    assert np.abs(got - want).max() <= 2e-5 * np.abs(Vf[:n]).max()


def _selections(rng: np.random.Generator, p0: int, T: int, r: int, B: int, mode: str) -> np.ndarray:
    """Reference Sel_t as bool rows (T, p0 + T) for scores that drift slowly from query to query (as
    neighbouring queries of a real model do), with a fresh score row now and then."""
    n = p0 + T
    s = np.maximum(rng.standard_normal(n // r + 1), 0)
    sel = np.zeros((T, n), bool)
    for t in range(T):
        s = rng.standard_normal(len(s)) if rng.random() < 0.05 else s + 0.1 * rng.standard_normal(len(s))
        s = np.maximum(s, 0)
        sel[t, select_cells(p0 + t, s[: (p0 + t + 1) // r], r, B, mode, "index")] = True
    return sel


def _union_run(gpu, rng, p0: int, T: int, tile: int, sel: np.ndarray, n_ctx: int):
    """Upload sel as qsa_select's bit rows (words past each query's range hold garbage, as they do
    between steps), record qsa_union; return (graph, params, gp, cells, slot rows, tiles, words, the
    bit rows as a mask over positions)."""
    words = -(-n_ctx // 32)
    rows = rng.integers(0, 1 << 32, (T, words + 1), dtype=np.uint64).astype(np.uint32)
    for t in range(T):
        w = -(-(p0 + t + 1) // 32)
        rows[t, :w] = pack_bits(sel[t : t + 1, : p0 + t + 1], w)[0]
    params = gpu.upload(np.array([p0, p0 + T], np.int32), "params")
    n_tiles = -(-T // tile)
    gp, cells = gpu.buffer(8 * n_tiles, "gp"), gpu.buffer(4 * n_tiles * n_ctx, "cells")
    slots = gpu.buffer(4 * T * words, "slots")
    cells.fill(0xDEADBEEF, np.uint32)
    slots.fill(0xDEADBEEF, np.uint32)
    g = gpu.graph("union")
    sel_buf = gpu.upload(rows, "sel")
    got_tiles = qsa_union(g, params, 0, Rows(sel_buf, T, words, 0, words + 1), gp, cells, n_ctx, Rows(slots, T, words),
                          tile=tile)
    return g, params, gp, cells, slots, got_tiles, words, CellMask(sel_buf, words + 1)


@pytest.mark.parametrize("mode", ["block", "cell"])
def test_union_per_tile(gpu, rng, mode):
    """Tile k's list is the sorted union of its queries' Sel_t (or the dense range 0..p0+t_last when
    that union exceeds half of it), and each query's slot bits mark exactly its Sel_t in that list.
    The step starts among the dense queries (t+1 ≤ W), so early tiles fall back and later ones gather."""
    r, B = 4, int(rng.choice([16, 32]))

    def gathers(p0: int, T: int, tile: int, sel: np.ndarray) -> int:
        """Tiles whose union is at most half their dense range (the gathered path)."""
        return sum(2 * sel[t0:t0 + tile].any(axis=0).sum() <= p0 + min(T, t0 + tile) for t0 in range(0, T, tile))

    while True:  # a draw covering both paths (with 32-query tiles, every union may exceed half)
        T, tile = int(rng.integers(150, 300)), int(rng.choice([8, 16, 32]))
        p0 = int(rng.integers(0, B + r - 1))
        sel = _selections(rng, p0, T, r, B, mode)
        if 0 < gathers(p0, T, tile, sel) < -(-T // tile):
            break
    n_ctx = p0 + T + int(rng.integers(0, 40))
    g, _, gp, cells, slots, n_tiles, words, _ = _union_run(gpu, rng, p0, T, tile, sel, n_ctx)
    g.run()
    assert n_tiles == -(-T // tile)
    lists, sl = cells.read(np.uint32).reshape(n_tiles, n_ctx), slots.read(np.uint32).reshape(T, words)
    gathered = 0
    for k in range(n_tiles):
        t0, t1 = k * tile, min(T, k * tile + tile)
        n_k = p0 + t1
        union = np.flatnonzero(sel[t0:t1].any(axis=0))
        want = np.arange(n_k) if 2 * len(union) > n_k else union
        gathered += len(want) < n_k
        assert list(gp.read(np.int32, 2, 8 * k)) == [p0 + t0, len(want)], f"tile {k}: gather params"
        assert np.array_equal(lists[k, : len(want)], want), f"tile {k}: cell list"
        for t in range(t0, t1):
            bits = ((sl[t, :, None] >> np.arange(32, dtype=np.uint32)) & 1).reshape(-1)[: len(want)]
            assert np.array_equal(want[bits.astype(bool)], np.flatnonzero(sel[t])), f"query {t}: slot bits"
    assert 0 < gathered < n_tiles, f"{gathered} of {n_tiles} tiles gathered: the test missed a path"


@pytest.mark.parametrize("path,kind", flash_cm.RUNS, ids=flash_cm.RUN_IDS)
def test_gathered_prefill_attention(gpu, rng, monkeypatch, path, kind):
    """(S3) One attention dispatch over all of qsa_union's tiles (lists, slot rows, per-tile params)
    equals: the reference masked by Sel_t (per-kernel bounds: attention_ref.check_out); the same
    kernel dispatched tile by tile, bit for bit (a row's arithmetic does not depend on the other rows
    of its workgroup, nor on skipped key tiles); and masked dense attention over the position bit rows (GP=0) within the same
    bound of that reference. Tiles that gather and tiles that fall back to dense; GQA 12; gated; on the
    scalar kernel and both coopmat kernels (tests/flash_cm.py runs; one KV split throughout)."""
    H, H_kv, Dh, r, B = 24, 2, 64, 4, 16
    label = "scalar" if path == "scalar" else f"{kind.value} {flash_cm.select(path, gpu, monkeypatch, Dh)}"
    ctype = CacheType.F16 if rng.integers(2) else CacheType.Q8_0
    tile = int(rng.choice([8, 16]))
    T = tile * int(rng.integers(100 // tile + 1, 200 // tile))  # whole tiles: the per-tile dispatches are
    # specialized as the one dispatch is (a short last tile could give the scalar kernel another BR, and
    # another specialization may contract other multiply-adds into FMAs: ~1 ulp apart)
    p0 = int(rng.integers(0, B + r - 1))
    n = p0 + T
    n_ctx = n + 5
    K, Kf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "V")
    sel = _selections(rng, p0, T, r, B, "block")
    q = rng.standard_normal((T, H, Dh)).astype(np.float32)
    gate = (rng.standard_normal((T, H, Dh)) * 2).astype(np.float32)
    g, params, gp, cells, slots, n_tiles, words, positions = _union_run(gpu, rng, p0, T, tile, sel, n_ctx)
    qb, gb = gpu.upload(q, "q"), gpu.upload(gate, "gate")
    outs = {name: gpu.buffer(4 * T * H * Dh, name) for name in ("one", "tiles", "dense")}
    for b in outs.values():
        b.fill(np.nan)

    def heads(buf, t0: int, nt: int) -> Heads:
        return Heads(Rows(buf, nt, H * Dh, t0 * H * Dh), H, Dh)

    attention(g, gp, 0, heads(qb, 0, T), K, V, heads(outs["one"], 0, T), gate=heads(gb, 0, T),
              mask=CellMask(slots, words), cells=CellList(cells, n_ctx), tile=tile, kind=kind, n_split=1, name="one")
    for k in range(n_tiles):
        t0, nt = k * tile, min(T, k * tile + tile) - k * tile
        attention(g, gp, 2 * k, heads(qb, t0, nt), K, V, heads(outs["tiles"], t0, nt), gate=heads(gb, t0, nt),
                  mask=CellMask(slots, words, t0 * words), cells=CellList(cells, n_ctx, k * n_ctx), kind=kind,
                  n_split=1, name=f"tile{k}")  # no flash-decode split for a tile of ≤ 8 queries
    attention(g, params, 0, heads(qb, 0, T), K, V, heads(outs["dense"], 0, T), gate=heads(gb, 0, T), mask=positions,
              kind=kind, name="dense")
    g.run()
    counts = gp.read(np.int32, 2 * n_tiles)[1::2]
    assert any(counts < p0 + np.minimum(np.arange(1, n_tiles + 1) * tile, T)), "no tile gathered"
    got = {name: b.read(np.float32).reshape(T, H, Dh) for name, b in outs.items()}
    assert np.array_equal(got["one"], got["tiles"]), \
        f"{label}: one dispatch differs from the per-tile dispatches by {np.nanmax(np.abs(got['one'] - got['tiles'])):.3g}"
    cm = path != "scalar"  # the matrix kernels round their inputs to f16 (the coopmat bounds)
    check_out(got["one"], q, Kf[:n], Vf[:n], sel, 1 / np.sqrt(Dh), gate, cm, f"{label} gathered")
    check_out(got["dense"], q, Kf[:n], Vf[:n], sel, 1 / np.sqrt(Dh), gate, cm, f"{label} masked dense")


@pytest.mark.parametrize("r,B,n_max", [(4, 16, 300), (4, 2048, 12000), (3, 12, 200)])
@pytest.mark.parametrize("listing", [True, False])
@pytest.mark.parametrize("wg", [0, 64], ids=["wg-device", "wg-64"])
def test_select_wide_equals_previous(gpu, rng, monkeypatch, r, B, n_max, listing, wg):
    """qsa_topk_wide.comp (default) and qsa_topk.comp (VKFLASH_TOPK_WIDE=0) write the same cells and
    gather params bit for bit, in both modes, with ties, -0.0 and the Flash-Next budget (B 2048, r 4);
    also on a 64-invocation workgroup (32 histogram bins per invocation; on lavapipe its 8 subgroups
    take the subgroup-wide scan of the subgroup totals that 1024-wide workgroups take on GPUs)."""
    from dataclasses import replace

    from vkflash.gpu.registry import table

    if wg:
        monkeypatch.setitem(table(), "qsa_topk_wide", replace(table()["qsa_topk_wide"], local_size=wg))

    W = B + r - 1
    T = int(rng.integers(1, 4))
    p0 = int(rng.integers(max(0, W - 3 - T), n_max - T))
    n = p0 + T
    nb_cap = n // r + 2
    scores = rng.integers(0, 40, (T, nb_cap)).astype(np.float32) * np.float32(rng.uniform(0.5, 2))
    scores[rng.random((T, nb_cap)) < 0.2] = -0.0
    scores[:, : nb_cap // 3] *= np.float32(rng.uniform(0.9, 1.1, nb_cap // 3))  # distinct values too
    params = gpu.upload(np.array([p0, n], np.int32), "params")
    sv = Rows(gpu.upload(scores, "s"), T, nb_cap)
    cols = W + 2 if listing else -(-n // 32) + 1
    got = {}
    for mode in ("block", "cell"):
        for wide in (True, False):
            obuf, gp = gpu.buffer(4 * T * cols, "sel"), gpu.buffer(4 * (2 * T + 1), "gp")
            obuf.fill(0xDEADBEEF, np.uint32)
            g = gpu.with_options(replace(gpu.options, topk_wide=wide)).graph("select")
            qsa_select(g, params, 0, sv, Rows(obuf, T, cols), r=r, B=B, cell=mode == "cell",
                       gather_params=gp if listing else None, gp_off=1)
            assert g.ops[0].kernel.name == ("qsa_topk_wide" if wide else "qsa_topk")
            g.run()
            got[mode, wide] = (obuf.read(np.uint32), gp.read(np.int32) if listing else None)
        a, b = got[mode, True], got[mode, False]
        assert np.array_equal(a[0], b[0]), f"{mode}: cells differ (p0={p0}, T={T}, nb={n // r})"
        if listing:
            assert np.array_equal(a[1], b[1]), f"{mode}: gather params differ"
        t = T - 1
        want = select_cells(p0 + t, np.abs(scores[t, : (p0 + t + 1) // r]).astype(np.float64), r, B, mode, "index")
        if listing:
            assert np.array_equal(a[0].reshape(T, cols)[t, : len(want)], want), f"{mode}: differs from the reference"
