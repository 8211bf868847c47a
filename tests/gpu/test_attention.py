"""Attention kernels vs NumPy float64: KV append (f32/f16/q8_0), flash prefill (causal, GQA, gate,
masked, gathered) and split-KV flash-decode replayed at several lengths from one recording; the
cooperative-matrix prefill kernel (tests/flash_cm.py: the device's, or its emulated build anywhere,
so lavapipe checks its logic) vs the same references and vs the scalar kernel, masked tile skipping.

Tolerance of the scalar kernel: 2e-5·max|v|. The output is a convex combination of v rows; f32
rounding perturbs each score by ≲ u·Σ_d|q_d k_d|·scale ≈ 0.64·√Dh·u ≤ 1e-6 (u = 2^-24, q, k ~ N(0,1)),
exp adds (3 + 2|x|) ulp and the f32 sums over ≤ 5000 keys ≈ √n·u: every output moves by well under
1e-5·max|v|. A wrong scale (1/Dh vs 1/√Dh: scores have std 1) or a wrong kv head changes outputs by
~0.1·max|v|; one key dropped or added among ≤ 100 moves them by ~p_j·|v| ≳ 1e-3·max|v|.

Tolerance of the coopmat kernel: 1.2e-3·max|v| against attend_f16, the float64 reference on the
inputs the kernel rounds to f16 (q·scale, K, V; round to nearest even, as Vulkan converts). What is
left is P rounded to f16 in both P·V and the sum l: each weight P_j/ΣP moves by ≤ 2·2^-11 of itself
(normal f16 range), ≤ 2^-10·max|v| in all; P below 2^-14 (subnormal f16) errs by ≤ 2^-25 absolute
each against l ≥ 1, ≤ 1.5e-4·max|v| over 5000 keys; f32 sums ≲ 1e-5. Against the scalar kernel the
bound adds the actual distance between the two references (attention_ref.check_out).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import flash_cm
from attention_ref import TOL, TOL_CM, attend, causal, check_out, check_q8, encode, make_cache, pack_bits, queries, \
    rounded, row_lists
from fusion_util import graph
from vkflash.gpu.ops.attention import CM_SHAPES, SG_SHAPES, Cache, CellMask, CacheType, CellList, CmTiles, DenseHead, \
    Flash, Heads, attention, cm_fits, cm_tiles, coopmat_flash_possible, flash_attention, flash_kind, kv_append, \
    list_tiles, partial_bytes, sg_fits, sg_tiles
from vkflash.gpu.ops.attn_decode import attn_decode, supported
from vkflash.gpu.ops.views import Rows
from test_matmul_compile import PROFILES
from vkflash.gpu.options import Fusion, GpuOptions

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu(gpu):
    """These tests pin the flash kernel (VKFLASH_ATTN_DECODE=0); tests/gpu/test_attn_decode.py covers
    the decode kernel that attention() otherwise uses for ≤ 8 queries."""
    return gpu.with_options(replace(gpu.options, attn_decode=False))


def _params(gpu, words: np.ndarray):
    return gpu.upload(np.asarray(words, dtype=np.int32), "params")


def _check(got: np.ndarray, want: np.ndarray, vmax: float, what: str) -> None:
    err = np.abs(got - want)
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    assert err.max() <= TOL * vmax, f"{what}: max |Δ| {err.max():.3g} > {TOL * vmax:.3g}"


# ---- KV append -------------------------------------------------------------------------------

@pytest.mark.parametrize("ctype", list(CacheType))
@pytest.mark.parametrize("heads,dim", [(2, 64), (4, 128), (1, 256)])
def test_kv_append(gpu, rng, ctype, heads, dim):
    """Rows land at their positions rounded like the NumPy codec; other positions keep the poison."""
    n_ctx, T = int(rng.integers(40, 70)), int(rng.integers(1, 30))
    pos = rng.permutation(n_ctx)[:T].astype(np.int32)
    pos[rng.integers(T)] = n_ctx + 3 if T > 1 else pos[0]  # out of range: must be skipped
    extra, off = int(rng.integers(0, 40)), int(rng.integers(0, 9))  # fused-projection row layout
    width = heads * dim + extra
    src = rng.standard_normal((T, width)).astype(np.float32) * rng.uniform(0.1, 10)
    sbuf = gpu.upload(np.concatenate([np.zeros(off, np.float32), src.reshape(-1)]), "src")
    pos_off = int(rng.integers(0, 5))
    params = _params(gpu, np.concatenate([np.full(pos_off, -7), pos]))
    cache = Cache(gpu.buffer(Cache.nbytes(n_ctx, heads, dim, ctype), "cache"), n_ctx, heads, dim, ctype)
    cache.buf.fill(0xA5, np.uint8)

    g = gpu.graph("kv_append")
    kv_append(g, params, pos_off, Heads(Rows(sbuf, T, width, off), heads, dim), cache)
    g.run()

    got = cache.buf.read(np.uint8, cache.buf.nbytes)
    row = ctype.row_bytes(dim) * heads
    rows = got[: n_ctx * row].reshape(n_ctx, row)
    written = set()
    for t, p in enumerate(pos):
        if p >= n_ctx:
            continue
        written.add(int(p))
        x = src[t, : heads * dim].reshape(heads, dim)
        want = encode(x, ctype)
        if ctype is CacheType.Q8_0:
            check_q8(rows[p], want, x)
        else:
            assert np.array_equal(rows[p], want), f"position {p}: cache row differs"
    untouched = [p for p in range(n_ctx) if p not in written]
    assert (rows[untouched] == 0xA5).all(), "a position that was not appended changed"


@pytest.mark.parametrize("ctype", list(CacheType))
def test_kv_append_pair(gpu, rng, ctype):
    """Fusion.KV_APPEND: K and V of a layer in one dispatch write the same bytes as two appends; K read
    from a wider q|k row at a column offset, V from its own rows."""
    n_ctx, T, heads, dim = int(rng.integers(40, 70)), int(rng.integers(1, 20)), int(rng.integers(1, 4)), 64
    pos = rng.permutation(n_ctx)[:T].astype(np.int32)
    params = _params(gpu, pos)
    col = 32 * int(rng.integers(1, 5))
    kq = (rng.standard_normal((T, col + heads * dim)) * 3).astype(np.float32)
    v = (rng.standard_normal((T, heads * dim)) * 3).astype(np.float32)
    kb, vb = gpu.upload(kq, "qk"), gpu.upload(v, "v")
    k_src = Heads(Rows(kb, T, col + heads * dim), heads, dim, col=col)
    v_src = Heads(Rows(vb, T, heads * dim), heads, dim)
    out = {}
    for paired in (True, False):
        caches = [Cache(gpu.buffer(Cache.nbytes(n_ctx, heads, dim, ctype), n), n_ctx, heads, dim, ctype)
                  for n in ("K", "V")]
        for c in caches:
            c.buf.fill(0xA5, np.uint8)
        g = graph(gpu, "kv_pair", paired, Fusion.KV_APPEND)
        kv_append(g, params, 0, k_src, caches[0])
        kv_append(g, params, 0, v_src, caches[1])
        assert len(g.ops) == (1 if paired else 2)
        g.run()
        out[paired] = [c.buf.read(np.uint8, c.buf.nbytes) for c in caches]
    for a, b in zip(out[True], out[False]):
        assert np.array_equal(a, b)
    assert (out[True][1] != 0xA5).sum() > 0


# ---- flash prefill ---------------------------------------------------------------------------

CONFIGS = [  # (H, H_kv, Dh, cache type)
    (6, 2, 64, CacheType.F16), (4, 4, 128, CacheType.F32), (24, 2, 64, CacheType.Q8_0),
    (6, 2, 256, CacheType.Q8_0), (4, 4, 256, CacheType.F16), (6, 2, 128, CacheType.Q8_0),
    (6, 2, 96, CacheType.Q8_0),  # a head dim that neither divides nor is a multiple of the workgroup
]


def _out(gpu, T: int, H: int, Dh: int) -> tuple[Heads, object]:
    buf = gpu.buffer(4 * T * H * Dh, "o")
    buf.fill(np.nan)
    return Heads(Rows(buf, T, H * Dh), H, Dh), buf


@pytest.mark.parametrize("H,H_kv,Dh,ctype", CONFIGS)
def test_prefill_causal(gpu, rng, H, H_kv, Dh, ctype):
    """Causal GQA flash attention for T queries at p0.. over p0+T cached keys; gated via interleaved QG."""
    gated = bool(rng.integers(2))
    p0, T = int(rng.integers(0, 60)), int(rng.integers(1, 40))
    n_ctx = p0 + T + int(rng.integers(1, 20))
    K, Kf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "V")
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, gated)
    params = _params(gpu, [99, p0, p0 + T])
    out, obuf = _out(gpu, T, H, Dh)

    g = gpu.graph("prefill")
    attention(g, params, 1, qh, K, V, out, gate=gh)
    g.run()

    n = p0 + T
    want = attend(q, Kf[:n], Vf[:n], causal(p0, T, n), 1 / np.sqrt(Dh), gate)
    got = obuf.read(np.float32).reshape(T, H, Dh)
    _check(got, want, np.abs(Vf[:n]).max(), f"H={H}/{H_kv} Dh={Dh} {ctype.value} p0={p0} T={T} gated={gated}")


@pytest.mark.parametrize("H,H_kv,Dh,ctype", CONFIGS[:3])
def test_prefill_masked(gpu, rng, H, H_kv, Dh, ctype):
    """An all-ones mask reproduces dense bit for bit; a random per-query mask matches the reference."""
    p0, T = int(rng.integers(0, 70)), int(rng.integers(1, 30))
    n = p0 + T
    n_ctx = n + int(rng.integers(0, 40))
    K, Kf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "V")
    q, _, qh, _ = queries(gpu, rng, T, H, Dh, False)
    params = _params(gpu, [p0, n])
    words = -(-n_ctx // 32) + int(rng.integers(0, 3))
    bits = rng.random((T, n_ctx)) < 0.4
    bits[np.arange(T), p0 + np.arange(T)] |= rng.random(T) < 0.7  # most queries keep themselves
    mbuf = gpu.upload(pack_bits(bits, words), "mask")
    ones = gpu.upload(np.full((T, words), 0xFFFFFFFF, np.uint32), "ones")
    (out_d, bd), (out_o, bo), (out_m, bm) = (_out(gpu, T, H, Dh) for _ in range(3))

    g = gpu.graph("masked")
    attention(g, params, 0, qh, K, V, out_d, name="dense")
    attention(g, params, 0, qh, K, V, out_o, mask=CellMask(ones, words), name="ones")
    attention(g, params, 0, qh, K, V, out_m, mask=CellMask(mbuf, words), name="masked")
    g.run()

    dense = bd.read(np.float32)
    assert np.array_equal(bo.read(np.float32), dense), "all-ones mask differs from dense"
    vis = causal(p0, T, n) & bits[:, :n]
    want = attend(q, Kf[:n], Vf[:n], vis, 1 / np.sqrt(Dh))
    _check(bm.read(np.float32).reshape(T, H, Dh), want, np.abs(Vf[:n]).max(), "masked")


@pytest.mark.parametrize("H,H_kv,Dh,ctype", [CONFIGS[0], CONFIGS[3]])
def test_gathered_equals_masked(gpu, rng, H, H_kv, Dh, ctype):
    """(S2)–(S3): attention over a sorted cell list U with per-query bits over U equals the reference
    with M_t[U_i] = bit; causality still applies to the gathered positions."""
    p0, T = int(rng.integers(20, 90)), int(rng.integers(1, 20))
    n = p0 + T
    K, Kf = make_cache(gpu, rng, n + 5, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n + 5, H_kv, Dh, ctype, "V")
    U = np.sort(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)).astype(np.uint32)
    cap = len(U) + int(rng.integers(0, 10))
    words = -(-cap // 32)
    bits = rng.random((T, len(U))) < 0.7
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, True)
    params = _params(gpu, [p0, len(U)])
    cbuf = gpu.upload(np.concatenate([np.full(3, 12345, np.uint32), U, np.full(cap - len(U), 7, np.uint32)]), "U")
    mbuf = gpu.upload(pack_bits(bits, words), "mask")
    out, obuf = _out(gpu, T, H, Dh)

    g = gpu.graph("gather")
    attention(g, params, 0, qh, K, V, out, gate=gh, mask=CellMask(mbuf, words), cells=CellList(cbuf, cap, 3))
    g.run()

    vis = np.zeros((T, n), bool)
    vis[:, U] = bits
    vis &= causal(p0, T, n)
    want = attend(q, Kf[:n], Vf[:n], vis, 1 / np.sqrt(Dh), gate)
    _check(obuf.read(np.float32).reshape(T, H, Dh), want, np.abs(Vf[:n]).max(), f"gather |U|={len(U)}")


# ---- flash decode ----------------------------------------------------------------------------

@pytest.mark.parametrize("H,H_kv,Dh,ctype,T,n_split", [
    (4, 2, 64, CacheType.F16, 1, 7), (24, 2, 64, CacheType.Q8_0, 1, 5), (6, 2, 128, CacheType.F32, 3, 4),
])
def test_decode_split_replay(gpu, rng, H, H_kv, Dh, ctype, T, n_split):
    """One recorded split-KV graph (attention + combine) replayed at n_kv from 1 to > 5000: the
    length comes only from the params buffer, and nothing is re-recorded."""
    n_ctx = 5200 + int(rng.integers(0, 300))
    K, Kf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n_ctx, H_kv, Dh, ctype, "V")
    gated = T == 1
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, gated)
    params = _params(gpu, [0, 0])
    part = gpu.buffer(partial_bytes(T, H, Dh, n_split), "partial")
    out, obuf = _out(gpu, T, H, Dh)
    g = gpu.graph("decode")
    attention(g, params, 0, qh, K, V, out, gate=gh, n_split=n_split, partial=part)

    lengths = [T, T + 1, int(rng.integers(T + 2, 200)), int(rng.integers(5000, n_ctx + 1))]
    recorded = None
    for n in lengths:
        p0 = n - T
        params.write(np.array([p0, n], np.int32))
        obuf.fill(np.nan)
        part.fill(np.nan)
        g.run()
        if recorded is None:
            recorded = [s.seq for s in g.submissions]
        assert [s.seq for s in g.submissions] == recorded, "graph was re-recorded"
        want = attend(q, Kf[:n], Vf[:n], causal(p0, T, n), 1 / np.sqrt(Dh), gate)
        _check(obuf.read(np.float32).reshape(T, H, Dh), want, np.abs(Vf[:n]).max(), f"n_kv={n} split={n_split}")


def test_append_then_attend(gpu, rng):
    """End to end over two ubatches: append roped k/v rows with kv_append, then attend over the cache
    (what a layer does), f16 cache; the reference rounds k/v the same way."""
    H, H_kv, Dh, n_ctx = 6, 2, 128, 64
    K = Cache(gpu.buffer(Cache.nbytes(n_ctx, H_kv, Dh, CacheType.F16), "K"), n_ctx, H_kv, Dh, CacheType.F16)
    V = Cache(gpu.buffer(Cache.nbytes(n_ctx, H_kv, Dh, CacheType.F16), "V"), n_ctx, H_kv, Dh, CacheType.F16)
    Kh, Vh = np.zeros((0, H_kv, Dh), np.float32), np.zeros((0, H_kv, Dh), np.float32)
    p0 = 0
    for T in (int(rng.integers(2, 30)), int(rng.integers(1, 30))):
        k = rng.standard_normal((T, H_kv, Dh)).astype(np.float32)
        v = rng.standard_normal((T, H_kv, Dh)).astype(np.float32)
        q, _, qh, _ = queries(gpu, rng, T, H, Dh, False)
        kb, vb = gpu.upload(k, "k"), gpu.upload(v, "v")
        params = _params(gpu, [p0, p0 + T, *range(p0, p0 + T)])
        out, obuf = _out(gpu, T, H, Dh)
        g = gpu.graph("layer")
        kv_append(g, params, 2, Heads(Rows(kb, T, H_kv * Dh), H_kv, Dh), K, name="k_append")
        kv_append(g, params, 2, Heads(Rows(vb, T, H_kv * Dh), H_kv, Dh), V, name="v_append")
        attention(g, params, 0, qh, K, V, out)
        g.run()
        Kh = np.concatenate([Kh, rounded(k, CacheType.F16)])
        Vh = np.concatenate([Vh, rounded(v, CacheType.F16)])
        assert np.array_equal(K.read(p0 + T), Kh) and np.array_equal(V.read(p0 + T), Vh)
        want = attend(q, Kh, Vh, causal(p0, T, p0 + T), 1 / np.sqrt(Dh))
        _check(obuf.read(np.float32).reshape(T, H, Dh), want, np.abs(Vh).max(), f"ubatch at {p0}")
        p0 += T


# ---- cooperative-matrix prefill --------------------------------------------------------------

CM_CONFIGS = [  # GQA 12 at Dh 256 (qwen4exp), 8 (qwen3next), 7 (qwen2-0.5B), 3 and 1
    (24, 2, 256, CacheType.Q8_0), (16, 2, 256, CacheType.F16), (14, 2, 64, CacheType.Q8_0),
    (6, 2, 64, CacheType.F32), (4, 4, 128, CacheType.F16),
]


@pytest.mark.parametrize("path", flash_cm.PATHS)
@pytest.mark.parametrize("H,H_kv,Dh,ctype", CM_CONFIGS)
def test_cm_prefill(gpu, rng, monkeypatch, path, H, H_kv, Dh, ctype):
    """Causal GQA prefill of ragged T at ragged depth on both coopmat kernels (split head dim, and
    subgroup rows), gated or not, whole or in 3 KV splits + combine: each vs attend_f16 and the scalar
    kernel (module docstring bounds), and the two within twice the coopmat bound of each other."""
    label = flash_cm.select(path, gpu, monkeypatch, Dh)
    gated, n_split = bool(rng.integers(2)), int(rng.choice([1, 3]))
    p0, T = int(rng.integers(0, 90)), int(rng.integers(9, 70))
    n = p0 + T
    K, Kf = make_cache(gpu, rng, n + int(rng.integers(1, 20)), H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, K.n_ctx, H_kv, Dh, ctype, "V")
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, gated)
    params = _params(gpu, [p0, n])
    part = gpu.buffer(partial_bytes(T, H, Dh, n_split), "partial")
    outs = {}
    g = gpu.graph("cm")
    for k in Flash:
        out, outs[k] = _out(gpu, T, H, Dh)
        attention(g, params, 0, qh, K, V, out, gate=gh, n_split=n_split, partial=part, kind=k, name=k.value)
    g.run()
    got = {k: b.read(np.float32).reshape(T, H, Dh) for k, b in outs.items()}
    what = f"{label}: H={H}/{H_kv} Dh={Dh} {ctype.value} p0={p0} T={T} split={n_split} gated={gated}"
    check_out(got[Flash.SCALAR], q, Kf[:n], Vf[:n], causal(p0, T, n), 1 / np.sqrt(Dh), gate, False, what)
    for k in flash_cm.KINDS:
        check_out(got[k], q, Kf[:n], Vf[:n], causal(p0, T, n), 1 / np.sqrt(Dh), gate, True, f"{what} {k.value}",
                  got[Flash.SCALAR])
    d = np.abs(got[Flash.ROWS] - got[Flash.COOPMAT]).max() / np.abs(Vf[:n]).max()
    assert d <= 2 * TOL_CM, f"{what}: the two coopmat kernels differ by {d:.3g}·max|v| > {2 * TOL_CM:.3g}"


@pytest.mark.parametrize("path", flash_cm.PATHS)
@pytest.mark.parametrize("shape", CM_SHAPES + SG_SHAPES, ids=str)
def test_cm_shapes(gpu, rng, monkeypatch, path, shape):
    """Every shape of both coopmat kernels (rows, key tile, and parts of Dh per row block or prefetch)
    that fits the device at Dh 64 gives causal GQA-12 prefill within the module bounds, but for the
    default shapes test_cm_prefill already runs here (`vkflash bench kernels` times them all)."""
    H, H_kv, Dh = 24, 2, 64
    label = flash_cm.select(path, gpu, monkeypatch, Dh)
    kind = Flash.COOPMAT if isinstance(shape, CmTiles) else Flash.ROWS
    if not (cm_fits(gpu.caps, Dh, shape) if kind is Flash.COOPMAT else sg_fits(gpu.caps, Dh, shape)):
        pytest.skip(f"shape {shape} does not fit {gpu.caps.name}")
    if shape in {pick(gpu.caps, c[2]) for c in CM_CONFIGS for pick in (cm_tiles, sg_tiles)}:
        pytest.skip(f"test_cm_prefill runs {shape} here")
    ctype = CacheType.F16 if rng.integers(2) else CacheType.Q8_0
    p0, T = int(rng.integers(0, 60)), int(rng.integers(9, 40))
    n = p0 + T
    K, Kf = make_cache(gpu, rng, n + 3, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n + 3, H_kv, Dh, ctype, "V")
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, True)
    out, buf = _out(gpu, T, H, Dh)
    g = gpu.graph("shape")
    flash_attention(g, _params(gpu, [p0, n]), 0, qh, K, V, out, gate=gh, kind=kind, shape=shape)
    g.run()
    check_out(buf.read(np.float32).reshape(T, H, Dh), q, Kf[:n], Vf[:n], causal(p0, T, n), 1 / np.sqrt(Dh), gate,
              True, f"{label} shape {shape} {ctype.value} p0={p0} T={T}")


@pytest.mark.parametrize("path", flash_cm.PATHS)
@pytest.mark.parametrize("H,H_kv,Dh,ctype", [(24, 2, 64, CacheType.Q8_0), (6, 2, 128, CacheType.F16),
                                            (20, 1, 64, CacheType.F16), (40, 1, 64, CacheType.Q8_0)])
def test_cm_row_lists(gpu, rng, monkeypatch, path, H, H_kv, Dh, ctype):
    """Row lists (a prefill's per-query QSA selections) on the coopmat kernel, one token's GQA group
    per query tile (list_tiles: 16 rows for G 12 and 3 where a softmax row's 16 invocations fit a
    subgroup, as on the H200, else 32; 32 for G 20; a 64-row CM_SHAPES entry for G 40): ragged sorted
    lists, some empty, positions past the query's own among them, whole, in 3 splits or in key_splits'
    count; within the module's coopmat bounds of attend_f16 and of the decode kernel's f32 result on
    the same lists (where it serves G)."""
    label = flash_cm.select(path, gpu, monkeypatch, Dh)
    gpu = gpu.with_options(replace(gpu.options, fa_coopmat=True))  # the engine's default
    shape = list_tiles(gpu.caps, Dh, H // H_kv)
    if shape is None:
        pytest.skip(f"no row-list shape fits {gpu.caps.name} at G={H // H_kv}")
    T, n_split = int(rng.integers(9, 40)), [1, 3, None][int(rng.integers(3))]
    n = int(rng.integers(T + 60, 400))
    K, Kf = make_cache(gpu, rng, n + 5, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n + 5, H_kv, Dh, ctype, "V")
    cells, params, vis = row_lists(gpu, rng, T, n)
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, True)
    out, obuf = _out(gpu, T, H, Dh)
    ref, rbuf = _out(gpu, T, H, Dh)
    part = gpu.buffer(partial_bytes(T, H, Dh, n_split or 3), "partial")
    g = gpu.graph("rows")
    attention(g, params, 2, qh, K, V, out, gate=gh, cells=cells, n_split=n_split, partial=part, row_lists=True)
    descs = [op.desc for op in g.ops]
    assert "coopmat" in descs[0] and "row lists" in descs[0], descs
    decoded = supported(gpu.caps, T, H, H_kv, Dh, ctype, row_lists=True)  # G ≤ 16 there
    if decoded:
        attn_decode(g, params, 2, qh, K, V, ref, gate=gh, cells=cells, row_lists=True, name="decode")
    g.run()
    check_out(obuf.read(np.float32).reshape(T, H, Dh), q, Kf[:n], Vf[:n], vis, 1 / np.sqrt(Dh), gate, True,
              f"{label} rows {shape}: H={H}/{H_kv} Dh={Dh} {ctype.value} T={T} split={n_split}",
              rbuf.read(np.float32).reshape(T, H, Dh) if decoded else None)


@pytest.mark.parametrize("path", flash_cm.PATHS)
def test_cm_row_lists_dense_head(gpu, rng, monkeypatch, path):
    """Row lists whose queries before `end` hold every earlier cell (QSA Q6): with a DenseHead those
    queries run on the dense causal kernel (one dispatch serving positions < end, the lists one the
    rest), within the coopmat bound of attend_f16 and of the lists alone (VKFLASH_QSA_DENSE_HEAD=0);
    the dense dispatch alone, on each flash kernel (scalar, coopmat, subgroup rows), gives its rows
    within that kernel's bound and writes no other (they keep their poison)."""
    H, H_kv, Dh = 24, 2, 64
    label = flash_cm.select(path, gpu, monkeypatch, Dh)
    gpu = gpu.with_options(replace(gpu.options, fa_coopmat=True))
    T = int(rng.integers(12, 40))
    n = int(rng.integers(T + 20, 160))
    p0, end = n - T, n - T + int(rng.integers(1, T))
    ctype = CacheType.F16 if rng.integers(2) else CacheType.Q8_0
    K, Kf = make_cache(gpu, rng, n + 3, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n + 3, H_kv, Dh, ctype, "V")
    lists = np.zeros((T, n), np.uint32)
    counts = np.zeros(T, np.int64)
    vis = causal(p0, T, n)
    for t in range(T):
        p = p0 + t
        U = np.arange(p + 1) if p < end else np.sort(rng.choice(p + 1, size=int(rng.integers(0, p)), replace=False))
        lists[t, :len(U)], counts[t] = U, len(U)
        vis[t] = np.isin(np.arange(n), U)
    cells = CellList(gpu.upload(lists, "lists"), n)
    params = _params(gpu, np.stack([p0 + np.arange(T), counts], 1).reshape(-1))
    head = DenseHead(_params(gpu, [7, 7, p0, n]), 2, end)
    q, gate, qh, gh = queries(gpu, rng, T, H, Dh, True)
    outs = {}
    for on in (True, False):
        out, outs[on] = _out(gpu, T, H, Dh)
        g = gpu.with_options(replace(gpu.options, qsa_dense_head=on)).graph("head")
        attention(g, params, 0, qh, K, V, out, gate=gh, cells=cells, row_lists=True, dense_head=head, n_split=1)
        descs = [op.desc for op in g.ops]
        assert len(descs) == (2 if on else 1) and "row lists" in descs[-1], descs
        assert not on or f"positions 0..{end}" in descs[0] and f"row lists gated gather positions {end}.." in descs[1]
        g.run()
    got = {on: b.read(np.float32).reshape(T, H, Dh) for on, b in outs.items()}
    what = f"{label}: T={T} n={n} dense before {end} {ctype.value}"
    check_out(got[True], q, Kf[:n], Vf[:n], vis, 1 / np.sqrt(Dh), gate, True, what)
    check_out(got[False], q, Kf[:n], Vf[:n], vis, 1 / np.sqrt(Dh), gate, True, f"{what} (lists only)")
    d = np.abs(got[True] - got[False]).max() / np.abs(Vf[:n]).max()
    assert d <= 2 * TOL_CM, f"{what}: dense head vs lists only {d:.3g}·max|v|"
    m = end - p0  # the dense rows
    for kind in Flash:
        out, buf = _out(gpu, T, H, Dh)
        g = gpu.graph("dense part")
        flash_attention(g, head.params, head.off, qh, K, V, out, gate=gh, n_split=1, kind=kind, positions=(0, end))
        g.run()
        part = buf.read(np.float32).reshape(T, H, Dh)
        assert np.isnan(part[m:]).all(), f"{what} {kind.value}: rows from position {end} on were written"
        check_out(part[:m], q[:m], Kf[:n], Vf[:n], vis[:m], 1 / np.sqrt(Dh), gate[:m], kind is not Flash.SCALAR,
                  f"{what}: the dense part alone on {kind.value}")


def test_row_lists_kernel_choice(gpu, rng, monkeypatch):
    """attention(row_lists=True) takes the decode kernel where prefill attention takes no matrices
    (VKFLASH_FA_COOPMAT=0, an f32 cache), the coopmat kernel where it does (emulated here if need be),
    and rejects a flash kind that has no row-list kernel."""
    T, n, H, H_kv, Dh = 12, 200, 6, 2, 64
    cells, params, _ = row_lists(gpu, rng, T, n)
    q, _, qh, _ = queries(gpu, rng, T, H, Dh, False)
    out, _ = _out(gpu, T, H, Dh)

    def desc(g_opts, ctype: CacheType, kind: Flash | None = None) -> str:
        K, _ = make_cache(gpu, rng, n, H_kv, Dh, ctype, "K")
        g = gpu.with_options(g_opts).graph("choice")
        attention(g, params, 2, qh, K, K, out, cells=cells, row_lists=True, kind=kind)
        return g.ops[0].desc

    on = replace(gpu.options, fa_coopmat=True)
    assert "coopmat" not in desc(replace(gpu.options, fa_coopmat=False), CacheType.F16)
    assert "coopmat" not in desc(on, CacheType.F32)
    for kind in (Flash.SCALAR, Flash.ROWS):
        with pytest.raises(ValueError, match="row lists run on"):
            desc(on, CacheType.F16, kind)
    flash_cm.select("device" if coopmat_flash_possible(gpu.caps, Dh) else "emulated", gpu, monkeypatch, Dh)
    assert "coopmat" in desc(on, CacheType.F16) and "row lists" in desc(on, CacheType.Q8_0)


@pytest.mark.parametrize("path,kind", flash_cm.RUNS, ids=flash_cm.RUN_IDS)
def test_masked_tile_skipping(gpu, rng, monkeypatch, path, kind):
    """Masked prefill over ~70k keys where the queries select a few blocks of 4 (some shared, some
    their own, scattered over three skip windows of 32k slots) and their own tail: nearly every key
    tile is skipped, and the result equals the reference over the visible keys; an all-ones mask
    equals plain causal attention bit for bit (nothing skipped, same tiles)."""
    H, H_kv, Dh, ctype = 6, 2, 64, CacheType.F16
    label = "scalar" if path == "scalar" else f"{kind.value} {flash_cm.select(path, gpu, monkeypatch, Dh)}"
    T = int(rng.integers(9, 20))
    n = int(rng.integers(66000, 72000))
    p0 = n - T
    K, Kf = make_cache(gpu, rng, n + 3, H_kv, Dh, ctype, "K")
    V, Vf = make_cache(gpu, rng, n + 3, H_kv, Dh, ctype, "V")
    q, _, qh, _ = queries(gpu, rng, T, H, Dh, False)
    words = -(-K.n_ctx // 32)
    shared = rng.choice(n // 4, 12, replace=False)
    bits = np.zeros((T, n), bool)
    for t in range(T):
        for b in np.concatenate([shared[rng.random(12) < 0.7], rng.choice(n // 4, 3), [32768 // 4 - 1, 65536 // 4]]):
            bits[t, 4 * b: 4 * b + 4] = True
        bits[t, (p0 + t) // 4 * 4: p0 + t + 1] = True  # the tail up to the query itself
    bits &= causal(p0, T, n)
    params = _params(gpu, [p0, n])
    mbuf = gpu.upload(pack_bits(bits, words), "mask")
    ones = gpu.upload(np.full((T, words), 0xFFFFFFFF, np.uint32), "ones")
    (out_m, bm), (out_o, bo), (out_d, bd) = (_out(gpu, T, H, Dh) for _ in range(3))
    g = gpu.graph("skip")
    attention(g, params, 0, qh, K, V, out_m, mask=CellMask(mbuf, words), kind=kind, name="masked")
    g.run()
    cols = np.flatnonzero(bits.any(axis=0))
    check_out(bm.read(np.float32).reshape(T, H, Dh), q, Kf[cols], Vf[cols], bits[:, cols], 1 / np.sqrt(Dh), None,
              kind is not Flash.SCALAR, f"{label} masked n={n}")
    if kind is Flash.SCALAR:
        return  # test_prefill_masked covers ones vs dense for the scalar kernel
    short = _params(gpu, [100, 100 + T])  # queries at positions 100.., a short dense comparison
    g = gpu.graph("ones")
    attention(g, short, 0, qh, K, V, out_o, mask=CellMask(ones, words), kind=kind, name="ones")
    attention(g, short, 0, qh, K, V, out_d, kind=kind, name="dense")
    g.run()
    assert np.array_equal(bo.read(np.float32), bd.read(np.float32)), "all-ones mask differs from dense"


@pytest.mark.parametrize("T,dim,cache,gathered,rows,want", [
    (512, 256, CacheType.F16, False, True, Flash.ROWS), (9, 256, CacheType.Q8_0, False, True, Flash.ROWS),
    (512, 256, CacheType.F16, True, True, Flash.COOPMAT), (512, 128, CacheType.F16, False, True, Flash.COOPMAT),
    (512, 256, CacheType.F16, False, False, Flash.COOPMAT), (512, 256, CacheType.F32, False, True, Flash.SCALAR),
    (8, 256, CacheType.F16, False, True, Flash.SCALAR)])
def test_flash_kind_on_h200(T, dim, cache, gathered, rows, want):
    """The kernel prefill takes on the H200 (as it reports itself): subgroup rows for dense Dh-256 f16 /
    q8_0 prefill (where it measured faster), the split-head-dim kernel for gathered QSA prefill, other
    head dims and VKFLASH_FA_ROWS=0, scalar for f32 caches and steps of < 9 queries."""
    g = SimpleNamespace(options=replace(GpuOptions(), fa_rows=rows), gpu=SimpleNamespace(caps=PROFILES["h200"]))
    assert flash_kind(g, T, dim, cache, gathered) is want
