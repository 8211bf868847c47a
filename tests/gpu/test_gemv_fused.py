"""Fused GEMV modes of the decode GEMVs (gemv.comp; mul_mat_vec.comp with VKFLASH_GEMV_TEAMS=0), made
by the fusion pass, vs float64 NumPy and vs the plain dispatches they replace.

Fusion.GLU: y = silu(W_gate x) ⊙ (W_up x) of a stacked [gate; up] weight. Fusion.HC_MIX: hc_pre,
the W_up GEMV and hc_mix in one dispatch. Fusion.MOE_OUT: the shared expert's down GEMV with the
MoE combine as its store. Each combines its row sums with the plain path's ops in its order, so
fused and plain agree bit for bit (measured on lavapipe; asserted). Shapes are ragged (row counts
not multiples of the workgroup's rows), views strided and offset, outputs NaN-poisoned.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from fusion_util import graph
from matmul_util import U32, dequant_rows, make_problem, outside_untouched, random_weight, read_view, tolerance
from vkflash.gpu.graph import ROW_ALIGN, Graph
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.hc import hc_mix, hc_pre
from vkflash.gpu.ops.matmul import GEMV_MAX_COLS, TYPES, GluGemv, HcMixGemv, QWeight, matmul
from vkflash.gpu.ops.views import Rows
from vkflash.gpu.options import Fusion, GpuOptions

pytestmark = pytest.mark.gpu

ULP = 2.0**-23  # σ and silu are within (10 + 2|x|) ulp (test_hc: exp, divide, the roundings of 1 + e^{−x})
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)


def _sig(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def _place(gpu, rng, a: np.ndarray, name: str, align: int = 1, stride: int | None = None) -> Rows:
    """a (T × n) in a NaN-poisoned buffer at a random offset and row stride (multiples of align;
    `stride` when given)."""
    T, n = a.shape
    off = align * int(rng.integers(0, 4))
    if stride is None:
        stride = -(-n // align) * align + align * int(rng.integers(0, 3))
    buf = gpu.buffer(4 * (off + T * stride + int(rng.integers(1, 9))), name)
    buf.fill(np.nan)
    for t in range(T):
        buf.write(a[t].astype(np.float32), 4 * (off + t * stride))
    return Rows(buf, T, n, off, stride)


def _out(gpu, rng, T: int, n: int, name: str, align: int = 1, stride: int | None = None) -> Rows:
    """A NaN-poisoned T × n output view at a random offset and stride (multiples of align)."""
    return _place(gpu, rng, np.full((T, n), np.nan), name, align, stride)


def _glu_out(gpu, rng, T: int, F: int, name: str) -> Rows:
    """A GLU output at a random offset, strided like the graph's F-wide gate rows (an epilogue's ⊙
    operand shares the output's stride)."""
    return _out(gpu, rng, T, F, name, stride=-(-F // ROW_ALIGN) * ROW_ALIGN)


def _k(q: Q, rng: np.random.Generator) -> int:
    """A row length of whole blocks, a few hundred elements."""
    step = 256 if q in K_QUANTS else 32
    return step * int(rng.integers(max(1, 256 // step), 1200 // step + 1))


def _glu_ref(p, F: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """silu(gate) ⊙ up in float64 and a bound on |gpu − ref|: the matmul bounds of both halves
    propagated (|silu'| ≤ 1.1), silu's own ulps, the product's rounding; doubled for slack."""
    x = p.x.astype(np.float64)
    acc, bound = x @ p.wd.T, np.abs(x) @ np.abs(p.wd).T
    gate, up = acc[:, :F], acc[:, F:]
    tg, tu = tolerance(bound[:, :F], k, False), tolerance(bound[:, F:], k, False)
    act = gate * _sig(gate)
    want = act * up
    err = 1.1 * tg * np.abs(up) + np.abs(act) * tu + ULP * (10 + 2 * np.abs(gate)) * np.abs(want) + U32 * np.abs(want)
    return want, 2 * err


def _glu_ops(g: Graph, w: QWeight, x: Rows, y: Rows) -> None:
    """The plain ops: gate = W_gate x; silu(gate); up = W_up x; y = gate ⊙ up (W = [gate; up])."""
    F = y.n_cols
    gate, up = g.tensor(x.n_rows, F, "gate"), g.tensor(x.n_rows, F, "up")
    matmul(g, QWeight(w.buf, w.qtype, w.k, F, w.row0), x, gate, name="gate")
    E.silu(g, gate, gate, name="silu")
    matmul(g, QWeight(w.buf, w.qtype, w.k, F, w.row0 + F), x, up, name="up")
    E.mul(g, gate, up, y, name="glu")


@pytest.mark.parametrize("q", TYPES, ids=lambda q: q.name)
def test_glu(gpu, rng, q):
    """One dispatch; bit for bit the two matmuls with epilogues (silu, then ⊙) and the five plain
    dispatches; within the float64 bound; F odd, n_tok 1..8, an expert row offset."""
    for n_tok in (1, int(rng.integers(2, GEMV_MAX_COLS + 1))):
        F, k, e = 2 * int(rng.integers(1, 30)) + 1, _k(q, rng), int(rng.integers(0, 3))
        p = make_problem(gpu, q, 2 * F, k, n_tok, rng, expert=e)
        paths = {"fused": (GpuOptions(), 1), "epilogues": (GpuOptions().without(Fusion.GLU), 2),
                 "plain": (GpuOptions().without(Fusion.GLU, Fusion.EPILOGUE), 4)}
        ys = {path: _glu_out(gpu, rng, n_tok, F, path) for path in paths}
        for path, (opts, n_ops) in paths.items():
            g = Graph(gpu, "glu", options=opts)
            _glu_ops(g, p.w, p.xv, ys[path])
            assert len(g.ops) == n_ops, f"{path}: {len(g.ops)} dispatches"
            g.run()
        got = {path: read_view(v) for path, v in ys.items()}
        want, tol = _glu_ref(p, F, k)
        tag = f"{q.name} F={F} k={k} n={n_tok} e={e}"
        assert np.isfinite(got["fused"]).all(), f"{tag}: non-finite outputs (unwritten?)"
        assert np.all(np.abs(got["fused"] - want) <= tol), f"{tag}: max err {np.max(np.abs(got['fused'] - want)):.3g}"
        for path in ("plain", "epilogues"):
            assert np.array_equal(got["fused"], got[path]), f"{tag}: fused != {path}"
        assert all(outside_untouched(v) for v in ys.values()), f"{tag}: writes outside the output view"


@pytest.mark.parametrize("q", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_glu_many_tokens(gpu, rng, q):
    """Past GEMV_MAX_COLS tokens (prefill) the GLU stays two matmuls through the GEMM (epilogues fused;
    each followed by its split-K reduce pass where the device splits it)."""
    F, n_tok = 2 * int(rng.integers(5, 40)) + 1, int(rng.integers(GEMV_MAX_COLS + 1, 40))
    k = _k(q, rng)
    p = make_problem(gpu, q, 2 * F, k, n_tok, rng, expert=int(rng.integers(0, 2)))
    y = _glu_out(gpu, rng, n_tok, F, "y")
    g = graph(gpu, "glu", True)
    _glu_ops(g, p.w, p.xv, y)
    assert len([op for op in g.ops if op.kernel.name != "mm_reduce"]) == 2, "prefill GLU: gate and up matmuls"
    g.run()
    want, tol = _glu_ref(p, F, k)
    got = read_view(y)
    assert np.all(np.abs(got - want) <= tol), f"{q.name} F={F} n={n_tok}: max err {np.max(np.abs(got - want)):.3g}"
    assert outside_untouched(y)


def test_glu_knobs(gpu, rng):
    """The knobs reach the pass: one dispatch by default, the plain path with either knob off."""
    p = make_problem(gpu, Q.Q8_0, 10, 64, 3, rng)
    y = Rows(gpu.buffer(4 * 24, "y"), 3, 5, 0, 8)
    on = {"VKFLASH_MM_TILE_EPILOG": "1", "VKFLASH_DISABLE_FUSION": "0"}
    for flip, fused in (({}, True), ({"VKFLASH_MM_TILE_EPILOG": "0"}, False), ({"VKFLASH_DISABLE_FUSION": "1"}, False)):
        g = gpu.with_options(GpuOptions.from_knobs(**{**on, **flip})).graph("glu")
        _glu_ops(g, p.w, p.xv, y)
        assert (len(g.ops) == 1) == fused, f"{flip}: {len(g.ops)} dispatches"


def _hc_ref(W: np.ndarray, ell_pre: np.ndarray, X: np.ndarray, hc: int) -> tuple[np.ndarray, np.ndarray]:
    """u = (1/hc)·Σ_c σ(W_c silu(ℓ_pre/hc)) X_c in float64 and a bound on |gpu − ref|: ℓ's ulps and
    the matmul bound carried through σ (|σ'| = σ(1−σ)), σ's ulps, the products and the stream sum
    (test_hc's mix bound); doubled for slack."""
    T, d, lr = X.shape[0], X.shape[1] // hc, W.shape[1]
    x = ell_pre.astype(np.float64) / hc
    ell = x * _sig(x)
    s = ell @ W.T
    ds = tolerance(np.abs(ell) @ np.abs(W).T, lr, False) + (ULP * (11 + 2 * np.abs(x)) * np.abs(ell)) @ np.abs(W).T
    sig = _sig(s)
    prod = sig * X.astype(np.float64)
    err = np.abs(X) * sig * (1 - sig) * ds + ULP * (10 + 2 * np.abs(s)) * np.abs(prod) + hc * ULP * np.abs(prod)
    u = prod.reshape(T, hc, d).sum(axis=1) / hc
    return u, 2 * err.reshape(T, hc, d).sum(axis=1) / hc


@pytest.mark.parametrize("hc", [4, 3, 2])
@pytest.mark.parametrize("q", [Q.F32, Q.F16, Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
def test_hc_mix_gemv(gpu, rng, q, hc):
    """One dispatch; bit for bit hc_pre → matmul → hc_mix (one-dispatch tails); within the float64
    bound; d ragged, lr ∈ {32, 64, 320}, T 1..8, an expert-style row offset of W_up."""
    T, d, lr = int(rng.integers(1, GEMV_MAX_COLS + 1)), int(rng.integers(1, 60)), int(rng.choice([32, 64, 320]))
    e = int(rng.integers(0, 2))
    raw = random_weight(q, (e + 1) * hc * d, lr, rng)
    W = dequant_rows(raw, q, (e + 1) * hc * d, lr)[e * hc * d:]
    w = QWeight(gpu.upload(raw, "w_up"), int(q), lr, hc * d, row0=e * hc * d)
    ell_pre = (rng.standard_normal((T, lr)) * 6).astype(np.float32)
    X = (rng.standard_normal((T, hc * d)) * 2).astype(np.float32)
    ev, xv = _place(gpu, rng, ell_pre, "ell_pre", align=4), _place(gpu, rng, X, "X")
    out = {}
    for fused in (True, False):
        u = _out(gpu, rng, T, d, f"u.{fused}")
        g = graph(gpu, "hc_mix", fused, Fusion.HC_MIX)
        ell, gpre = g.tensor(T, lr, "ell"), g.tensor(T, hc * d, "gpre")
        hc_pre(g, ev, ell, hc)
        matmul(g, w, ell, gpre)
        hc_mix(g, gpre, xv, u, hc)
        assert len(g.ops) == (1 if fused else 3)
        if fused:
            assert g.ops[0].kernel.name.startswith(("gemv_", "mul_mat_vec_")), "fused HC mix: one GEMV dispatch"
        g.run()
        out[fused] = read_view(u)
        assert outside_untouched(u), f"fused={fused}: writes outside the output view"
    got, plain = out[True], out[False]
    want, tol = _hc_ref(W, ell_pre, X, hc)
    tag = f"{q.name} hc={hc} T={T} d={d} lr={lr} e={e}"
    assert np.isfinite(got).all(), f"{tag}: non-finite outputs (unwritten?)"
    assert np.all(np.abs(got - want) <= tol), f"{tag}: max err {np.max(np.abs(got - want)):.3g}"
    assert np.array_equal(got, plain), f"{tag}: fused != plain, max diff {np.max(np.abs(got - plain)):.3g}"
    assert np.array_equal(read_view(ev), ell_pre) and np.array_equal(read_view(xv), X), "inputs are only read"


def test_shape_checks(gpu):
    """Mis-shaped fused GEMVs are refused when made (the pass then keeps the plain ops)."""
    buf = gpu.buffer(4 * 4096, "buf")
    w = QWeight(gpu.upload(np.zeros(12 * 64, np.float32), "w"), int(Q.F32), 64, 12)
    x = Rows(buf, 2, 64)
    with pytest.raises(ValueError, match="2F rows"):
        GluGemv(QWeight(w.buf, w.qtype, 64, 11), x, Rows(buf, 2, 5, 200), "glu")
    with pytest.raises(ValueError, match="2F rows"):
        GluGemv(w, x, Rows(buf, 2, 5, 200), "glu")
    with pytest.raises(ValueError, match="overlaps"):
        GluGemv(w, x, Rows(buf, 2, 6, 100), "glu")
    X, u = Rows(buf, 2, 12, 300), Rows(buf, 2, 3, 400)
    with pytest.raises(ValueError, match="at most"):
        HcMixGemv(w, Rows(buf, GEMV_MAX_COLS + 1, 64), X, Rows(buf, GEMV_MAX_COLS + 1, 3, 1000), 4, "mix")
    with pytest.raises(ValueError, match="hc·d"):
        HcMixGemv(w, x, X, u, 3, "mix")
    with pytest.raises(ValueError, match="X is"):
        HcMixGemv(w, x, Rows(buf, 2, 13, 300), u, 4, "mix")
    with pytest.raises(ValueError, match="weight expects"):
        HcMixGemv(w, Rows(buf, 2, 32), X, u, 4, "mix")
    with pytest.raises(ValueError, match="multiples of 4"):
        HcMixGemv(w, Rows(buf, 2, 64, 2, 64), X, u, 4, "mix")
    with pytest.raises(ValueError):
        HcMixGemv(w, x, X, Rows(buf, 2, 3, 305), 4, "mix")  # u inside X


@pytest.mark.parametrize("q", [Q.F32, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_moe_out(gpu, rng, q):
    """Fusion.MOE_OUT: the shared expert's down GEMV with the MoE combine as its store equals the
    matmul + moe_combine dispatches bit for bit (T ≤ 8), and f ≈ Σ_j ys + σ(g)·W h in float64."""
    from vkflash.gpu.ops.moe import moe_combine

    T, k = int(rng.integers(1, GEMV_MAX_COLS + 1)), int(rng.integers(1, 11))
    d, K = int(rng.integers(1, 70)) * 2 + 1, _k(q, rng)
    raw = random_weight(q, d, K, rng)
    W = QWeight(gpu.upload(raw, "w_ds"), int(q), K, d)
    h = rng.standard_normal((T, K)).astype(np.float32)
    ys = rng.standard_normal((T * k, d)).astype(np.float32)
    gl = (rng.standard_normal((T, 1)) * 4).astype(np.float32)
    hv = _place(gpu, rng, h, "h", align=4)
    gv = _place(gpu, rng, gl, "g")
    out = {}
    for fused in (True, False):
        f = _out(gpu, rng, T, d, "f")
        ysv = Rows(gpu.upload(np.hstack([ys, np.zeros((T * k, f.stride - d), np.float32)]), "ys"), T * k, d, 0,
                   f.stride)
        g = graph(gpu, "moe_out", fused, Fusion.MOE_OUT)
        sh = g.tensor(T, d, "shared")
        matmul(g, W, hv, sh)
        moe_combine(g, ysv, f, k, shared=sh, gate=gv)
        assert len(g.ops) == (1 if fused else 2)
        g.run()
        out[fused] = read_view(f)
        assert outside_untouched(f)
    assert np.array_equal(out[False], out[True])
    acc = h.astype(np.float64) @ dequant_rows(raw, q, d, K).T
    want = ys.astype(np.float64).reshape(T, k, d).sum(1) + _sig(gl.astype(np.float64)) * acc
    bound = (np.abs(h).astype(np.float64) @ np.abs(dequant_rows(raw, q, d, K)).T) * K * U32 * 2 \
        + np.abs(ys).reshape(T, k, d).sum(1) * (k + 2) * U32 + np.abs(acc) * 20 * U32
    assert np.all(np.abs(out[True] - want) <= bound)


@pytest.mark.parametrize("teams,q8", [(True, True), (False, False)], ids=["q8", "legacy"])
def test_fused_modes_other_gemvs(gpu, rng, teams, q8):
    """The fused modes on the integer-dot GEMV (VKFLASH_GEMV_Q8=1) and on the previous one
    (VKFLASH_GEMV_TEAMS=0) equal their plain paths bit for bit: GLU (Q4_K), HC mix (Q8_0), MoE out (Q6_K)."""
    from dataclasses import replace

    from vkflash.gpu.ops.matmul import q8_possible
    from vkflash.gpu.ops.moe import moe_combine

    if q8 and not q8_possible(gpu.caps, Q.Q4_K, 512):
        pytest.skip(f"{gpu.caps.name}: no integer dot product")

    def opts(*off: Fusion) -> GpuOptions:
        return replace(GpuOptions().without(*off), gemv_teams=teams, gemv_q8=q8)

    kern = "gemv_q8_" if q8 else "mul_mat_vec_"
    T = int(rng.integers(1, GEMV_MAX_COLS + 1))
    # GLU
    F, k = 2 * int(rng.integers(1, 20)) + 1, 512
    p = make_problem(gpu, Q.Q4_K, 2 * F, k, T, rng)
    ys = {}
    for fused in (True, False):
        ys[fused] = _glu_out(gpu, rng, T, F, f"glu{fused}")
        g = Graph(gpu, "glu", options=opts() if fused else opts(Fusion.GLU, Fusion.EPILOGUE))
        _glu_ops(g, p.w, p.xv, ys[fused])
        assert g.ops[0].kernel.name.startswith(kern), g.ops[0].kernel.name
        g.run()
    assert np.array_equal(read_view(ys[True]), read_view(ys[False])), "GLU: fused != plain"
    # HC mix
    hc, d, lr = 4, int(rng.integers(1, 40)), 320
    w = QWeight(gpu.upload(random_weight(Q.Q8_0, hc * d, lr, rng), "w_up"), int(Q.Q8_0), lr, hc * d)
    ev = _place(gpu, rng, (rng.standard_normal((T, lr)) * 6).astype(np.float32), "ell_pre", align=4)
    xv = _place(gpu, rng, (rng.standard_normal((T, hc * d)) * 2).astype(np.float32), "X")
    out = {}
    for fused in (True, False):
        u = _out(gpu, rng, T, d, f"u.{fused}")
        g = Graph(gpu, "hc", options=opts() if fused else opts(Fusion.HC_MIX))
        ell, gpre = g.tensor(T, lr, "ell"), g.tensor(T, hc * d, "gpre")
        hc_pre(g, ev, ell, hc)
        matmul(g, w, ell, gpre)
        hc_mix(g, gpre, xv, u, hc)
        g.run()
        out[fused] = read_view(u)
    assert np.array_equal(out[True], out[False]), "HC mix: fused != plain"
    # MoE out
    kk, dd, K = 3, int(rng.integers(1, 40)) * 2 + 1, 512
    W = QWeight(gpu.upload(random_weight(Q.Q6_K, dd, K, rng), "w_ds"), int(Q.Q6_K), K, dd)
    hv = _place(gpu, rng, rng.standard_normal((T, K)).astype(np.float32), "h", align=4)
    gv = _place(gpu, rng, rng.standard_normal((T, 1)).astype(np.float32), "g")
    stride = dd + int(rng.integers(0, 3))
    ys_data = rng.standard_normal((T * kk, stride)).astype(np.float32)
    out = {}
    for fused in (True, False):
        f = _out(gpu, rng, T, dd, "f", stride=stride)
        ysv = Rows(gpu.upload(ys_data, "ys"), T * kk, dd, 0, stride)
        g = Graph(gpu, "moe", options=opts() if fused else opts(Fusion.MOE_OUT))
        sh = g.tensor(T, dd, "shared")
        matmul(g, W, hv, sh)
        moe_combine(g, ysv, f, kk, shared=sh, gate=gv)
        assert len(g.ops) == (1 if fused else 2)
        g.run()
        out[fused] = read_view(f)
    assert np.array_equal(out[True], out[False]), "MoE out: fused != plain"


def test_fused_modes_columns(gpu, rng, monkeypatch):
    """The fused modes with several columns per pass (VKFLASH_GEMV_COLS) equal the per-column loop bit for
    bit and float64 within its bound: GLU (F16: mul_mat_vec.comp), HC mix (Q5_0) and MoE out (Q4_0) on
    gemv.comp; T 2..8 (on a CPU driver passes of 2 columns, a ragged last one for odd T)."""
    from dataclasses import replace

    from vkflash.gpu.ops import matmul as mm
    from vkflash.gpu.ops.moe import MoeOutGemv

    monkeypatch.setattr(mm, "GEMV_COLS_CPU", 2)
    T = int(rng.integers(2, GEMV_MAX_COLS + 1))

    kinds: list[str] = []

    def run(build, n_out: int, stride: int | None = None) -> dict[bool, np.ndarray]:
        out = {}
        for on in (True, False):
            y = _out(gpu, rng, T, n_out, f"y{on}", stride=stride)
            g = Graph(gpu, "cols", options=replace(gpu.options, gemv_cols=on))
            g.add(build(y))
            assert len(g.ops) == 1 and ("cols=" in g.ops[0].desc) == on, g.ops[0].desc
            kinds.append(g.ops[0].kernel.name)
            g.run()
            out[on] = read_view(y)
            assert outside_untouched(y)
        assert np.array_equal(out[True], out[False]), "columns per pass differ from the per-column loop"
        return out
    # GLU
    F, k = 2 * int(rng.integers(1, 20)) + 1, 512
    p = make_problem(gpu, Q.F16, 2 * F, k, T, rng)
    got = run(lambda y: GluGemv(p.w, p.xv, y, "glu"), F, -(-F // ROW_ALIGN) * ROW_ALIGN)[True]
    want, tol = _glu_ref(p, F, k)
    assert np.all(np.abs(got - want) <= tol), "GLU"
    # HC mix
    hc, d, lr = 4, int(rng.integers(1, 40)), 320
    raw = random_weight(Q.Q5_0, hc * d, lr, rng)
    w = QWeight(gpu.upload(raw, "w_up"), int(Q.Q5_0), lr, hc * d)
    ell_pre = (rng.standard_normal((T, lr)) * 6).astype(np.float32)
    X = (rng.standard_normal((T, hc * d)) * 2).astype(np.float32)
    ev, xv = _place(gpu, rng, ell_pre, "ell_pre", align=4), _place(gpu, rng, X, "X")
    got = run(lambda u: HcMixGemv(w, ev, xv, u, hc, "mix"), d)[True]
    want, tol = _hc_ref(dequant_rows(raw, Q.Q5_0, hc * d, lr), ell_pre, X, hc)
    assert np.all(np.abs(got - want) <= tol), "HC mix"
    # MoE out
    kk, dd, K = 3, int(rng.integers(1, 40)) * 2 + 1, 512
    raw = random_weight(Q.Q4_0, dd, K, rng)
    W = QWeight(gpu.upload(raw, "w_ds"), int(Q.Q4_0), K, dd)
    h = rng.standard_normal((T, K)).astype(np.float32)
    gl = rng.standard_normal((T, 1)).astype(np.float32)
    hv, gv = _place(gpu, rng, h, "h", align=4), _place(gpu, rng, gl, "g")
    stride = dd + int(rng.integers(0, 3))
    ys = rng.standard_normal((T * kk, stride)).astype(np.float32)
    ysv = Rows(gpu.upload(ys, "ys"), T * kk, dd, 0, stride)
    got = run(lambda f: MoeOutGemv(W, hv, ysv, gv, f, kk, "moe"), dd, stride)[True]
    Wd = dequant_rows(raw, Q.Q4_0, dd, K)
    acc = h.astype(np.float64) @ Wd.T
    want = ys[:, :dd].astype(np.float64).reshape(T, kk, dd).sum(1) + _sig(gl.astype(np.float64)) * acc
    bound = (np.abs(h).astype(np.float64) @ np.abs(Wd).T) * K * U32 * 2 \
        + np.abs(ys[:, :dd]).reshape(T, kk, dd).sum(1) * (kk + 2) * U32 + np.abs(acc) * 20 * U32
    assert np.all(np.abs(got - want) <= bound), "MoE out"
    assert kinds[::2] == ["mul_mat_vec_f16", "gemv_q5_0", "gemv_q4_0"], kinds
