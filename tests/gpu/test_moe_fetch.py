"""The coopmat expert GEMM's wide-load weight fetch (VKFLASH_MMID_FAST_FETCH: common/quant_group.glsl's
cm_group_load + cm_group_decode instead of dequant_group) vs float64 NumPy and vs the old fetch, on
whole groups and on half groups over the whole workgroup (VKFLASH_MMID_HALF).

Paths as in test_moe_cm.py (cm_util: "device" skips without coopmat, "emulated" runs the CM_EMULATE
build anywhere). cm_group_decode computes dequant_group's values by the same expressions, so both fetches
give the same bits; the NumPy bound is test_moe_cm.py's (f32 bound plus the f16 inputs' 2·u16).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cm_util import U16, select
from moe_util import experts, poisoned, read_rows, routed_reference, routing, row_len, rows_view, tol
from vkflash.gpu.options import GpuOptions
from vkflash.gpu.ops.moe import HALF_TYPES, TILES, MoEPlan, moe_routed, plan_words

pytestmark = pytest.mark.gpu

# the shape-8L experts' types (Q4_K gate/up, Q5_0 down) on two ragged T with the bits of the whole-group
# and the old fetch; every other type with a wide-load decoder (Q5_K, Q8_0, Q4_0) and Q6_K (which keeps
# dequant_group) on one T vs float64 only, in halves where the type has them: the emulated pipelines
# are the test's cost
CASES = [(Q.Q4_K, Q.Q5_0, True), (Q.Q5_K, Q.Q8_0, False), (Q.Q6_K, Q.Q4_0, False)]


def _run(gpu, rng, rw, x, ids, wts, d, F, bn, fast: bool, half: bool = False) -> tuple[np.ndarray, list[str]]:
    """The routed experts with the fetch chosen through the options (the knobs' path)."""
    T, k = ids.shape
    E = rw.gate.n_exp
    gg = gpu.with_options(replace(gpu.options, coopmat=True, mmid_fast_fetch=fast, mmid_half=half))
    b = gg.buffer(4 * (plan_words(T, k, E, bn) + 5), "plan")
    b.fill(0xDEADBEEF, np.uint32)
    xv = rows_view(gg, x, rng, "x")
    iv, wv = rows_view(gg, ids, rng, "ids", pad4=False), rows_view(gg, wts, rng, "wts", pad4=False)
    h, ys = poisoned(gg, T * k, F, rng, "h", pad4=True), poisoned(gg, T * k, d, rng, "ys")
    g = gg.graph("routed_fetch")
    moe_routed(g, xv, iv, wv, rw, ys, h, plan=MoEPlan(b, T, k, E, bn))
    g.run()
    ops = [f"{op.name}: {op.kernel.name} {op.desc}" for op in g.ops[1:]]
    assert all(("fast" in o) == fast for o in ops), ops
    halves = {t.name.lower() for t in HALF_TYPES}  # an op reads "name: kernel type KxN … [half]"
    assert all((" half" in o) == (fast and half and o.split()[2] in halves) for o in ops), ops
    return read_rows(ys), ops


@pytest.mark.parametrize("path", ["device", "emulated"])
@pytest.mark.parametrize("q_gu,q_down,both", CASES, ids=lambda v: getattr(v, "name", "both" if v is True else "fast"))
def test_fetch(gpu, rng, monkeypatch, path, q_gu, q_down, both):
    """Fused gate/up and down through the wide-load fetch in half groups, a random plan tile width, vs
    float64; with `both`, over two ragged T and bit for bit the whole-group and the old fetch's result."""
    label = select(path, gpu, monkeypatch)
    E, k = int(rng.choice([13, 16])), int(rng.integers(2, 5))
    d, F = row_len(q_gu, rng, 160), row_len(q_down, rng, 160)
    ex = experts(gpu, q_gu, q_down, E, d, F, rng)
    bn = int(rng.choice(TILES))
    for T in (int(rng.integers(9, 40)), int(rng.integers(60, 130)))[:2 if both else 1]:
        x = rng.standard_normal((T, d), dtype=np.float32)
        ids, wts = routing(T, k, E, rng)
        want, bound = routed_reference(x, ids, wts, ex)
        limit = tol(bound, max(d, F)) + 2 * U16 * bound
        got, ops = _run(gpu, rng, ex.fused, x, ids, wts, d, F, bn, True, half=True)
        what = f"{label} {q_gu.name}/{q_down.name} d={d} F={F} E={E} k={k} T={T} bn={bn}"
        assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} outputs not written; {ops}"
        err = np.abs(got - want)
        assert (err <= limit).all(), f"{what}: max err/bound {np.max(err / limit):.3g}; {ops}"
        if both:
            whole, _ = _run(gpu, rng, ex.fused, x, ids, wts, d, F, bn, True, half=False)
            assert np.array_equal(got, whole), f"{what}: halves and whole groups differ at " \
                                               f"{np.count_nonzero(got != whole)} elements"
            old, _ = _run(gpu, rng, ex.fused, x, ids, wts, d, F, bn, False)
            assert np.array_equal(got, old), f"{what}: the fetches differ at {np.count_nonzero(got != old)} elements"


def test_knob():
    """VKFLASH_MMID_FAST_FETCH and VKFLASH_MMID_HALF are on by default and 0 turns each off."""
    assert GpuOptions.from_knobs().mmid_fast_fetch is True
    assert GpuOptions.from_knobs(VKFLASH_MMID_FAST_FETCH="0").mmid_fast_fetch is False
    assert GpuOptions.from_knobs().mmid_half is True
    assert GpuOptions.from_knobs(VKFLASH_MMID_HALF="0").mmid_half is False
