"""Split-K of the tiled GEMMs (mul_mat.comp, mul_mat_cm.comp with grid z = S, then mm_reduce.comp)
and the transposed GEMV's tokens per workgroup, vs float64 and vs the unsplit kernels.

Paths: "scalar" (f32 GEMM), and the coopmat GEMM on the "device" or "emulated" (cm_util).

Bounds. Split-K sums the same products (f16-rounded on coopmat, exactly as unsplit) in another
order: S chunk sums, each in the kernel's own order, then added in order s = 0, 1, … So split and
unsplit both lie within the f32 accumulation bound 2(K+64)·u32·Σ|W||x| of the exact sum of those
products, and |split − unsplit| within twice that — no f16 term, even on coopmat. A dropped,
doubled or misplaced chunk moves an output by ~√(K/S)/K of Σ|W||x|, far above it. The epilogue
runs in the reduce pass with common/mm.glsl's store: bit for bit the plain path's eltwise ops.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cm_util import PATHS, select
from matmul_util import U32, make_problem, outside_untouched, read_view, reference, tolerance
from test_matmul_cm import _check, _epilogue, _epilogue_oracle, _reset_y
from vkflash.gpu.graph import Graph
from vkflash.gpu.ops.matmul import (SPLIT_MIN_STEPS, TINY_TOKENS, Epilogue, QWeight, cm_tile, matmul, split_chunks,
                                    split_k, tiny_tokens)
from vkflash.gpu.ops.views import Rows
from vkflash.gpu.options import Fusion

pytestmark = pytest.mark.gpu

ALL = dict(scale=True, bias=True, act="silu", mul=True, res="y")  # every epilogue part, the residual in place


def _run(gpu, p, coopmat: bool, split: int, ep: Epilogue | None = None, fuse: bool = True) -> tuple[np.ndarray, str]:
    g = Graph(gpu, "mm_splitk", options=gpu.options if fuse else gpu.options.without(Fusion.EPILOGUE))
    matmul(g, p.w, p.xv, p.yv, ep or Epilogue(), coopmat=coopmat, split=split)
    g.run()
    return read_view(p.yv), " | ".join(op.desc for op in g.ops)


@pytest.mark.parametrize("path", ("scalar",) + PATHS)
def test_split_vs_unsplit(gpu, rng, monkeypatch, path):
    """A ragged GEMM (rows and tokens off the tile, K an odd number of 32-groups that the chunk does
    not divide) split into S chunks: vs float64, vs the unsplit kernel within the f32 reorder bound,
    nothing written outside y; then every epilogue part (residual in place) in the reduce pass vs the
    float64 epilogue and, bit for bit, vs the plain path's separate eltwise ops."""
    cm = path != "scalar"
    label = select(path, gpu, monkeypatch) if cm else "scalar"
    q = Q.Q4_K if rng.integers(2) else Q.Q5_0
    gpr = int(rng.integers(5, 12)) * (8 if q == Q.Q4_K else 2) + (0 if q == Q.Q4_K else 1)
    k, n_split = 32 * gpr, int(rng.integers(2, 6))
    while gpr % split_chunks(k, n_split)[1] == 0:  # a short last chunk
        n_split += 1
    n_out, n_tok = int(rng.integers(65, 200)), int(rng.integers(9, 150))
    p = make_problem(gpu, q, n_out, k, n_tok, rng)
    unsplit, _ = _run(gpu, p, cm, 1)
    p.yv.buf.fill(np.nan)
    got, desc = _run(gpu, p, cm, n_split)
    what = f"{label} {desc} ({q.name} n_out={n_out} K={k} n_tok={n_tok})"
    assert f"split={split_chunks(k, n_split)[0]}x" in desc and "reduce" in desc, what
    assert outside_untouched(p.yv), f"{what}: writes outside the output view"
    ref, bound = reference(p)
    _check(what + " vs float64", got, ref, tolerance(bound, k, cm))
    _check(what + " vs unsplit", got, unsplit, 2 * tolerance(bound, k, False))
    assert not np.array_equal(got, unsplit), f"{what}: split equals unsplit bit for bit (not split?)"

    e, vals = _epilogue(gpu, p, rng, ALL)
    fused, desc = _run(gpu, p, cm, n_split, e)
    _reset_y(p.yv, vals, ALL)
    plain, _ = _run(gpu, p, cm, n_split, e, fuse=False)
    want, tol = _epilogue_oracle(ref, tolerance(bound, k, cm), vals, "silu")
    _check(f"{label} {desc} epilogue", fused, want, tol)
    assert np.array_equal(fused, plain), (f"{label} {desc}: the reduce pass's epilogue differs from the eltwise "
                                          f"path at {np.count_nonzero(fused != plain)} elements")


def test_split_choice(gpu):
    """split_k: the HC down projection at 512 tokens (a 3×4 grid of 128×128 tiles, K = 10240) splits
    into chunks of whole 32-groups, none empty, about 2 workgroups per SM on a 132-SM device; a full
    grid, the knob off and CPU drivers stay unsplit."""
    from cm_util import SHAPE_16

    h200 = replace(gpu.caps, coopmat=(SHAPE_16,), shared_memory=48 << 10, subgroup_size=32, subgroup_min=32,
                   subgroup_max=32, device_type="discrete", compute_units=132)
    tile = cm_tile(h200, 320, 512)
    groups = -(-320 // tile.bm) * -(-512 // tile.bn)
    s, c = split_k(h200, groups, 10240)
    assert groups == 12 and 2 * 132 <= s * groups < 2 * 132 + 2 * groups and c >= SPLIT_MIN_STEPS, (s, c)
    assert (s - 1) * c < 320 <= s * c, (s, c)
    assert split_k(h200, 132, 10240) == (1, 320)
    assert split_k(h200, 12, 10240, on=False) == (1, 320)
    assert split_k(h200, 12, 256) == (1, 8)  # one chunk of SPLIT_MIN_STEPS at most
    assert split_k(replace(h200, device_type="cpu", compute_units=0), 1, 10240) == (1, 320)
    for gpr in (1, 7, 40, 320):
        for want in (1, 2, 3, 7, 400):
            s, c = split_chunks(32 * gpr, want)
            assert (s - 1) * c < gpr <= s * c and s <= max(1, min(want, gpr)), (gpr, want, s, c)


def test_transposed_tokens(gpu, rng):
    """The transposed GEMV (n_out ≤ 8, the HC inject) at fewer tokens per workgroup (VKFLASH_MM_SPLITK)
    equals the 8-token one bit for bit (each token's sums are the same) and float64 within the f32 bound."""
    assert tiny_tokens(2048) == 4 and tiny_tokens(512) == 1 and tiny_tokens(8192) == TINY_TOKENS
    assert tiny_tokens(512, on=False) == TINY_TOKENS
    n_out, k, n_tok = 4, 32 * int(rng.integers(4, 40)), int(rng.integers(9, 60))  # hc = 4 streams: the inject
    raw = rng.standard_normal((n_out, k), dtype=np.float32)
    w = QWeight(gpu.upload(raw, "w_inj"), int(Q.F32), k, n_out)
    x = rng.standard_normal((n_tok, k), dtype=np.float32)
    xv = Rows(gpu.upload(x, "x"), n_tok, k)
    outs = []
    for on in (True, False):
        y = gpu.buffer(4 * n_tok * n_out, "y")
        y.fill(np.nan)
        g = Graph(gpu, "tr", options=replace(gpu.options, mm_splitk=on))
        matmul(g, w, xv, Rows(y, n_tok, n_out))
        g.run()
        outs.append(y.read(np.float32).reshape(n_tok, n_out).astype(np.float64))
    ref = x.astype(np.float64) @ raw.T.astype(np.float64)
    bound = 2 * (k + 64) * U32 * (np.abs(x).astype(np.float64) @ np.abs(raw).T.astype(np.float64))
    assert np.all(np.abs(outs[0] - ref) <= bound), f"n_out={n_out} K={k} n_tok={n_tok}: outside the f32 bound"
    assert np.array_equal(outs[0], outs[1]), f"n_out={n_out} K={k} n_tok={n_tok}: token blocking changed results"
