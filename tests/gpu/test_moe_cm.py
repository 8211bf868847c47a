"""The coopmat expert GEMM (shaders/mul_mat_id_cm.comp) vs float64 NumPy and vs the scalar expert
GEMM: every weight type as gate/up and as down, fused and separate gate/up, compact and plain
grids, every plan tile width, ragged T, experts without rows.

Paths as in test_matmul_cm.py (cm_util): "device" (skipped without coopmat) and "emulated".
Bound: the scalar path's f32 bound (moe_util.tol) plus 2·u16 of the same magnitude, because every
product of the gate, up and down GEMMs has both inputs rounded to f16 (relative u16 each) and
routed_reference's bound is the magnitude those errors propagate to (through silu, ⊙ and W_d).
The compact and plain grids run the same tiles and must agree bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cm_util import U16, narrow_workgroup, select
from moe_util import experts, poisoned, read_rows, routed_reference, routing, row_len, rows_view, tol
from vkflash.gpu.ops.moe import TILES, MoEPlan, moe_routed, plan_words

pytestmark = pytest.mark.gpu

# every coopmat type as gate/up and as down (F32 passes run the scalar GEMM in the same call)
TYPE_PAIRS = [(Q.Q4_K, Q.Q5_0), (Q.Q5_K, Q.Q8_0), (Q.Q6_K, Q.Q6_K), (Q.Q8_0, Q.Q4_0), (Q.Q4_0, Q.F16),
              (Q.Q5_0, Q.F32), (Q.F16, Q.Q4_K), (Q.F32, Q.Q5_K), (Q.BF16, Q.IQ4_XS), (Q.IQ4_XS, Q.BF16)]
# the emulated path (lavapipe: every (mode, type, tile) is a pipeline it compiles) takes two pairs; the
# other decoders run through the same fetch code in test_matmul_cm.py
CASES = [("device", a, b) for a, b in TYPE_PAIRS] + [("emulated", a, b) for a, b in
                                                     ((Q.Q4_K, Q.Q5_0), (Q.BF16, Q.IQ4_XS))]


@pytest.fixture
def gpu(gpu):
    """The device with coopmat on (use_coopmat-based choices see it)."""
    return gpu.with_options(replace(gpu.options, coopmat=True))


def _plan(gpu, T: int, k: int, E: int, bn: int) -> MoEPlan:
    b = gpu.buffer(4 * (plan_words(T, k, E, bn) + 5), "plan")
    b.fill(0xDEADBEEF, np.uint32)
    return MoEPlan(b, T, k, E, bn)


def _run(gpu, rng, rw, x, ids, wts, d, F, plan, compact: bool, coopmat: bool) -> tuple[np.ndarray, list[str]]:
    T, k = ids.shape
    xv = rows_view(gpu, x, rng, "x")
    iv, wv = rows_view(gpu, ids, rng, "ids", pad4=False), rows_view(gpu, wts, rng, "wts", pad4=False)
    h, ys = poisoned(gpu, T * k, F, rng, "h", pad4=True), poisoned(gpu, T * k, d, rng, "ys")
    g = gpu.graph("routed_cm")
    moe_routed(g, xv, iv, wv, rw, ys, h, plan=plan, compact=compact, coopmat=coopmat)
    g.run()
    return read_rows(ys), [f"{op.name}: {op.kernel.name} {op.desc}" for op in g.ops[1:]]


def _check(what: str, got: np.ndarray, want: np.ndarray, limit: np.ndarray, ops: list[str]) -> None:
    assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} outputs not written; {ops}"
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err / limit), err.shape)
    assert (err <= limit).all(), (f"{what}: {np.count_nonzero(err > limit)} of {err.size} outside the bound; worst "
                                  f"(pair, c)={worst} got {got[worst]:.6g} want {want[worst]:.6g} |err| {err[worst]:.3g} "
                                  f"bound {limit[worst]:.3g} (max err/bound {np.max(err / limit):.3g}); {ops}")


@pytest.mark.parametrize("path,q_gu,q_down", CASES, ids=lambda v: getattr(v, "name", v))
def test_routed(gpu, rng, monkeypatch, path, q_gu, q_down):
    """Fused gate/up on the compact grid vs float64 over ragged T (one random tile width per test);
    the plain grid bit for bit; separate gate/up and the scalar expert GEMM within the bounds."""
    label = select(path, gpu, monkeypatch)
    E, k = int(rng.choice([16, 13])), 4
    d, F = row_len(q_gu, rng, 160), row_len(q_down, rng, 160)
    ex = experts(gpu, q_gu, q_down, E, d, F, rng)
    bn = int(rng.choice(TILES))
    for T in (9, 37, 130):
        x = rng.standard_normal((T, d), dtype=np.float32)
        ids, wts = routing(T, k, E, rng)
        want, bound = routed_reference(x, ids, wts, ex)
        f32 = tol(bound, max(d, F))
        cm_bound = f32 + 2 * U16 * bound
        what = f"{label} {q_gu.name}/{q_down.name} d={d} F={F} E={E} T={T} bn={bn}"
        got, ops = _run(gpu, rng, ex.fused, x, ids, wts, d, F, _plan(gpu, T, k, E, bn), True, True)
        _check(f"{what} fused compact", got, want, cm_bound, ops)
        plain, ops_p = _run(gpu, rng, ex.fused, x, ids, wts, d, F, _plan(gpu, T, k, E, bn), False, True)
        assert np.array_equal(plain, got), (f"{what}: plain grid differs from compact at "
                                            f"{np.count_nonzero(plain != got)} elements; {ops_p}")
        split, ops_s = _run(gpu, rng, ex.split, x, ids, wts, d, F, _plan(gpu, T, k, E, bn), True, True)
        _check(f"{what} separate gate/up", split, want, cm_bound, ops_s)
        scalar, _ = _run(gpu, rng, ex.fused, x, ids, wts, d, F, _plan(gpu, T, k, E, bn), True, False)
        _check(f"{what} coopmat vs scalar expert GEMM", got, scalar, cm_bound + f32, ops)


@pytest.mark.parametrize("path", ["device", "emulated"])
def test_tile_widths(gpu, rng, monkeypatch, path):
    """Every plan tile width (each a different warp layout: 16 × bn or 32 × bn/2 warp tiles) on one
    routing, fused and down, vs float64."""
    label = select(path, gpu, monkeypatch)
    E, k, T = 13, 4, int(rng.integers(60, 140))
    d, F = 96, 160
    ex = experts(gpu, Q.Q8_0, Q.Q8_0, E, d, F, rng)
    x = rng.standard_normal((T, d), dtype=np.float32)
    ids, wts = routing(T, k, E, rng)
    want, bound = routed_reference(x, ids, wts, ex)
    for bn in TILES:
        got, ops = _run(gpu, rng, ex.fused, x, ids, wts, d, F, _plan(gpu, T, k, E, bn), True, True)
        _check(f"{label} Q8_0 T={T} bn={bn}", got, want, tol(bound, max(d, F)) + 2 * U16 * bound, ops)


@pytest.mark.parametrize("path", ["device", "emulated"])
def test_two_tiles_per_subgroup(gpu, rng, monkeypatch, path):
    """Workgroups of 4 subgroups (cm_util.narrow_workgroup): fused gate/up and down vs float64."""
    label = select(path, gpu, monkeypatch)
    wg = narrow_workgroup(gpu, monkeypatch)
    E, k, T, bn = 13, 4, int(rng.integers(60, 140)), 32
    d, F = 96, 160
    ex = experts(gpu, Q.Q4_0, Q.Q8_0, E, d, F, rng)
    x = rng.standard_normal((T, d), dtype=np.float32)
    ids, wts = routing(T, k, E, rng)
    want, bound = routed_reference(x, ids, wts, ex)
    got, ops = _run(gpu, rng, ex.fused, x, ids, wts, d, F, _plan(gpu, T, k, E, bn), True, True)
    _check(f"{label} {wg} invocations Q4_0/Q8_0 T={T} bn={bn}", got, want, tol(bound, max(d, F)) + 2 * U16 * bound, ops)
