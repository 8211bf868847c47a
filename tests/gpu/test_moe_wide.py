"""The coopmat expert GEMM's wide K steps (moe.CmStep: kg 32-groups per step, the whole workgroup
fetching weights; VKFLASH_MMID_WIDE) vs float64 NumPy and vs the old 32-wide step.

Paths as in test_moe_cm.py (cm_util: "device" skips without coopmat, "emulated" runs the CM_EMULATE
build anywhere). A wide step feeds the same f16 values to the same coopmat tiles in the same k order
as the narrow one, so the two agree bit for bit; the NumPy bound is test_moe_cm.py's.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cm_util import SHAPE_16, U16, select
from moe_util import experts, poisoned, read_rows, routed_reference, routing, rows_view, tol
from vkflash.gpu.options import GpuOptions
from vkflash.gpu.ops.moe import (FAST, NARROW, WIDE_MAX_BN, WIDE_STEPS, CmStep, MoEPlan, cm_expert_tile, cm_step,
                                 moe_routed, plan_words)

pytestmark = pytest.mark.gpu

# the default steps, and smaller tiles of more kinds (fitting lavapipe's 32 KiB), with and without
# the wide-load decode
STEPS = (CmStep(2, True, 2), CmStep(2, False, 2, True), CmStep(4, True, 4, True), CmStep(4, False, 4), FAST) + WIDE_STEPS
# the shape-8L experts' types (Q4_K gate/up, Q5_0 down) on every step that fits, with the narrow step's
# bits; the other types of those files (Q5_K, Q6_K, Q8_0) on the widest step vs float64 only (every
# type's groups go through the same dequant_group call: the emulated pipelines are the test's cost)
CASES = [(Q.Q4_K, Q.Q5_0, True), (Q.Q5_K, Q.Q8_0, False), (Q.Q6_K, Q.Q4_0, False)]


@pytest.fixture
def gpu(gpu):
    """The device with coopmat on."""
    return gpu.with_options(replace(gpu.options, coopmat=True))


def _run(gpu, rng, rw, x, ids, wts, d, F, bn, step: CmStep | None) -> tuple[np.ndarray, list[str]]:
    T, k = ids.shape
    E = rw.gate.n_exp
    b = gpu.buffer(4 * (plan_words(T, k, E, bn) + 5), "plan")
    b.fill(0xDEADBEEF, np.uint32)
    xv = rows_view(gpu, x, rng, "x")
    iv, wv = rows_view(gpu, ids, rng, "ids", pad4=False), rows_view(gpu, wts, rng, "wts", pad4=False)
    h, ys = poisoned(gpu, T * k, F, rng, "h", pad4=True), poisoned(gpu, T * k, d, rng, "ys")
    g = gpu.graph("routed_wide")
    moe_routed(g, xv, iv, wv, rw, ys, h, plan=MoEPlan(b, T, k, E, bn), coopmat=True, step=step)
    g.run()
    return read_rows(ys), [f"{op.name}: {op.kernel.name} {op.desc}" for op in g.ops[1:]]


def _fits(caps, bn: int, d: int, F: int, step: CmStep) -> bool:
    return all(cm_expert_tile(caps, bn, nb, step) is not None and (K // 32) % step.kg == 0
               for nb, K in ((2, d), (1, F)))


@pytest.mark.parametrize("path", ["device", "emulated"])
@pytest.mark.parametrize("q_gu,q_down,every", CASES, ids=lambda v: getattr(v, "name", "all" if v is True else "one"))
def test_wide_steps(gpu, rng, monkeypatch, path, q_gu, q_down, every):
    """Fused gate/up and down on the steps that fit (every: all of them, ragged T, and bit for bit the
    narrow step's result; else the widest with the wide-load decode, on one T), bn 16 or 32, vs float64."""
    label = select(path, gpu, monkeypatch)
    E, k = int(rng.choice([13, 16])), int(rng.integers(2, 5))
    d, F = 256, 128 * int(rng.integers(1, 3))  # K-quant rows; 4- and 8-group steps divide both
    ex = experts(gpu, q_gu, q_down, E, d, F, rng)
    bn = 16 if every else int(rng.choice([16, 32]))
    steps = [st for st in STEPS if _fits(gpu.caps, bn, d, F, st)]
    assert any(st.kg == 2 for st in steps), f"{gpu.caps.name} bn={bn}: {steps}"
    assert not every or any(st.kg == 4 for st in steps), f"{gpu.caps.name} bn={bn}: {steps}"
    if not every:
        steps = [max((st for st in steps if st.fast), key=lambda st: st.kg)]
    for T in (int(rng.integers(9, 40)), int(rng.integers(60, 130)))[:2 if every else 1]:
        x = rng.standard_normal((T, d), dtype=np.float32)
        ids, wts = routing(T, k, E, rng)
        want, bound = routed_reference(x, ids, wts, ex)
        limit = tol(bound, max(d, F)) + 2 * U16 * bound
        narrow = _run(gpu, rng, ex.fused, x, ids, wts, d, F, bn, NARROW)[0] if every else None
        for st in steps:
            got, ops = _run(gpu, rng, ex.fused, x, ids, wts, d, F, bn, st)
            what = f"{label} {q_gu.name}/{q_down.name} d={d} F={F} E={E} k={k} T={T} bn={bn} step {st}"
            assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} outputs not written; {ops}"
            err = np.abs(got - want)
            assert (err <= limit).all(), f"{what}: max err/bound {np.max(err / limit):.3g}; {ops}"
            assert narrow is None or np.array_equal(got, narrow), \
                f"{what}: differs from the narrow step at {np.count_nonzero(got != narrow)} elements; {ops}"


def test_knob_chooses(gpu):
    """VKFLASH_MMID_WIDE=1 picks a wide step for tiles of ≤ WIDE_MAX_BN rows on a 48 KiB device (the H200's
    limit; one whose kg divides K's groups), FAST for wider tiles; off, the narrow step everywhere."""
    caps = replace(gpu.caps, shared_memory=48 << 10, coopmat=(SHAPE_16,))
    assert GpuOptions.from_knobs(VKFLASH_MMID_WIDE="1").mmid_wide is True
    for bn in (16, WIDE_MAX_BN):
        for nb in (1, 2):
            st = cm_step(caps, bn, nb, 2048, True)
            assert st in WIDE_STEPS and st.kg > 1 and cm_expert_tile(caps, bn, nb, st) is not None
            assert cm_step(caps, bn, nb, 2048, False) == NARROW
    assert cm_step(caps, 48, 2, 2048, True) == FAST and cm_step(caps, 48, 2, 2048, False) == NARROW
    st = cm_step(caps, 16, 2, 32 * 3, True)  # 3 groups per row
    assert st in WIDE_STEPS and st.kg == 1
