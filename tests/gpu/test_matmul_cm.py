"""The cooperative-matrix GEMM (shaders/mul_mat_cm.comp on common/mm_cm.glsl) vs a float64 NumPy
oracle and vs the scalar f32 GEMM: every weight type, every tile, every epilogue, ragged shapes.

Each test runs on two paths (cm_util): "device" (the real coopmat kernels; skipped where the device
has none, e.g. lavapipe) and "emulated" (the same shader with the coopmat primitives replaced by
plain subgroup code, which runs anywhere: the CI check of the tiling, pipeline and epilogue logic).

Bounds. Coopmat rounds W and x to f16 (relative u16 = 2⁻¹¹ each, so 2·u16 per product) and
accumulates in f32: |y − y_exact| ≤ (2(K+64)·u32 + 2·u16)·Σ|W||x| (matmul_util.tolerance). The
scalar GEMM has the same bound without the f16 term, so |coopmat − scalar| is at most the sum of
the two. A dropped or doubled 32-group, a wrong row or token, a stale pipeline stage all move
results by ~√32/K of Σ|W||x| or more, far above either bound.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cm_util import PATHS, narrow_workgroup, select
from matmul_util import make_problem, outside_untouched, read_view, reference, tolerance
from vkflash.gpu.graph import Graph
from vkflash.gpu.ops.matmul import CM_TILES, COOPMAT_TYPES, Epilogue, cm_shape, cm_tile, matmul
from vkflash.gpu.ops.views import Rows
from vkflash.gpu.options import Fusion

pytestmark = pytest.mark.gpu

BLOCK_256 = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)


@pytest.fixture
def gpu(gpu):
    """The device with coopmat on: it does not gate explicit coopmat=True calls, but use_coopmat-based
    choices see it."""
    return gpu.with_options(replace(gpu.options, coopmat=True))


def _k(q: Q, rng: np.random.Generator, lo: int, hi: int) -> int:
    """A ragged K of whole blocks: for 32-blocks an odd number of 32-steps half the time (stage parity)."""
    if q in BLOCK_256:
        return 256 * int(rng.integers(max(1, lo // 256), hi // 256 + 1))
    return 32 * int(rng.integers(max(1, lo // 32), hi // 32 + 1))


def _check(label: str, got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> None:
    assert np.isfinite(got).all(), f"{label}: {np.count_nonzero(~np.isfinite(got))} outputs not written (NaN poison)"
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert (err <= tol).all(), (f"{label}: {np.count_nonzero(err > tol)} of {err.size} outside the bound; worst "
                                f"(token, row)={worst} got {got[worst]:.6g} want {want[worst]:.6g} |err| {err[worst]:.3g} "
                                f"bound {tol[worst]:.3g} (max err/bound {np.max(err / tol):.3g})")


def _run(gpu, p, coopmat: bool, tile=None, ep: Epilogue | None = None) -> tuple[np.ndarray, str]:
    g = gpu.graph("mm_cm")
    matmul(g, p.w, p.xv, p.yv, ep or Epilogue(), coopmat=coopmat, tile=tile)
    g.run()
    return read_view(p.yv), g.ops[-1].desc


@pytest.mark.parametrize("q", COOPMAT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("path", PATHS)
def test_types(gpu, rng, monkeypatch, path, q):
    """Every weight type on a ragged shape (rows and tokens not multiples of the tile, K of whole
    blocks): coopmat vs float64 within the f16 bound, coopmat vs the scalar GEMM within both bounds,
    nothing written outside y's view."""
    label = select(path, gpu, monkeypatch)
    n_out, k, n_tok = int(rng.integers(65, 300)), _k(q, rng, 256, 1600), int(rng.integers(9, 300))
    p = make_problem(gpu, q, n_out, k, n_tok, rng)
    got, desc = _run(gpu, p, True)
    assert outside_untouched(p.yv), f"{label} {desc}: writes outside the output view"
    scalar, _ = _run(gpu, p, False)
    ref, bound = reference(p)
    what = f"{label} {desc} ({q.name} n_out={n_out} K={k} n_tok={n_tok})"
    _check(what + " vs float64", got, ref, tolerance(bound, k, True))
    _check(what + " vs scalar GEMM", got, scalar, tolerance(bound, k, True) + tolerance(bound, k, False))


@pytest.mark.parametrize("tile", CM_TILES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_tiles(gpu, rng, monkeypatch, path, tile):
    """Every tile at its edges: one row / token past a tile, one short of it, a single 32-step (K = 32)
    and an odd number of steps; Q8_0 (32-blocks, decoded) and F16 (raw words)."""
    label = select(path, gpu, monkeypatch)
    shape = cm_shape(gpu.caps)
    if not tile.valid(shape) or tile.smem(shape.n) > gpu.caps.shared_memory:
        pytest.skip(f"tile {tile} needs {tile.smem(shape.n)} B of shared memory or other coopmat tiles "
                    f"({gpu.caps.name}: {gpu.caps.shared_memory} B, {shape})")
    for q, n_out, k, n_tok in ((Q.Q8_0, tile.bm + 1, 32, tile.bn - 1), (Q.F16, 2 * tile.bm - 1, 96, tile.bn + 1),
                               (Q.Q8_0, 7, 224, 2 * tile.bn + 3)):
        p = make_problem(gpu, q, n_out, k, n_tok, rng)
        got, desc = _run(gpu, p, True, tile)
        assert outside_untouched(p.yv), f"{label} {desc}: writes outside the output view"
        ref, bound = reference(p)
        _check(f"{label} {desc} (tile {tile}, {q.name} n_out={n_out} K={k} n_tok={n_tok})", got, ref,
               tolerance(bound, k, True))


@pytest.mark.parametrize("path", PATHS)
def test_two_tiles_per_subgroup(gpu, rng, monkeypatch, path):
    """Workgroups of 4 subgroups own the 8 warp tiles two each (how RADV's wave64 runs them): Q4_K and
    F16 at the default tile and at 64×64, vs float64."""
    label = select(path, gpu, monkeypatch)
    wg = narrow_workgroup(gpu, monkeypatch)
    shape = cm_shape(gpu.caps)
    for q, tile in ((Q.Q4_K, None), (Q.F16, CM_TILES[-1])):
        n_out, k, n_tok = int(rng.integers(65, 200)), _k(q, rng, 256, 800), int(rng.integers(65, 200))
        p = make_problem(gpu, q, n_out, k, n_tok, rng)
        got, desc = _run(gpu, p, True, tile)
        ref, bound = reference(p)
        _check(f"{label} {wg} invocations {desc} ({q.name} n_out={n_out} K={k} n_tok={n_tok}, {shape})", got, ref,
               tolerance(bound, k, True))


def test_tile_choice(gpu):
    """cm_tile follows the shape: 128-wide sides above 64 rows / tokens, within shared memory."""
    from dataclasses import replace

    from cm_util import SHAPE_16

    h200 = replace(gpu.caps, coopmat=(SHAPE_16,), shared_memory=48 << 10, subgroup_size=32, subgroup_min=32,
                   subgroup_max=32)
    assert str(cm_tile(h200, 4096, 4096)) == "128x128/64x32"
    assert str(cm_tile(h200, 12288, 40)) == "128x64/32x32"
    assert str(cm_tile(h200, 50, 4096)) == "64x128/32x32"
    assert str(cm_tile(h200, 50, 40)) == "64x64/32x16"
    small = replace(h200, shared_memory=32 << 10)  # 128x128 needs 40 KiB
    assert str(cm_tile(small, 4096, 4096)) == "128x64/32x32"
    assert cm_tile(replace(h200, coopmat=()), 4096, 4096) is None


EPILOGUES = {
    "scale": dict(scale=True), "bias": dict(bias=True), "sigmoid": dict(bias=True, act="sigmoid"),
    "silu": dict(act="silu"), "mul": dict(mul=True), "res": dict(res=True), "res_in_place": dict(res="y"),
    "all": dict(scale=True, bias=True, act="silu", mul=True, res="y"),
}


def _reset_y(yv: Rows, vals: dict, spec: dict) -> None:
    """y poisoned with NaN, and holding the residual where it is added in place."""
    yv.buf.fill(np.nan)
    if spec.get("res") == "y":
        for n in range(yv.n_rows):
            yv.buf.write(vals["res"][n], 4 * (yv.off + n * yv.stride))


def _epilogue(gpu, p, rng, spec: dict) -> tuple[Epilogue, dict]:
    """The epilogue's views (bias at an offset in its own buffer, mul/res with y's stride; res = y in
    place) and their values for the oracle; y reset (_reset_y)."""
    yv = p.yv
    vals: dict = {}
    kw: dict = {}
    if spec.get("scale"):
        kw["scale"] = vals["scale"] = float(np.float32(rng.uniform(0.25, 2.0)))
    if spec.get("bias"):
        vals["bias"] = rng.standard_normal(yv.n_cols).astype(np.float32)
        kw["bias"] = Rows(gpu.upload(np.concatenate([np.zeros(5, np.float32), vals["bias"]]), "bias"), 1, yv.n_cols, 5)
    kw["act"] = spec.get("act", "")
    for nm in ("mul", "res"):
        if not spec.get(nm):
            continue
        vals[nm] = rng.standard_normal((yv.n_rows, yv.n_cols)).astype(np.float32)
        buf = yv.buf if spec[nm] == "y" else gpu.buffer(yv.buf.nbytes, nm)
        if buf is not yv.buf:
            for n in range(yv.n_rows):
                buf.write(vals[nm][n], 4 * (yv.off + n * yv.stride))
        kw[nm] = Rows(buf, yv.n_rows, yv.n_cols, yv.off, yv.stride)
    _reset_y(yv, vals, spec)
    return Epilogue(**kw), vals


def _epilogue_oracle(acc, tol_acc, vals: dict, act: str):
    """float64 epilogue of the exact product and a bound: each step adds its f32 rounding (U32 of its
    magnitude) to the propagated bound (|σ'| ≤ 1/4, |silu'| ≤ 1.1; exp and division to a few ulp)."""
    u32 = 2.0**-24
    s = vals.get("scale", 1.0)
    v, e = s * acc, abs(s) * tol_acc + u32 * np.abs(s * acc)
    if "bias" in vals:
        v = v + vals["bias"][None, :]
        e = e + u32 * np.abs(v)
    if act:
        sig = 1.0 / (1.0 + np.exp(-v))
        v = sig if act == "sigmoid" else v * sig
        e = 1.1 * e + 8 * u32 * np.abs(v)
    if "mul" in vals:
        v = v * vals["mul"]
        e = e * np.abs(vals["mul"]) + u32 * np.abs(v)
    if "res" in vals:
        v = v + vals["res"]
        e = e + u32 * (np.abs(v) + np.abs(vals["res"]))
    return v, 2 * e + 1e-30


# the device runs every (epilogue, type); the emulated path every epilogue on Q4_K and every type with
# all parts (each combination is a pipeline lavapipe compiles, several seconds each)
EPILOGUE_CASES = ([("device", ep, q) for ep in EPILOGUES for q in COOPMAT_TYPES]
                  + [("emulated", ep, Q.Q4_K) for ep in EPILOGUES]
                  + [("emulated", "all", q) for q in COOPMAT_TYPES if q != Q.Q4_K])


@pytest.mark.parametrize("path,ep,q", EPILOGUE_CASES, ids=lambda v: getattr(v, "name", v))
def test_epilogues(gpu, rng, monkeypatch, path, ep, q):
    """Every epilogue part alone and all together (scale, bias, σ / silu, ⊙ tensor, + residual, in
    place) on the coopmat store vs the float64 epilogue; the fused store equals the plain path of
    separate eltwise dispatches bit for bit."""
    label = select(path, gpu, monkeypatch)
    spec = EPILOGUES[ep]
    n_out, k, n_tok = int(rng.integers(65, 200)), _k(q, rng, 256, 800), int(rng.integers(9, 150))
    p = make_problem(gpu, q, n_out, k, n_tok, rng)
    e, vals = _epilogue(gpu, p, rng, spec)
    outs = []
    for fuse in (True, False):
        if not fuse:
            _reset_y(p.yv, vals, spec)  # the fused run overwrote an in-place residual
        g = Graph(gpu, "mm_cm_ep", options=gpu.options if fuse else gpu.options.without(Fusion.EPILOGUE))
        matmul(g, p.w, p.xv, p.yv, e, coopmat=True)
        g.run()
        outs.append(read_view(p.yv))
        desc = g.ops[0].desc
    acc, bound = reference(p)
    want, tol = _epilogue_oracle(acc, tolerance(bound, k, True), vals, spec.get("act", ""))
    what = f"{label} {desc} epilogue {ep} ({q.name} n_out={n_out} K={k} n_tok={n_tok})"
    _check(what, outs[0], want, tol)
    same = np.array_equal(outs[0], outs[1])
    assert same, (f"{what}: fused store differs from the plain eltwise path at "
                  f"{np.count_nonzero(outs[0] != outs[1])} elements (max |Δ| {np.nanmax(np.abs(outs[0] - outs[1])):.3g})")
