"""The decode attention kernel (ops/attn_decode.py) vs NumPy float64 and vs the flash path.

Inputs are fresh random draws each run (unseeded), outputs and partials are NaN-poisoned before
the run, and lengths are ragged (never a multiple of the key tile or the split count).

Tolerance against float64: TOL·max|v| = 2e-5·max|v|, the flash tests' bound (tests/gpu/
test_attention.py explains it: f32 score rounding ≲ 1e-6, exp and the key sums ≲ √n·u).

Decode kernel vs flash kernel (same inputs, both f32): they evaluate the same sums in different
orders (a key's dot as 8-element chunks over 8 lanes added by a butterfly vs one serial sum over d;
softmax sums per split merged by a different combine). Each score differs by an f32 summation
error of rms ≈ u·√(Dh/2) ≈ 7e-7 (Dh = 256, u = 2^-24, scores of std 1); an output moves by the
p_j·(v_j − o)-weighted mean of those differences, which averages out over the keys, plus the final
sums' rounding: measured ≤ 1e-7·max|v| (lavapipe, ≤ 900 keys). The test allows AGREE = 1e-6·max|v|,
10× that and 20× below TOL; a dropped key, a wrong rescale or head moves outputs by ≳ 1e-3·max|v|.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from attention_ref import attend, causal, make_cache, pack_bits, queries, row_lists
from vkflash.gpu.ops import attn_decode as dec
from vkflash.gpu.ops.attention import Cache, CacheType, CellList, CellMask, Heads, attention, partial_bytes
from vkflash.gpu.ops.views import Rows

pytestmark = pytest.mark.gpu
TOL = 2e-5
AGREE = 1e-6


def _check(got: np.ndarray, want: np.ndarray, vmax: float, what: str, tol: float = TOL) -> None:
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    err = np.abs(got - want).max()
    assert err <= tol * vmax, f"{what}: max |Δ| {err:.3g} > {tol * vmax:.3g}"


def _out(gpu, T: int, H: int, Dh: int):
    buf = gpu.buffer(4 * T * H * Dh, "o")
    buf.fill(np.nan)
    return Heads(Rows(buf, T, H * Dh), H, Dh), buf


def _partial(gpu, nbytes: int):
    buf = gpu.buffer(nbytes, "partial")
    buf.fill(np.nan)
    return buf


def _routed(gpu, on: bool):
    """The device building graphs with VKFLASH_ATTN_DECODE=on."""
    return gpu.with_options(replace(gpu.options, attn_decode=on))


CONFIGS = [  # (H, H_kv, Dh, cache type): GQA 12 (qwen4exp), 8 (qwen3next), 7 (qwen2), 1 and 3
    (24, 2, 256, CacheType.F16), (24, 2, 256, CacheType.Q8_0), (16, 2, 256, CacheType.F32),
    (14, 2, 64, CacheType.F16), (3, 3, 128, CacheType.Q8_0), (6, 2, 64, CacheType.Q8_0), (3, 1, 128, CacheType.F32),
]


@pytest.mark.parametrize("H,H_kv,Dh,ctype", CONFIGS)
def test_dense(gpu, rng, H, H_kv, Dh, ctype):
    """Causal GQA attention of T ≤ 8 queries at p0.. over n_kv keys with the planned splits, partials
    in a given buffer or a graph intermediate; the last cache row is read when n_kv = n_ctx (q8_0
    rows of 68/136 bytes end unaligned at the buffer end)."""
    T, gated = int(rng.integers(1, 9)), bool(rng.integers(2))
    n_ctx = int(rng.integers(T + 40, 700))
    n = n_ctx if rng.integers(2) else int(rng.integers(T, n_ctx))
    p0 = n - T
    K, Kf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "V")
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, gated)
    params = gpu.upload(np.array([7, p0, n], np.int32), "params")
    out, obuf = _out(gpu, T, H, Dh)
    part = _partial(gpu, dec.decode_partial_bytes(gpu.caps, 8, H, H_kv, Dh, ctype, n_ctx)) if rng.integers(2) else None

    g = gpu.graph("decode")
    dec.attn_decode(g, params, 1, qh, K, V, out, gate=gh, partial=part)
    g.run()

    want = attend(q, Kf[:n], Vf[:n], causal(p0, T, n), 1 / np.sqrt(Dh), gate)
    _check(obuf.read(np.float32).reshape(T, H, Dh), want, np.abs(Vf[:n]).max(),
           f"T={T} n={n}/{n_ctx} gated={gated} {g.ops[0].desc}")


@pytest.mark.parametrize("ctype,n_split", [(CacheType.F16, 3), (CacheType.Q8_0, 5), (CacheType.F32, 1)])
def test_replay_grid_stride(gpu, rng, ctype, n_split):
    """One recorded graph replayed from n_kv = T to > 2500 with a fixed small split count: each split
    walks many tiles (grid stride), n_split = 1 writes the output without a combine; nothing is
    re-recorded (lengths come only from the params buffer)."""
    H, H_kv, Dh, T = 12, 1, 64, int(rng.integers(1, 9))
    n_ctx = 2600 + int(rng.integers(0, 300))
    K, Kf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "V")
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, True)
    params = gpu.upload(np.zeros(2, np.int32), "params")
    part = _partial(gpu, partial_bytes(T, H, Dh, n_split))
    out, obuf = _out(gpu, T, H, Dh)
    g = gpu.graph("replay")
    dec.attn_decode(g, params, 0, qh, K, V, out, gate=gh, partial=part, n_split=n_split)
    assert len(g.ops) == (1 if n_split == 1 else 2)

    recorded = None
    for n in (T, T + 1, int(rng.integers(T + 2, 300)), int(rng.integers(2500, n_ctx + 1))):
        params.write(np.array([n - T, n], np.int32))
        obuf.fill(np.nan)
        part.fill(np.nan)
        g.run()
        recorded = recorded or [s.seq for s in g.submissions]
        assert [s.seq for s in g.submissions] == recorded, "graph was re-recorded"
        want = attend(q, Kf[:n], Vf[:n], causal(n - T, T, n), 1 / np.sqrt(Dh), gate)
        _check(obuf.read(np.float32).reshape(T, H, Dh), want, np.abs(Vf[:n]).max(), f"n_kv={n} split={n_split}")


@pytest.mark.parametrize("H,H_kv,Dh,ctype", [CONFIGS[0], CONFIGS[5]])
def test_masked(gpu, rng, H, H_kv, Dh, ctype):
    """Per-query bit rows (QSA masked dense, Q9) intersect causality; an all-ones mask gives the
    unmasked result bit for bit."""
    T = int(rng.integers(1, 9))
    n = int(rng.integers(T + 1, 400))
    n_ctx = n + int(rng.integers(0, 40))
    K, Kf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "V")
    q, _, qh, _ = queries(gpu, rng, T, H, Dh, False)
    params = gpu.upload(np.array([n - T, n], np.int32), "params")
    words = -(-n_ctx // 32) + int(rng.integers(0, 3))
    bits = rng.random((T, n_ctx)) < 0.4
    mbuf = gpu.upload(pack_bits(bits, words), "mask")
    ones = gpu.upload(np.full((T, words), 0xFFFFFFFF, np.uint32), "ones")
    nb = dec.decode_partial_bytes(gpu.caps, 8, H, H_kv, Dh, ctype, n_ctx)
    outs = [_out(gpu, T, H, Dh) for _ in range(3)]
    g = gpu.graph("masked")
    dec.attn_decode(g, params, 0, qh, K, V, outs[0][0], partial=_partial(gpu, nb), name="dense")
    dec.attn_decode(g, params, 0, qh, K, V, outs[1][0], mask=CellMask(ones, words), partial=_partial(gpu, nb),
                    name="ones")
    dec.attn_decode(g, params, 0, qh, K, V, outs[2][0], mask=CellMask(mbuf, words), partial=_partial(gpu, nb),
                    name="masked")
    g.run()

    dense = outs[0][1].read(np.float32)
    assert np.array_equal(outs[1][1].read(np.float32), dense), "all-ones mask differs from dense"
    want = attend(q, Kf[:n], Vf[:n], causal(n - T, T, n) & bits[:, :n], 1 / np.sqrt(Dh))
    _check(outs[2][1].read(np.float32).reshape(T, H, Dh), want, np.abs(Vf[:n]).max(), f"masked T={T} n={n}")


@pytest.mark.parametrize("H,H_kv,Dh,ctype", [CONFIGS[0], CONFIGS[1], CONFIGS[3], CONFIGS[4]])
def test_gathered(gpu, rng, H, H_kv, Dh, ctype):
    """(S2)–(S3): attention over a sorted cell list U (the QSA decode shape when T = 1, unmasked),
    with per-query slot bits when T > 1; causality still applies to the gathered positions."""
    T = 1 if rng.integers(2) else int(rng.integers(2, 9))
    n = int(rng.integers(T + 60, 900))
    K, Kf = make_cache(gpu, rng, n + 7, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n + 7, H_kv, Dh, ctype, "V")
    U = np.sort(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)).astype(np.uint32)
    cap = len(U) + int(rng.integers(0, 10))
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, True)
    params = gpu.upload(np.array([n - T, len(U)], np.int32), "params")
    cbuf = gpu.upload(np.concatenate([np.full(3, 12345, np.uint32), U, np.full(cap - len(U), 7, np.uint32)]), "U")
    vis = np.zeros((T, n), bool)
    mask = None
    if T > 1:
        words = -(-cap // 32)
        bits = rng.random((T, len(U))) < 0.7
        mask = CellMask(gpu.upload(pack_bits(bits, words), "mask"), words)
        vis[:, U] = bits
    else:
        vis[:, U] = True
    vis &= causal(n - T, T, n)
    out, obuf = _out(gpu, T, H, Dh)
    part = _partial(gpu, dec.decode_partial_bytes(gpu.caps, 8, H, H_kv, Dh, ctype, cap))

    g = gpu.graph("gather")
    dec.attn_decode(g, params, 0, qh, K, V, out, gate=gh, mask=mask, cells=CellList(cbuf, cap, 3), partial=part)
    g.run()

    want = attend(q, Kf[:n], Vf[:n], vis, 1 / np.sqrt(Dh), gate)
    _check(obuf.read(np.float32).reshape(T, H, Dh), want, np.abs(Vf[:n]).max(), f"gather T={T} |U|={len(U)}")


@pytest.mark.parametrize("n_split", [1, 3])
@pytest.mark.parametrize("H,H_kv,Dh,ctype", [CONFIGS[0], CONFIGS[1], CONFIGS[3], CONFIGS[5]])
def test_row_lists(gpu, rng, H, H_kv, Dh, ctype, n_split):
    """Row lists (a prefill's per-query QSA selections): T queries, more than a decode step's, each
    through its own sorted list (ragged lengths, some empty, positions past the query's own among
    them: causality still applies) with its own (position, count) params, in one dispatch (and a
    combine when the keys are split)."""
    T = int(rng.integers(9, 40))
    n = int(rng.integers(T + 60, 700))
    K, Kf = make_cache(gpu, rng, n + 5, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n + 5, H_kv, Dh, ctype, "V")
    cells, params, vis = row_lists(gpu, rng, T, n)
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, True)
    out, obuf = _out(gpu, T, H, Dh)

    g = gpu.graph("rows")
    dec.attn_decode(g, params, 2, qh, K, V, out, gate=gh, cells=cells, n_split=n_split, row_lists=True)
    assert len(g.ops) == (1 if n_split == 1 else 2) and "row lists" in g.ops[0].desc, [op.desc for op in g.ops]
    g.run()

    want = attend(q, Kf[:n], Vf[:n], vis, 1 / np.sqrt(Dh), gate)
    _check(obuf.read(np.float32).reshape(T, H, Dh), want, np.abs(Vf[:n]).max(), f"row lists T={T} {g.ops[0].desc}")


def test_long_context(gpu, rng):
    """No context ceiling: ≥ 70 000 keys (small head dim) with the planned splits, each walking
    dozens of tiles."""
    H, H_kv, Dh, T = 3, 1, 32, int(rng.integers(1, 4))
    n_ctx = 70_000 + int(rng.integers(0, 5000))
    n = n_ctx - int(rng.integers(0, 100))
    K, Kf = make_cache(gpu, rng, n_ctx, H_kv, Dh, CacheType.F16, "K")
    V, Vf = make_cache(gpu, rng, n_ctx, H_kv, Dh, CacheType.F16, "V")
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, True)
    q *= 3  # sharper softmax: the result depends on a few keys anywhere in the context
    qh.rows.buf.write(np.stack([q, gate], axis=2).reshape(-1))
    params = gpu.upload(np.array([n - T, n], np.int32), "params")
    out, obuf = _out(gpu, T, H, Dh)
    part = _partial(gpu, dec.decode_partial_bytes(gpu.caps, 8, H, H_kv, Dh, CacheType.F16, n_ctx))
    g = gpu.graph("long")
    dec.attn_decode(g, params, 0, qh, K, V, out, gate=gh, partial=part)
    g.run()
    want = attend(q, Kf[:n], Vf[:n], causal(n - T, T, n), 1 / np.sqrt(Dh), gate)
    _check(obuf.read(np.float32).reshape(T, H, Dh), want, np.abs(Vf[:n]).max(), f"n_kv={n} {g.ops[0].desc}")


@pytest.mark.parametrize("H,H_kv,Dh,ctype", [CONFIGS[0], CONFIGS[1], CONFIGS[2], CONFIGS[3]])
def test_agrees_with_flash(gpu, rng, H, H_kv, Dh, ctype):
    """attention() routes T ≤ 8 to the decode kernel, and VKFLASH_ATTN_DECODE=0 to the flash kernel
    (the plain path): same inputs, outputs within AGREE·max|v| (module docstring), both within TOL
    of float64; dense and, for f16, gathered."""
    T, gated = int(rng.integers(1, 9)), bool(rng.integers(2))
    n_ctx = int(rng.integers(300, 900))
    n = int(rng.integers(T, n_ctx))
    K, Kf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "V")
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, gated)
    n_split = int(rng.integers(2, 9))
    cells = None
    if ctype is CacheType.F16:
        U = np.sort(rng.choice(n, size=int(rng.integers(T, n + 1)), replace=False)).astype(np.uint32)
        U[-1] = n - 1
        cells = CellList(gpu.upload(U, "U"), len(U))
        vis = np.zeros((T, n), bool)
        vis[:, U] = True
        vis &= causal(n - T, T, n)
        params = gpu.upload(np.array([n - T, len(U)], np.int32), "params")
    else:
        vis = causal(n - T, T, n)
        params = gpu.upload(np.array([n - T, n], np.int32), "params")
    got = {}
    for on in (True, False):
        out, obuf = _out(gpu, T, H, Dh)
        g = _routed(gpu, on).graph("route")
        attention(g, params, 0, qh, K, V, out, gate=gh, cells=cells, n_split=n_split,
                  partial=_partial(gpu, partial_bytes(8, H, Dh, n_split)))
        assert g.ops[0].kernel.name == (f"attn_decode_{ctype.value}" if on else f"attn_flash_{ctype.value}")
        g.run()
        got[on] = obuf.read(np.float32).reshape(T, H, Dh)
    vmax = np.abs(Vf[:n]).max()
    want = attend(q, Kf[:n], Vf[:n], vis, 1 / np.sqrt(Dh), gate)
    _check(got[False], want, vmax, "flash")
    _check(got[True], want, vmax, "decode")
    _check(got[True], got[False], vmax, f"decode vs flash T={T} n={n}", AGREE)


def test_routing(gpu, rng):
    """Steps of 9+ queries and head dims the kernel does not support stay on flash; ≤ 8 go to decode
    with the planned splits (as many as the partial buffer holds) and its own combine."""
    gpu = _routed(gpu, True)
    K, _ = make_cache(gpu, rng, 2000, 1, 64, CacheType.F16, "K")
    V, _ = make_cache(gpu, rng, 2000, 1, 64, CacheType.F16, "V")
    params = gpu.upload(np.array([0, 9], np.int32), "params")
    for T, names in ((9, ["attn_flash_f16", "attn_combine"]), (8, ["attn_decode_f16", "attn_decode_combine"])):
        _, _, qh, _ = queries(gpu, rng, T, 4, 64, False)
        g = gpu.graph("r")
        attention(g, params, 0, qh, K, V, _out(gpu, T, 4, 64)[0], n_split=2,
                  partial=gpu.buffer(partial_bytes(9, 4, 64, 2), "part"))
        assert [op.kernel.name for op in g.ops] == names
    K96, _ = make_cache(gpu, rng, 64, 1, 96, CacheType.F32, "K96")
    _, _, qh, _ = queries(gpu, rng, 1, 4, 96, False)
    g = gpu.graph("r96")
    attention(g, params, 0, qh, K96, K96, _out(gpu, 1, 4, 96)[0])
    assert [op.kernel.name for op in g.ops] == ["attn_flash_f32"]
    assert not dec.supported(gpu.caps, 1, 4, 1, 96, CacheType.F32)


def test_rejects_bad_calls(gpu, rng):
    """Shapes, aliasing and split counts are checked before anything is recorded."""
    H, Dh = 4, 64
    K, _ = make_cache(gpu, rng, 64, 2, Dh, CacheType.F16, "K")
    params = gpu.upload(np.array([0, 1], np.int32), "params")
    g = gpu.graph("bad")
    _, _, qh9, _ = queries(gpu, rng, 9, H, Dh, False)
    with pytest.raises(ValueError, match="at most 8 queries"):
        dec.attn_decode(g, params, 0, qh9, K, K, _out(gpu, 9, H, Dh)[0])
    _, _, qh, _ = queries(gpu, rng, 2, H, Dh, False)
    with pytest.raises(ValueError, match="output is"):
        dec.attn_decode(g, params, 0, qh, K, K, _out(gpu, 2, H + 2, Dh)[0])
    with pytest.raises(ValueError, match="overlaps q"):
        dec.attn_decode(g, params, 0, qh, K, K, Heads(Rows(qh.rows.buf, 2, H * Dh, qh.off), H, Dh))
    with pytest.raises(ValueError, match="n_split=3 needs"):
        dec.attn_decode(g, params, 0, qh, K, K, _out(gpu, 2, H, Dh)[0], partial=gpu.buffer(100, "p"), n_split=3)
    part = gpu.buffer(Cache.nbytes(64, 2, Dh, CacheType.F16), "p")
    with pytest.raises(ValueError, match="also an operand"):
        dec.attn_decode(g, params, 0, qh, K, Cache(part, 64, 2, Dh, CacheType.F16), _out(gpu, 2, H, Dh)[0],
                        partial=part)
    K96, _ = make_cache(gpu, rng, 8, 1, 96, CacheType.F32, "K96")
    _, _, qh96, _ = queries(gpu, rng, 1, 2, 96, False)
    with pytest.raises(ValueError, match="head dim 96 f32"):
        dec.attn_decode(g, params, 0, qh96, K96, K96, _out(gpu, 1, 2, 96)[0])
    assert not g.ops
