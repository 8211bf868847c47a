"""NumPy float64 references, cache helpers and the per-kernel output check shared by the attention
and QSA GPU tests (the bounds are derived in test_attention's docstring)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from kv_q8 import kv_q8_0
from vkflash.formats.quants import dequantize
from vkflash.gpu.context import Gpu
from vkflash.gpu.ops.attention import Cache, CacheType, CellList, Heads, q_and_gate
from vkflash.gpu.ops.views import Rows

TOL = 2e-5  # scalar kernel vs attend, in units of max|v|
TOL_CM = 1.2e-3  # coopmat kernel vs attend_f16, in units of max|v|


def encode(x: np.ndarray, ctype: CacheType) -> np.ndarray:
    """The bytes a cache of `ctype` stores for float32 rows x (last dim a multiple of 32 for q8_0)."""
    if ctype is CacheType.F32:
        return x.astype(np.float32).view(np.uint8).reshape(-1)
    if ctype is CacheType.F16:
        return x.astype(np.float16).view(np.uint8).reshape(-1)
    return kv_q8_0(x)


def check_q8(got: np.ndarray, want: np.ndarray, x: np.ndarray) -> None:
    """q8_0 rows equal the codec's bytes, except that a GPU division (≤ 2.5 ulp in Vulkan) may move
    a code by one where x/d sits within 1e-4 of a rounding midpoint, or a scale by one f16 ulp where
    max|x|/127 sits within 1e-5 of an f16 midpoint: those and only those may differ."""
    g, w = got.reshape(-1, 34), want.reshape(-1, 34)
    xs = x.reshape(-1, 32).astype(np.float64)
    for b in range(len(w)):
        if np.array_equal(g[b], w[b]):
            continue
        dw = float(w[b, :2].view(np.float16)[0])
        ideal = np.abs(xs[b]).max() / 127
        h = np.float16(ideal)
        near_tie = abs(ideal - float(h)) > 0.5 * float(np.spacing(h)) * (1 - 1e-5)
        assert np.array_equal(g[b, :2], w[b, :2]) or near_tie, f"block {b}: scale differs"
        if not np.array_equal(g[b, :2], w[b, :2]):
            continue
        u = xs[b] / dw
        dq = g[b, 2:].view(np.int8).astype(int) - w[b, 2:].view(np.int8).astype(int)
        frac = np.abs(np.abs(u) - np.floor(np.abs(u)) - 0.5)
        assert (np.abs(dq) <= 1).all() and (frac[dq != 0] < 1e-4).all(), f"block {b}: codes differ"


def rounded(x: np.ndarray, ctype: CacheType) -> np.ndarray:
    """x as the cache stores it, decoded back to float32 (what attention must read)."""
    if ctype is CacheType.F32:
        return x.astype(np.float32)
    if ctype is CacheType.F16:
        return x.astype(np.float16).astype(np.float32)
    return dequantize(kv_q8_0(x), Q.Q8_0, x.size).reshape(x.shape)


def make_cache(gpu: Gpu, rng: np.random.Generator, n_ctx: int, heads: int, dim: int, ctype: CacheType,
               name: str) -> tuple[Cache, np.ndarray]:
    """A cache filled with random rows at every position (rows past n_kv act as garbage a kernel must
    not read) and its decoded float32 contents (n_ctx, heads, dim)."""
    x = rng.standard_normal((n_ctx, heads, dim)).astype(np.float32)
    buf = gpu.buffer(Cache.nbytes(n_ctx, heads, dim, ctype), name)
    buf.write(encode(x, ctype))
    return Cache(buf, n_ctx, heads, dim, ctype), rounded(x, ctype)


def attend(q: np.ndarray, K: np.ndarray, V: np.ndarray, visible: np.ndarray, scale: float,
           gate: np.ndarray | None = None) -> np.ndarray:
    """(A5)–(A7) in float64: q (T, H, Dh), K/V (n, H_kv, Dh), visible (T, n) bool -> o (T, H, Dh);
    a query with no visible key gives 0 (the kernels' convention)."""
    H, H_kv = q.shape[1], K.shape[1]
    g = np.arange(H) // (H // H_kv)
    s = np.einsum("thd,nhd->thn", q.astype(np.float64), K[:, g].astype(np.float64)) * scale
    s = np.where(visible[:, None, :], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.where(visible[:, None, :], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    o = np.einsum("thn,nhd->thd", p / np.where(l > 0, l, 1.0), V[:, g].astype(np.float64))
    if gate is not None:
        o = o / (1.0 + np.exp(-gate.astype(np.float64)))
    return o


def attend_f16(q: np.ndarray, K: np.ndarray, V: np.ndarray, visible: np.ndarray, scale: float,
               gate: np.ndarray | None = None) -> np.ndarray:
    """attend() on the inputs as the coopmat kernel rounds them: f16(f32(q·scale)), f16(K), f16(V)
    (K, V as decoded from the cache), round to nearest even."""
    q16 = (q.astype(np.float32) * np.float32(scale)).astype(np.float16).astype(np.float64)
    return attend(q16, K.astype(np.float16), V.astype(np.float16), visible, 1.0, gate)


def check_out(got: np.ndarray, q: np.ndarray, K: np.ndarray, V: np.ndarray, visible: np.ndarray, scale: float,
              gate: np.ndarray | None, coopmat: bool, what: str, scalar: np.ndarray | None = None) -> None:
    """A flash kernel's output (T, H, Dh) within its bound of its reference: the scalar kernel TOL of
    attend, the coopmat kernel TOL_CM of attend_f16 and, given the scalar kernel's output, within
    TOL + TOL_CM + (the two references' own distance: what f16 inputs cost on these data) of it."""
    vmax = float(np.abs(V).max())
    exact = attend(q, K, V, visible, scale, gate)
    want, tol = (attend_f16(q, K, V, visible, scale, gate), TOL_CM) if coopmat else (exact, TOL)
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    err = np.abs(got - want).max() / vmax
    assert err <= tol, f"{what}: max|Δ| {err:.3g}·max|v| > {tol:.3g}" + (
        " (if ~1e-2, suspect the device's f32→f16 conversion is not round-to-nearest-even)" if coopmat else "")
    if coopmat and scalar is not None:
        d = np.abs(got - scalar).max() / vmax
        bound = TOL + TOL_CM + np.abs(want - exact).max() / vmax
        assert d <= bound, f"{what}: vs the scalar kernel {d:.3g}·max|v| > {bound:.3g}"


def causal(p0: int, T: int, n: int) -> np.ndarray:
    """visible[t, j] = j ≤ p0 + t, (T, n)."""
    return np.arange(n)[None, :] <= p0 + np.arange(T)[:, None]


def pack_bits(bits: np.ndarray, words: int) -> np.ndarray:
    """Bool rows (T, n) -> uint32 bit rows (T, words), bit i of row t = bits[t, i]."""
    T, n = bits.shape
    padded = np.zeros((T, words * 32), dtype=np.uint64)
    padded[:, :n] = bits
    w = padded.reshape(T, words, 32) << np.arange(32, dtype=np.uint64)
    return w.sum(axis=-1).astype(np.uint32)


def queries(gpu, rng, T: int, H: int, Dh: int, gated: bool):
    """q (and the gate) in the layout the model produces: interleaved QG rows (A1) when gated,
    plain [T, H·Dh] rows at an offset otherwise."""
    q = rng.standard_normal((T, H, Dh)).astype(np.float32)
    if gated:
        gate = rng.standard_normal((T, H, Dh)).astype(np.float32) * 2
        qg = np.stack([q, gate], axis=2).reshape(T, 2 * H * Dh)
        qh, gh = q_and_gate(Rows(gpu.upload(qg, "qg"), T, 2 * H * Dh), H, Dh)
        return q, gate, qh, gh
    off = int(rng.integers(1, 7))
    buf = gpu.upload(np.concatenate([np.zeros(off, np.float32), q.reshape(-1)]), "q")
    return q, None, Heads(Rows(buf, T, H * Dh, off), H, Dh), None


def row_lists(gpu: Gpu, rng: np.random.Generator, T: int, n: int):
    """Per-query cell lists of T queries at positions n-T.. (a prefill's QSA selections): sorted
    random cells of [0, n) in rows a random stride apart after a poisoned offset, ragged counts (one
    empty), cells past the query's own among them; params (position, count) per query at word 2 of
    a poisoned buffer. Returns (CellList, params buffer, visible (T, n): each list ∩ causal)."""
    stride = int(rng.integers(40, 90))
    lists = np.full((T, stride), 7, np.uint32)
    counts = rng.integers(0, min(stride, n) + 1, T)
    counts[int(rng.integers(T))] = 0
    vis = np.zeros((T, n), bool)
    for t in range(T):
        U = np.sort(rng.choice(n, size=int(counts[t]), replace=False)).astype(np.uint32)
        lists[t, :len(U)] = U
        vis[t, U] = True
    off = int(rng.integers(1, 5))
    cells = CellList(gpu.upload(np.concatenate([np.full(off, 12345, np.uint32), lists.reshape(-1)]), "lists"),
                     stride, off)
    pos = n - T + np.arange(T)
    params = gpu.upload(np.concatenate([[9, 9], np.stack([pos, counts], 1).reshape(-1)]).astype(np.int32), "params")
    return cells, params, vis & causal(n - T, T, n)
