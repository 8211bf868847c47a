"""Matmul kernels vs a float64 NumPy oracle: every weight type, GEMV / transposed GEMV / GEMM
(scalar, and coopmat where the device offers it), ragged shapes, strided views, expert rows."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from matmul_util import make_problem, outside_untouched, read_view, reference, tolerance
from vkflash.gpu.device import CoopmatShape
from vkflash.gpu.ops.matmul import COOPMAT_TYPES, GEMV_MAX_COLS, TYPES, matmul, use_coopmat


@pytest.fixture
def cm_gpu(gpu):
    """The device with cooperative-matrix GEMMs on (the test session's device runs scalar f32 GEMMs)."""
    return gpu.with_options(replace(gpu.options, coopmat=True))

pytestmark = pytest.mark.gpu


def _k(q: Q, rng: np.random.Generator, lo: int, hi: int) -> int:
    """A row length of whole blocks (and 32-groups) between about lo and hi elements."""
    step = 256 if q in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS) else 32
    return step * int(rng.integers(max(1, lo // step), max(2, hi // step + 1)))


def _run(gpu, q: Q, n_out: int, k: int, n_tok: int, rng, coopmat: bool = False, expert: int = 0) -> None:
    p = make_problem(gpu, q, n_out, k, n_tok, rng, expert)
    g = gpu.graph("mm")
    matmul(g, p.w, p.xv, p.yv, coopmat=coopmat)
    g.run()
    got = read_view(p.yv)
    ref, bound = reference(p)
    err = np.abs(got - ref)
    tol = tolerance(bound, k, coopmat)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert np.isfinite(got).all(), f"{q.name} {n_out}x{k} n={n_tok}: non-finite outputs (unwritten?)"
    assert (err <= tol).all(), (f"{q.name} {n_out}x{k} n={n_tok}: worst (n,r)={worst} got {got[worst]} "
                                f"ref {ref[worst]} tol {tol[worst]}")
    assert outside_untouched(p.yv), "writes outside the output view"


@pytest.mark.parametrize("q", TYPES, ids=lambda q: q.name)
def test_gemv(gpu, rng, q):
    """Decode / MTP verify: 1..8 columns, odd row counts, K not a multiple of the workgroup span."""
    for n_tok in (1, int(rng.integers(2, GEMV_MAX_COLS + 1))):
        _run(gpu, q, int(rng.integers(1, 40)) * 2 + 1, _k(q, rng, 256, 2600), n_tok, rng)


@pytest.mark.parametrize("q", TYPES, ids=lambda q: q.name)
def test_gemm_scalar(gpu, rng, q):
    """Prefill: ragged tokens (≥ 9) and rows (not multiples of the 64×64 tile)."""
    _run(gpu, q, int(rng.integers(65, 150)), _k(q, rng, 256, 800), int(rng.integers(9, 90)), rng)


@pytest.mark.parametrize("q", [Q.F16, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_tiny_out_transposed(gpu, rng, q):
    """n_out ≤ 8 (the HC inject projection, 4 rows) runs as a GEMV over the tokens."""
    n_out = int(rng.integers(1, 9))
    _run(gpu, q, n_out, _k(q, rng, 512, 2600), int(rng.integers(9, 70)), rng)
    g = gpu.graph("probe")
    p = make_problem(gpu, q, 4, 256, 20, rng)
    matmul(g, p.w, p.xv, p.yv)
    assert g.ops[0].kernel.name.startswith("mul_mat_vec_"), "tiny output should pick the transposed GEMV"


@pytest.mark.parametrize("q", [Q.Q4_K, Q.Q5_0], ids=lambda q: q.name)
def test_expert_rows(gpu, rng, q):
    """Expert e of a stack {K, out, E} is addressed through the row base (MoE helpers build on it)."""
    e = int(rng.integers(1, 4))
    _run(gpu, q, 37, 512, int(rng.integers(1, 9)), rng, expert=e)
    _run(gpu, q, 70, 512, int(rng.integers(9, 40)), rng, expert=e)


@pytest.mark.parametrize("k", [32, 64, 96, 128, 192, 512])
def test_gemm_coopmat_small_shapes(cm_gpu, rng, k):
    """Coopmat GEMM at the small and partial-tile shapes tiny models use (n_out ≤ 64, K of one or
    two 32-groups, token counts around the 64-wide tile), which the random sweep rarely draws."""
    if not use_coopmat(cm_gpu, Q.F16):
        pytest.skip(f"{cm_gpu.caps.name} offers no f16×f16→f32 cooperative matrix")
    for n_out in (9, 16, 32, 48, 64, 96):
        for n_tok in (9, 16, 33, 64, 65):
            _run(cm_gpu, Q.F16, n_out, k, n_tok, rng, coopmat=True)


def test_coopmat_never_for_f32_weights(cm_gpu, rng):
    """On a device with f16 coopmat and the knob on, quantized and f16 weights take coopmat GEMMs,
    F32 weights (routers, gates) the scalar f32 GEMM; asking for coopmat on F32 is refused."""
    gpu = cm_gpu
    faked = gpu.with_options(gpu.options)
    faked.caps = replace(gpu.caps, coopmat=(CoopmatShape(16, 16, 16, "f16", "f16", "f32", "f32"),))
    assert use_coopmat(faked, Q.F16) and use_coopmat(faked, Q.Q4_K)
    assert not use_coopmat(faked, Q.F32)
    p = make_problem(gpu, Q.F32, 70, 64, 20, rng)
    with pytest.raises(ValueError, match="F32 weights have no cooperative-matrix GEMM"):
        matmul(gpu.graph("f32cm"), p.w, p.xv, p.yv, coopmat=True)


@pytest.mark.parametrize("q", COOPMAT_TYPES, ids=lambda q: q.name)
def test_gemm_coopmat(cm_gpu, rng, q):
    """The cooperative-matrix GEMM (f16 inputs, f32 accumulators), where the device offers it."""
    if not use_coopmat(cm_gpu, q):
        pytest.skip(f"{cm_gpu.caps.name} offers no f16×f16→f32 cooperative matrix")
    k = _k(q, rng, 256, 1600)
    k += 32 if k % 256 and k % 64 == 0 else 0  # 32-blocks: K % 64 == 32 exercises the zero-filled tail
    _run(cm_gpu, q, int(rng.integers(65, 200)), k, int(rng.integers(9, 150)), rng, coopmat=True)
