"""GDN gated delta rule (G6–G8, GC1–GC6) vs the float64 token-by-token recurrence of the model
reference: step, scalar chunked and matrix chunked variants (one kernel, or split into a per-chunk
pass and a scan), both head maps, state planes in place and per token (ring), and the
VKFLASH_GDN_MATRIX and VKFLASH_GDN_SPLIT knobs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from vkflash.gpu.options import GpuOptions
from vkflash.gpu.ops import gdn
from vkflash.gpu.ops.gdn import GDNShape, HeadMap, Variant
from vkflash.gpu.ops.views import Rows
from vkflash.model.layers.common import sigmoid, softplus
from vkflash.model.layers.gdn import recurrent
from vkflash.model.layers.norms import l2_norm

pytestmark = pytest.mark.gpu
EPS = 1e-6


@dataclass
class Inputs:
    """One ubatch of delta-rule inputs in f32: conv rows c (T, C), β and g (T, n_v), state (n_v, S, S)."""

    c: np.ndarray
    beta: np.ndarray
    g: np.ndarray
    state: np.ndarray


def _inputs(rng: np.random.Generator, shape: GDNShape, T: int) -> Inputs:
    """Conv-like rows (silu of normals, per-token scales down to where ε matters in G6), gates as
    G2–G3 make them, a non-zero state."""
    n_v, S = shape.n_v, shape.S
    x = rng.standard_normal((T, shape.C)) * np.exp(rng.uniform(-7, 2, (T, 1)))
    c = x * sigmoid(x)
    beta = sigmoid(rng.normal(0, 2, (T, n_v)))
    g = softplus(rng.normal(0, 2, (T, n_v))) * -rng.uniform(0.05, 1, n_v)
    state = rng.normal(0, 0.5, (n_v, S, S))
    return Inputs(*(a.astype(np.float32) for a in (c, beta, g, state)))


def _reference(shape: GDNShape, x: Inputs, T_end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float64 (G6)–(G8) over the first T_end tokens: o (T, n_v·S) and the state (n_v, S, S)."""
    S, n_k, n_v = shape.S, shape.n_k, shape.n_v
    c = x.c[:T_end].astype(np.float64)
    T = len(c)
    q = l2_norm(c[:, :n_k * S].reshape(T, n_k, S), EPS) / np.sqrt(S)
    k = l2_norm(c[:, n_k * S:2 * n_k * S].reshape(T, n_k, S), EPS)
    v = c[:, 2 * n_k * S:].reshape(T, n_v, S)
    j = np.arange(n_v)
    pi = j % n_k if shape.head_map == HeadMap.TILED else j // (n_v // n_k)
    o, st = recurrent(q[:, pi], k[:, pi], v, x.beta[:T_end].astype(np.float64), x.g[:T_end].astype(np.float64),
                      x.state.astype(np.float64))
    return o.reshape(T, n_v * S), st


def _tol(ref: np.ndarray, S: int, T: int) -> float:
    """Absolute bound for f32 results of the recurrence, relative to the data's scale.

    Each output and state entry adds ≤ S + 64 rounded terms of O(scale) per token (a length-S dot
    product; chunked, also ≤ 64 chunk rows). State errors are carried on contracted (α ≤ 1 and
    I − βk̂k̂ᵀ has norm ≤ 1), so over T tokens ≈ (S + 64)(T + 1) roundings of random sign add up
    like their square root; 8 covers the exp/sqrt ulps (measured errors are ~1/50 of this). A wrong
    head map, ε, scale or decay is off by far more.
    """
    return 8 * np.sqrt((S + 64) * (T + 1)) * 2.0**-24 * float(np.abs(ref).max())


def _run(gpu, rng, shape: GDNShape, x: Inputs, variant: Variant | None, n_planes: int = 1, chunk: int | None = None,
         c_pad: int = 0, ring: bool = False, cols: int | None = None) -> tuple[np.ndarray, np.ndarray, int, gdn.DeltaPlan]:
    """One dispatch on fresh buffers (o NaN-poisoned; c at an offset with a padded row stride); the
    state in a random live one of n_planes NaN planes. Returns o, every plane, the live plane, the plan."""
    T, C, n_v, S = len(x.c), shape.C, shape.n_v, shape.S
    stride = C + c_pad
    cbuf = np.full(3 + T * stride, 7.0, np.float32)
    cbuf[3:].reshape(T, stride)[:, :C] = x.c
    cb = gpu.upload(cbuf, "conv")
    gates = gpu.upload(np.concatenate([x.beta, x.g], axis=1), "beta|g")
    live = int(rng.integers(0, n_planes))
    planes = np.full((n_planes, n_v, S, S), np.nan, np.float32)
    planes[live] = x.state
    sb = gpu.upload(planes, "ssm_planes")
    ob = gpu.buffer(4 * T * n_v * S, "o")
    ob.fill(np.nan)
    state = gdn.Planes(sb, n_v, S * S, n_planes, gpu.upload(np.array([0, live], np.uint32), "live"), 1)
    g = gpu.graph("delta")
    plan = gdn.delta(g, Rows(cb, T, C, 3, stride), Rows(gates, T, n_v, 0, 2 * n_v), Rows(gates, T, n_v, n_v, 2 * n_v),
                     state, Rows(ob, T, n_v * S), shape, EPS, variant, ring, chunk, cols=cols)
    g.run()
    return (ob.read(np.float32).reshape(T, n_v * S), sb.read(np.float32).reshape(n_planes, n_v, S, S), live, plan)


def _close(name: str, got: np.ndarray, want: np.ndarray, tol: float) -> None:
    err = np.abs(got - want).max()
    assert err <= tol, f"{name}: max err {err:.3g} > {tol:.3g} (scale {np.abs(want).max():.3g})"


@pytest.mark.parametrize("head_map", list(HeadMap))
@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 130])
def test_chunked_equals_recurrence(gpu, rng, T, head_map):
    """The chunked variant (the device's default chunk) over ragged T vs the f64 recurrence: o and state."""
    shape = GDNShape(2, 6, 32, head_map)
    x = _inputs(rng, shape, T)
    o, st, live, plan = _run(gpu, rng, shape, x, Variant.CHUNK, n_planes=int(rng.integers(1, 4)),
                             c_pad=int(rng.integers(0, 5)))
    assert plan.variant == Variant.CHUNK
    want_o, want_st = _reference(shape, x)
    _close("o", o, want_o, _tol(want_o, 32, T))
    _close("state", st[live], want_st, _tol(want_st, 32, T))
    assert np.isnan(np.delete(st, live, 0)).all(), "a plane other than the live one was written"


@pytest.mark.parametrize("chunk", [8, 16])
def test_small_chunks_and_slices(gpu, rng, chunk):
    """Other chunk sizes (more chunk boundaries, padding rows in the last) on a larger S, n_k = 1."""
    shape = GDNShape(1, 3, 64, HeadMap.GROUPED)
    T = int(rng.integers(2 * chunk + 1, 5 * chunk))
    x = _inputs(rng, shape, T)
    o, st, _, plan = _run(gpu, rng, shape, x, Variant.CHUNK, chunk=chunk)
    assert plan.chunk == chunk
    want_o, want_st = _reference(shape, x)
    _close("o", o, want_o, _tol(want_o, 64, T))
    _close("state", st[0], want_st, _tol(want_st, 64, T))


MATRIX_FORMS = [Variant.MATRIX, Variant.SPLIT]


@pytest.mark.parametrize("variant", MATRIX_FORMS)
@pytest.mark.parametrize("head_map", list(HeadMap))
@pytest.mark.parametrize("T", [1, 3, 31, 32, 33, 100])
def test_matrix_equals_recurrence(gpu, rng, T, head_map, variant):
    """Each matrix form (the device's default layout) over ragged T vs the f64 recurrence: o and state."""
    shape = GDNShape(2, 6, 32, head_map)
    x = _inputs(rng, shape, T)
    o, st, _, plan = _run(gpu, rng, shape, x, variant, c_pad=int(rng.integers(0, 5)))
    assert plan.variant == variant
    want_o, want_st = _reference(shape, x)
    _close("o", o, want_o, _tol(want_o, 32, T))
    _close("state", st[0], want_st, _tol(want_st, 32, T))


LAYOUTS = [(32, 16, 4), (64, 32, 16), (64, 16, 64), (128, 16, 16)]
"""(S, chunk, cols) that fit lavapipe's 32 KiB of shared memory in both matrix forms."""


@pytest.mark.parametrize("head_map", list(HeadMap))
@pytest.mark.parametrize("variant, S, chunk, cols", [(Variant.MATRIX, *x) for x in LAYOUTS + [(16, 64, 8)]]
                         + [(Variant.SPLIT, *x) for x in LAYOUTS + [(16, 32, 8), (64, 16, 4)]])
def test_matrix_layouts(gpu, rng, S, chunk, cols, head_map, variant):
    """Every chunk (1, 2 or 4 solve blocks), slices from one 4-column tile to 64 columns, and (split)
    1, 2, 4 and 8 key ranges of the scan's S₀ products, over a ragged T of several chunks."""
    shape = GDNShape(2, 4, S, head_map)
    T = int(rng.integers(2 * chunk + 1, 3 * chunk))
    x = _inputs(rng, shape, T)
    o, st, _, plan = _run(gpu, rng, shape, x, variant, chunk=chunk, cols=cols)
    assert (plan.variant, plan.chunk, plan.cols) == (variant, chunk, cols)
    want_o, want_st = _reference(shape, x)
    _close("o", o, want_o, _tol(want_o, S, T))
    _close("state", st[0], want_st, _tol(want_st, S, T))


def test_split_key_ranges():
    """The split scan's key ranges: as many (a power of two) as idle invocations and the Q rows'
    space for their partial tiles allow."""
    plan = gdn._plan_split(GDNShape(16, 32, 128, HeadMap.GROUPED), 256, 12288, None, None)
    assert (plan.chunk, plan.cols, plan.rows) == (32, 16, 4)
    assert gdn._plan_split(GDNShape(2, 4, 128, HeadMap.TILED), 256, 12288, 32, 8).rows == 8
    assert gdn._plan_split(GDNShape(2, 4, 16, HeadMap.TILED), 256, 12288, 64, 8).rows == 2
    assert gdn._plan_split(GDNShape(2, 4, 16, HeadMap.TILED), 256, 12288, 16, 16).rows == 1


@pytest.mark.parametrize("knob, value, picked, other", [
    ("VKFLASH_GDN_SPLIT", "1", Variant.SPLIT, Variant.MATRIX),
    ("VKFLASH_GDN_SPLIT", "0", Variant.MATRIX, Variant.SPLIT),
    ("VKFLASH_GDN_MATRIX", "1", Variant.MATRIX, Variant.CHUNK),
    ("VKFLASH_GDN_MATRIX", "0", Variant.CHUNK, Variant.MATRIX)])
def test_knobs_pick_the_prefill_variant_and_both_agree(gpu, rng, knob, value, picked, other):
    """VKFLASH_GDN_MATRIX picks the prefill variant (0: the scalar one), VKFLASH_GDN_SPLIT the matrix
    form's two-pass split or its one kernel. Both sides are within _tol of the f64 recurrence (tested
    above), so within 2·_tol of each other: they round differently (row norms in 4 partial sums, r_k
    and r_q applied after the products, V' by 16-row blocks, by all of T, or row by row, other chunk
    sizes), all in f32."""
    shape = GDNShape(2, 6, 32, HeadMap(int(rng.integers(0, 2))))
    T = int(rng.integers(9, 150))
    x = _inputs(rng, shape, T)
    o, st, _, plan = _run(gpu.with_options(GpuOptions.from_knobs(**{knob: value})), rng, shape, x, None)
    assert plan.variant == picked
    o2, st2, _, _ = _run(gpu, rng, shape, x, other)
    want_o, want_st = _reference(shape, x)
    _close(f"o {picked.name} vs {other.name}", o, o2, 2 * _tol(want_o, 32, T))
    _close(f"state {picked.name} vs {other.name}", st, st2, 2 * _tol(want_st, 32, T))


@pytest.mark.parametrize("head_map", list(HeadMap))
@pytest.mark.parametrize("T", [1, 3, 8])
def test_step_in_place_and_ring(gpu, rng, T, head_map):
    """The step variant (decode / MTP verify) updates the live plane in place; as a ring step it
    leaves the live plane and writes the state after token t into plane live + 1 + t (mod n), with
    the same o bit for bit."""
    shape = GDNShape(2, 6, 32, head_map)
    x = _inputs(rng, shape, T)
    n = T + 1 + int(rng.integers(0, 3))
    o, st, live, plan = _run(gpu, rng, shape, x, Variant.STEP, n_planes=n)
    assert plan.variant == Variant.STEP
    want_o, want_st = _reference(shape, x)
    tol = _tol(want_st, 32, T)
    _close("o", o, want_o, _tol(want_o, 32, T))
    _close("state", st[live], want_st, tol)
    o_ring, planes, live, _ = _run(gpu, rng, shape, x, Variant.STEP, n_planes=n, ring=True)
    np.testing.assert_array_equal(o_ring, o)
    written = {(live + 1 + t) % n: t for t in range(T)}
    for q in range(n):
        if q not in written:
            assert q == live or np.isnan(planes[q]).all(), f"plane {q} written"
            continue
        _close(f"plane {q}", planes[q], _reference(shape, x, written[q] + 1)[1], tol)
    np.testing.assert_array_equal(planes[live], x.state)


@pytest.mark.parametrize("chunked", [Variant.CHUNK, Variant.MATRIX, Variant.SPLIT])
@pytest.mark.parametrize("S", [32, 128])
def test_step_over_T_equals_chunked(gpu, rng, S, chunked):
    """The step kernel over T tokens equals each chunked kernel over the same T (o and state)."""
    shape = GDNShape(2, 4, S, HeadMap.TILED)
    T = int(rng.integers(20, 70))
    x = _inputs(rng, shape, T)
    o1, st1, _, _ = _run(gpu, rng, shape, x, Variant.STEP)
    o2, st2, _, _ = _run(gpu, rng, shape, x, chunked)
    want_o, want_st = _reference(shape, x)
    _close("o step vs chunk", o1, o2, 2 * _tol(want_o, S, T))
    _close("state step vs chunk", st1, st2, 2 * _tol(want_st, S, T))
    _close("o step", o1, want_o, _tol(want_o, S, T))


def test_large_state_prefill_falls_back_to_step(gpu, rng):
    """S = 512: no chunk of either chunked variant fits the device's shared memory (32 KiB lavapipe,
    48 KiB H200), so a prefill-sized T runs the step kernel token by token, equal to the recurrence;
    asking for the chunked variant is still an error naming shared memory."""
    shape = GDNShape(1, 2, 512, HeadMap.TILED)
    T = int(rng.integers(gdn.STEP_MAX_T + 1, 24))
    x = _inputs(rng, shape, T)
    o, st, _, plan = _run(gpu, rng, shape, x, None)
    assert plan.variant == Variant.STEP
    want_o, want_st = _reference(shape, x)
    _close("o", o, want_o, _tol(want_o, 512, T))
    _close("state", st[0], want_st, _tol(want_st, 512, T))
    with pytest.raises(ValueError, match="does not fit .* shared memory"):
        _run(gpu, rng, shape, x, Variant.CHUNK)


@pytest.mark.parametrize("variant", list(Variant))
def test_raw_gates_equal_gates_then_delta(gpu, rng, variant):
    """Fusion.GDN_GATES: β = σ(b), g = softplus(a + dt_bias)·ssm_a computed inside the delta kernel
    give the same o and state as gdn.gates then gdn.delta up to rounding (strided raw columns, as in
    the GDN proj row), and o near the float64 recurrence."""
    from fusion_util import graph
    from vkflash.gpu.options import Fusion

    shape = GDNShape(2, 6, 32, HeadMap.TILED)
    T, n_v, C = int(rng.integers(1, 80)), shape.n_v, shape.C
    x = _inputs(rng, shape, T)
    raw = rng.normal(0, 2, (T, 2 * n_v)).astype(np.float32)  # [b | a] per token
    dt = (1 + rng.uniform(-0.5, 0.5, n_v)).astype(np.float32)
    sa = (-rng.uniform(0.05, 1, n_v)).astype(np.float32)
    out = {}
    for fused in (True, False):
        cb, rb, sb = gpu.upload(x.c, "conv"), gpu.upload(raw, "ba"), gpu.upload(x.state, "state")
        db, ab, gb = gpu.upload(dt, "dt"), gpu.upload(sa, "ssm_a"), gpu.buffer(4 * T * 2 * n_v, "gates")
        ob = gpu.buffer(4 * T * n_v * shape.S, "o")
        ob.fill(np.nan)
        b, a = Rows(rb, T, n_v, 0, 2 * n_v), Rows(rb, T, n_v, n_v, 2 * n_v)
        dtv, sav = Rows(db, 1, n_v), Rows(ab, 1, n_v)
        g = graph(gpu, "delta_gates", fused, Fusion.GDN_GATES)
        beta, gate = Rows(gb, T, n_v, 0, 2 * n_v), Rows(gb, T, n_v, n_v, 2 * n_v)
        gdn.gates(g, b, a, dtv, sav, beta, gate)
        gdn.delta(g, Rows(cb, T, C), beta, gate, Rows(sb, n_v, shape.S ** 2), Rows(ob, T, n_v * shape.S), shape,
                  EPS, variant)
        assert len(g.ops) == (1 if fused else 2) + (variant == Variant.SPLIT)  # the split: 2 dispatches
        g.run()
        out[fused] = ob.read(np.float32), sb.read(np.float32)
    # the same formulas, inlined: the compiler may contract them differently (seen: ≤ 1e-7 relative)
    for got, want in zip(out[True], out[False]):
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    ref = Inputs(x.c, sigmoid(raw[:, :n_v].astype(np.float64)).astype(np.float32),
                 (softplus(raw[:, n_v:].astype(np.float64) + dt) * sa).astype(np.float32), x.state)
    want_o, _ = _reference(shape, ref)
    _close("o", out[True][0].reshape(T, -1), want_o, 4 * _tol(want_o, shape.S, T))


def test_prefill_then_decode_in_one_graph(gpu, rng):
    """Two chunked prefill ubatches, then single-token steps, then a verify batch (ring), carrying
    the live plane through one recorded graph: equal to the recurrence over all tokens."""
    shape = GDNShape(2, 6, 32, HeadMap.TILED)
    parts = [int(rng.integers(40, 100)), int(rng.integers(9, 40)), 1, 1, 4]
    T = sum(parts)
    x = _inputs(rng, shape, T)
    C, n_v, S = shape.C, shape.n_v, shape.S
    planes = np.full((6, n_v, S, S), np.nan, np.float32)
    planes[2] = x.state
    cb, sb = gpu.upload(x.c, "conv"), gpu.upload(planes, "ssm_planes")
    state = gdn.Planes(sb, n_v, S * S, 6, gpu.upload(np.array([2], np.uint32), "live"))
    bb, gb = gpu.upload(x.beta, "beta"), gpu.upload(x.g, "g")
    ob = gpu.buffer(4 * T * n_v * S, "o")
    ob.fill(np.nan)
    g = gpu.graph("prefill+decode")
    t0 = 0
    for n in parts:
        gdn.delta(g, Rows(cb, n, C, t0 * C), Rows(bb, n, n_v, t0 * n_v), Rows(gb, n, n_v, t0 * n_v),
                  state, Rows(ob, n, n_v * S, t0 * n_v * S), shape, EPS, ring=n == 4)
        t0 += n
    assert [op.spec[0] for op in g.ops] == [Variant.MATRIX, Variant.MATRIX, Variant.STEP, Variant.STEP, Variant.STEP]
    g.run()
    want_o, want_st = _reference(shape, x)
    _close("o", ob.read(np.float32).reshape(T, -1), want_o, _tol(want_o, S, T))
    got = sb.read(np.float32).reshape(6, n_v, S, S)
    for t in range(4):  # the verify step's token t: plane (2 + 1 + t) mod 6
        _close(f"plane {(3 + t) % 6}", got[(3 + t) % 6], _reference(shape, x, T - 3 + t)[1], _tol(want_st, S, T))
    np.testing.assert_array_equal(got[1], planes[1])


def test_validation(gpu):
    b = gpu.buffer(4 * 1 << 16, "b")
    shape = GDNShape(2, 6, 32, HeadMap.TILED)
    g = gpu.graph("bad")
    C, T = shape.C, 5
    args = (Rows(b, T, C), Rows(b, T, 6, 2000), Rows(b, T, 6, 2100), Rows(b, 6, 1024, 3000),
            Rows(b, T, 192, 10000))
    ring = (Rows(b, T, C), Rows(b, T, 6, 2000), Rows(b, T, 6, 2100), gdn.Planes(b, 6, 1024, 6, b, 0, 20000),
            Rows(b, T, 192, 10000))
    with pytest.raises(ValueError, match="ring step needs the step variant"):
        gdn.delta(g, *ring, shape, EPS, Variant.CHUNK, ring=True)
    with pytest.raises(ValueError, match="ring step of 5 tokens"):
        gdn.delta(g, *ring[:3], gdn.Planes(b, 6, 1024, 5, b, 0, 20000), ring[4], shape, EPS, Variant.STEP, ring=True)
    with pytest.raises(ValueError, match="conv rows"):
        gdn.delta(g, Rows(b, T, C - 1), *args[1:], shape, EPS)
    with pytest.raises(ValueError, match="multiple of n_k"):
        GDNShape(4, 6, 32, HeadMap.GROUPED)
    with pytest.raises(ValueError, match="does not fit"):
        gdn.delta(g, *args, shape, EPS, Variant.CHUNK, chunk=128)
    with pytest.raises(ValueError, match="multiple of 16"):
        gdn.delta(g, *args, shape, EPS, Variant.MATRIX, chunk=24)
    with pytest.raises(ValueError, match="multiple of 4 dividing"):
        gdn.delta(g, *args, shape, EPS, Variant.MATRIX, cols=6)
    with pytest.raises(ValueError, match="no matrix layout"):
        gdn.delta(g, *args, shape, EPS, Variant.MATRIX, chunk=256, cols=32)
    with pytest.raises(ValueError, match="no split layout"):
        gdn.delta(g, *args, shape, EPS, Variant.SPLIT, chunk=256, cols=32)
    assert not g.ops
