"""Routed experts (MODEL.md §5.7 M4) vs float64 NumPy: the prepass plan, the prefill expert GEMM
(compact and plain grids, fused and separate gate/up), the decode expert GEMV, ragged T, experts
without rows, every weight type as gate/up and as down."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from moe_util import experts, poisoned, read_rows, routed_reference, routing, row_len, rows_view, tol
from vkflash.gpu.ops.moe import (DECODE_MAX_T, TILES, ExpertStack, Mode, MoEPlan, RoutedExperts, expert_gemm,
                                 live_cap, moe_combine, moe_prepass, moe_routed, plan_words, tile_width)
from vkflash.gpu.ops.views import Rows

pytestmark = pytest.mark.gpu

POISON = 0xDEADBEEF


def _plan(gpu, T: int, k: int, E: int, bn: int) -> MoEPlan:
    b = gpu.buffer(4 * (plan_words(T, k, E, bn) + 5), "plan")
    b.fill(POISON, np.uint32)
    return MoEPlan(b, T, k, E, bn)


@pytest.mark.parametrize("E,k", [(16, 4), (13, 4), (512, 10)])
def test_prepass(gpu, rng, E, k):
    """Counts, offsets, rows grouped by expert in token order, live pairs; T crosses the 128-token chunks."""
    for T in (1, int(rng.integers(2, 40)), int(rng.integers(129, 300))):
        ids, _ = routing(T, k, E, rng)
        bn = int(rng.choice(TILES))
        plan = _plan(gpu, T, k, E, bn)
        g = gpu.graph("prepass")
        moe_prepass(g, rows_view(gpu, ids, rng, "ids", pad4=False), plan)
        g.run()
        got = plan.buf.read(np.uint32)
        counts = np.bincount(ids.ravel(), minlength=E)
        tiles = -(-counts // bn)
        L0, P0 = 1 + 2 * E, 1 + 2 * E + plan.live_cap
        assert got[0] == tiles.sum() <= plan.live_cap
        np.testing.assert_array_equal(got[1:1 + E], counts)
        np.testing.assert_array_equal(got[1 + E:L0], np.concatenate([[0], np.cumsum(counts)[:-1]]))
        want_live = [e | (t << 16) for e in range(E) for t in range(tiles[e])]
        np.testing.assert_array_equal(got[L0:L0 + len(want_live)], want_live)
        assert (got[L0 + len(want_live):P0] == POISON).all(), "writes past the live list"
        flat = ids.ravel()
        want_rows = np.concatenate([np.nonzero(flat == e)[0] for e in range(E)])  # pair index t·k + j, token order
        np.testing.assert_array_equal(got[P0:P0 + T * k], want_rows)
        assert (got[P0 + T * k:] == POISON).all()


def test_bounds():
    """The grid bound holds for the worst spreads; tile width follows the expected rows per expert."""
    assert tile_width(2048, 10, 512) == 48 and tile_width(1, 10, 512) == 16 and tile_width(4096, 10, 64) == 64
    for T, k, E, bn in ((2048, 10, 512, 48), (9, 4, 13, 16), (130, 4, 16, 64)):
        # every expert live with one row over a full tile: Σ⌈c_e/BN⌉ is largest when rows spread
        c = np.full(E, T * k // E)
        c[: T * k - c.sum()] += 1
        assert (-(-c // bn)).sum() <= live_cap(T, k, E, bn)


def _run(gpu, rng, ex, rw, x, ids, wts, d, F, plan=None, compact=None):
    T, k = ids.shape
    xv = rows_view(gpu, x, rng, "x")
    iv, wv = rows_view(gpu, ids, rng, "ids", pad4=False), rows_view(gpu, wts, rng, "wts", pad4=False)
    h, ys = poisoned(gpu, T * k, F, rng, "h", pad4=True), poisoned(gpu, T * k, d, rng, "ys")
    g = gpu.graph("routed")
    moe_routed(g, xv, iv, wv, rw, ys, h, plan=plan, compact=compact)
    g.run()
    return read_rows(ys)


def _check(got: np.ndarray, want: np.ndarray, limit: np.ndarray, what: str) -> None:
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err / limit), err.shape)
    assert np.isfinite(got).all(), f"{what}: unwritten outputs"
    assert (err <= limit).all(), (f"{what}: worst (pair, c)={worst} got {got[worst]} want {want[worst]} "
                                  f"tol {limit[worst]}")


TYPE_PAIRS = [(Q.Q4_K, Q.Q5_0), (Q.Q5_K, Q.Q8_0), (Q.Q6_K, Q.Q6_K), (Q.Q8_0, Q.Q4_0), (Q.Q4_0, Q.F16),
              (Q.Q5_0, Q.F32), (Q.F16, Q.Q4_K), (Q.F32, Q.Q5_K)]


@pytest.mark.parametrize("q_gu,q_down", TYPE_PAIRS, ids=lambda q: q.name)
def test_routed(gpu, rng, q_gu, q_down):
    """Every type as gate/up and as down: prefill GEMM (compact grid, one random tile width: widths
    agree bit for bit, test_tile_widths) and, for T ≤ 8, the decode GEMV, vs float64 over ragged T."""
    E, k = int(rng.choice([16, 13])), 4
    d, F = row_len(q_gu, rng, 160), row_len(q_down, rng, 160)
    ex = experts(gpu, q_gu, q_down, E, d, F, rng)
    bn = int(rng.choice(TILES))  # one width per test: each (mode, width) is a pipeline lavapipe compiles
    for T in (1, 3, 8, 9, 37, 130):
        x = rng.standard_normal((T, d), dtype=np.float32)
        ids, wts = routing(T, k, E, rng)
        want, bound = routed_reference(x, ids, wts, ex)
        limit = tol(bound, max(d, F))
        _check(_run(gpu, rng, ex, ex.fused, x, ids, wts, d, F, _plan(gpu, T, k, E, bn), True), want, limit,
               f"T={T} bn={bn} gemm")
        if T <= DECODE_MAX_T:
            _check(_run(gpu, rng, ex, ex.fused, x, ids, wts, d, F), want, limit, f"T={T} gemv")


@pytest.mark.parametrize("q_gu,q_down", [(Q.Q4_K, Q.Q5_0), (Q.Q8_0, Q.Q5_K)], ids=lambda q: q.name)
def test_paths_agree(gpu, rng, q_gu, q_down):
    """Compact == plain grid and fused == separate gate/up bit for bit (GEMM and GEMV), all vs float64."""
    E, k = int(rng.choice([16, 13])), 4
    d, F = row_len(q_gu, rng, 160), row_len(q_down, rng, 160)
    ex = experts(gpu, q_gu, q_down, E, d, F, rng)
    for T in (int(rng.integers(1, DECODE_MAX_T + 1)), int(rng.integers(9, 140))):
        x = rng.standard_normal((T, d), dtype=np.float32)
        ids, wts = routing(T, k, E, rng)
        want, bound = routed_reference(x, ids, wts, ex)
        bn = tile_width(T, k, E)
        outs = {(compact, fused): _run(gpu, rng, ex, ex.fused if fused else ex.split, x, ids, wts, d, F,
                                       _plan(gpu, T, k, E, bn), compact)
                for compact in (True, False) for fused in (True, False)}
        if T <= DECODE_MAX_T:
            outs["gemv", True] = _run(gpu, rng, ex, ex.fused, x, ids, wts, d, F)
            outs["gemv", False] = _run(gpu, rng, ex, ex.split, x, ids, wts, d, F)
            assert np.array_equal(outs["gemv", True], outs["gemv", False]), f"T={T}: GEMV fused != separate"
        for key, got in outs.items():
            _check(got, want, tol(bound, max(d, F)), f"T={T} bn={bn} {key}")
        for key in ((True, False), (False, True), (False, False)):
            assert np.array_equal(outs[key], outs[True, True]), f"T={T}: (compact, fused)={key} != compact fused"


def test_tile_widths(gpu, rng):
    """Two tile widths on the same routing give identical bits (a row's sums do not depend on its tile)."""
    E, k, T = 13, 4, int(rng.integers(60, 140))
    d, F = 64, 96
    ex = experts(gpu, Q.Q8_0, Q.Q8_0, E, d, F, rng)
    x = rng.standard_normal((T, d), dtype=np.float32)
    ids, wts = routing(T, k, E, rng)
    outs = [_run(gpu, rng, ex, ex.fused, x, ids, wts, d, F, _plan(gpu, T, k, E, int(bn)))
            for bn in rng.choice(TILES, 2, replace=False)]
    want, bound = routed_reference(x, ids, wts, ex)
    _check(outs[0], want, tol(bound, max(d, F)), "tile widths")
    assert np.array_equal(outs[1], outs[0])


def test_validation(gpu, rng):
    """Inconsistent stacks, plans, shapes and views are refused before anything is dispatched."""
    E, k, d, F = 13, 4, 64, 32
    ex = experts(gpu, Q.Q8_0, Q.Q8_0, E, d, F, rng)
    with pytest.raises(ValueError, match="experts of 32 rows every 16 rows"):
        ExpertStack(ex.split.gate.buf, int(Q.Q8_0), d, F, E, 0, 16)
    with pytest.raises(ValueError, match="need"):
        ExpertStack(ex.split.gate.buf, int(Q.Q8_0), d, F, E + 1)
    with pytest.raises(ValueError, match="do not form"):
        RoutedExperts(ex.split.gate, ex.split.up, ex.split.gate)
    with pytest.raises(ValueError, match="tile width 40"):
        MoEPlan(gpu.buffer(4096, "p"), 9, k, E, 40)
    with pytest.raises(ValueError, match="needs"):
        MoEPlan(gpu.buffer(64, "p"), 9, k, E, 16)
    g = gpu.graph("bad")
    T = 9
    x = Rows(gpu.buffer(4 * T * d), T, d)
    ids, wts = Rows(gpu.buffer(4 * T * k), T, k), Rows(gpu.buffer(4 * T * k), T, k)
    h, ys = Rows(gpu.buffer(4 * T * k * F), T * k, F), Rows(gpu.buffer(4 * T * k * d), T * k, d)
    with pytest.raises(ValueError, match="plan is for 10x4"):
        moe_routed(g, x, ids, wts, ex.split, ys, h, plan=_plan(gpu, 10, k, E, 16))
    with pytest.raises(ValueError, match="one buffer"):
        expert_gemm(g, _plan(gpu, T, k, E, 16), Mode.GATE_UP, ex.split.gate, x, h, w2=ex.split.up)
    with pytest.raises(ValueError, match="x is 9x32"):
        expert_gemm(g, _plan(gpu, T, k, E, 16), Mode.DOWN, ex.split.down, Rows(h.buf, T, F), ys, wts=wts)
    with pytest.raises(ValueError, match="come together"):
        moe_combine(g, ys, Rows(gpu.buffer(4 * T * d), T, d), k, shared=Rows(gpu.buffer(4 * T * d), T, d))
    assert not g.ops


def _decode_pass(gpu, rng, mode, ex, x: np.ndarray, ids: np.ndarray, wts: np.ndarray | None, plan=None):
    """One expert_gemv pass on a fresh poisoned output; returns the output rows (T·k × n_out)."""
    from vkflash.gpu.ops.moe import expert_gemv

    T, k = ids.shape
    w = ex.fused.down if mode == Mode.DOWN else ex.fused.gate
    xv = rows_view(gpu, x, rng, "x")
    iv = rows_view(gpu, ids, rng, "ids", pad4=False)
    wv = rows_view(gpu, wts, rng, "wts", pad4=False) if wts is not None else None
    y = poisoned(gpu, T * k, w.n_out, rng, "y")
    g = gpu.graph("pass")
    expert_gemv(g, iv, mode, w, xv, y, wts=wv, w2=ex.fused.up if mode == Mode.GATE_UP else None, plan=plan)
    g.run()
    return read_rows(y), g.ops[0].kernel.name


def _q8_step(a: np.ndarray) -> np.ndarray:
    from matmul_util import q8_steps

    return q8_steps(a).astype(np.float64)


@pytest.mark.parametrize("q_gu,q_down", [(Q.Q4_K, Q.Q5_0), (Q.Q6_K, Q.Q8_0), (Q.Q5_K, Q.Q4_0)],
                         ids=lambda q: q.name)
def test_gemv_q8_passes(gpu, rng, q_gu, q_down):
    """VKFLASH_GEMV_Q8: the fused gate/up pass and the down pass on 8-bit activations, each within its
    bound of float64: gate and up move by Σ|W|·d/2 (d = the x block's amax/127), carried through silu
    (|silu'| ≤ 1.1) and the product; down by w·Σ|W_d|·d_h/2; plus the f32 bounds."""
    from dataclasses import replace

    from vkflash.gpu.ops.matmul import q8_possible

    E, k, T = 13, 4, int(rng.integers(1, DECODE_MAX_T + 1))
    d, F = 256, 32 * int(rng.integers(2, 9))
    if not (q8_possible(gpu.caps, q_gu, d) and q8_possible(gpu.caps, q_down, F)):
        pytest.skip(f"{gpu.caps.name}: no integer dot product")
    g8 = gpu.with_options(replace(gpu.options, gemv_teams=True, gemv_q8=True))
    ex = experts(g8, q_gu, q_down, E, d, F, rng)
    x = rng.standard_normal((T, d), dtype=np.float32)
    ids, wts = routing(T, k, E, rng)
    got, name = _decode_pass(g8, rng, Mode.GATE_UP, ex, x, ids, None)
    assert name == f"gemv_id_q8_{q_gu.name.lower()}"
    x64, dx = x.astype(np.float64), _q8_step(x)
    for a in range(T * k):
        t, e = a // k, ids[a // k, a % k]
        g_, u = ex.gate[e] @ x64[t], ex.up[e] @ x64[t]
        s = g_ / (1 + np.exp(-g_))
        dg = (np.abs(ex.gate[e]) @ (dx[t] / 2)) * 1.001 + tol(np.abs(ex.gate[e]) @ (np.abs(x64[t]) + dx[t]), d)
        du = (np.abs(ex.up[e]) @ (dx[t] / 2)) * 1.001 + tol(np.abs(ex.up[e]) @ (np.abs(x64[t]) + dx[t]), d)
        lim = 1.1 * dg * (np.abs(u) + du) + np.abs(s) * du + tol(np.abs(s * u), 64)
        _check(got[a], s * u, lim, f"gate_up pair {a}")
    h = got.astype(np.float32)  # the down pass reads the GPU's h
    got, name = _decode_pass(g8, rng, Mode.DOWN, ex, h, ids, wts)
    assert name == f"gemv_id_q8_{q_down.name.lower()}"
    h64, dh = h.astype(np.float64), _q8_step(h)
    for a in range(T * k):
        wt, e = wts[a // k, a % k], ids[a // k, a % k]
        want = wt * (ex.down[e] @ h64[a])
        lim = wt * ((np.abs(ex.down[e]) @ (dh[a] / 2)) * 1.001 + tol(np.abs(ex.down[e]) @ (np.abs(h64[a]) + dh[a]), F))
        _check(got[a], want, lim + 1e-30, f"down pair {a}")


@pytest.mark.parametrize("teams,deq", [(False, True), (True, True), (True, False)],
                         ids=["legacy", "teams", "teams-scaled"])
def test_gemv_paths(gpu, rng, teams, deq):
    """The routed decode on mul_mat_id_vec.comp (VKFLASH_GEMV_TEAMS=0) and on gemv_id.comp at explicit
    team widths (narrower and wider than a subgroup), codes turned into weights once
    (VKFLASH_GEMV_DEQ=1) or scaled per column (0), all vs float64."""
    from dataclasses import replace

    from vkflash.gpu.ops.matmul import GemvPlan

    E, k, T = 13, 4, int(rng.integers(1, DECODE_MAX_T + 1))
    d, F = 256, 32 * int(rng.integers(2, 9))
    gg = gpu.with_options(replace(gpu.options, gemv_teams=teams, gemv_q8=False, gemv_deq=deq))
    ex = experts(gg, Q.Q4_K, Q.Q5_0, E, d, F, rng)
    x = rng.standard_normal((T, d), dtype=np.float32)
    ids, wts = routing(T, k, E, rng)
    want, bound = routed_reference(x, ids, wts, ex)
    if not teams:
        _check(_run(gg, rng, ex, ex.fused, x, ids, wts, d, F), want, tol(bound, max(d, F)), "legacy")
        return
    for plan in (GemvPlan(8, 1), GemvPlan(16, 2), GemvPlan(128, 1)):
        h, name = _decode_pass(gg, rng, Mode.GATE_UP, ex, x, ids, None, plan)
        assert name == "gemv_id_q4_k"
        got, _ = _decode_pass(gg, rng, Mode.DOWN, ex, h.astype(np.float32), ids, wts, plan)
        _check(got, want, tol(bound, max(d, F)), f"plan {plan}")
