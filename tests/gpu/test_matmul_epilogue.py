"""Fused matmul epilogues (scale, bias, sigmoid/silu, ⊙ tensor, + residual, in place) vs float64
NumPy, and the fused store vs the plain path of separate eltwise dispatches (bit for bit)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from matmul_util import U32, make_problem, read_view, reference, tolerance
from vkflash import settings
from vkflash.gpu.ops.matmul import Epilogue, matmul, use_coopmat
from vkflash.gpu.ops.views import Rows


@pytest.fixture
def coopmat_on(monkeypatch):
    """Cooperative-matrix GEMMs are off by default (VKFLASH_DISABLE_COOPMAT=1); these tests turn them on."""
    monkeypatch.setattr(settings, "_current", settings.load(env=dict(os.environ, VKFLASH_DISABLE_COOPMAT="0")))

pytestmark = pytest.mark.gpu

# (n_out, n_tok) per path: GEMV, transposed GEMV (tiny output), tiled GEMM
SHAPES = {"gemv": (45, 3), "tiny": (4, 21), "gemm": (77, 33)}
# two chains that together use every part; the first adds the residual in place (res = y)
CHAINS = {"scale_bias_silu_mul_res": ("silu", True), "bias_sigmoid_mul": ("sigmoid", False)}


def _setup(gpu, rng, path: str, chain: str):
    n_out, n_tok = SHAPES[path]
    p = make_problem(gpu, Q.Q4_K, n_out, 512, n_tok, rng)
    act, full = CHAINS[chain]
    bias = rng.standard_normal(n_out).astype(np.float32)
    mul = rng.standard_normal((n_tok, n_out)).astype(np.float32)
    res = rng.standard_normal((n_tok, n_out)).astype(np.float32)
    scale = float(np.float32(rng.uniform(0.1, 2.0))) if full else None
    return p, act, bias, mul, res, scale


def _views(gpu, p, bias, mul, res, full: bool) -> Epilogue:
    """The chain's views: bias and mul in their own (offset) buffers; for the full chain the
    residual is written into y's view and added in place (res = y)."""
    yv = p.yv
    yv.buf.fill(np.nan)
    bb = gpu.upload(np.concatenate([np.zeros(3, np.float32), bias]), "bias")
    mb = gpu.buffer(yv.buf.nbytes, "mul")
    for n in range(yv.n_rows):
        mb.write(mul[n], 4 * (yv.off + n * yv.stride))
        if full:
            yv.buf.write(res[n], 4 * (yv.off + n * yv.stride))
    return Rows(bb, 1, len(bias), 3), Rows(mb, yv.n_rows, yv.n_cols, yv.off, yv.stride), (yv if full else None)


def _expected(acc, bound, k, scale, bias, act, mul, res, full, f16: bool):
    """float64 epilogue of the exact product, and a bound on |gpu − expected| (propagated error)."""
    s = 1.0 if scale is None else scale
    v = s * acc + bias
    e = abs(s) * tolerance(bound, k, f16) + U32 * (np.abs(s * acc) + np.abs(bias))
    sig = 1.0 / (1.0 + np.exp(-v))
    a = sig if act == "sigmoid" else v * sig
    e = 1.1 * e + 8 * U32 * np.abs(a)  # |σ'| ≤ 1/4, |silu'| ≤ 1.1; exp to a few ulp
    out = a * mul
    e = e * np.abs(mul) + U32 * np.abs(out)
    if full:
        out = out + res
        e = e + U32 * (np.abs(out) + np.abs(res))
    return out, 2 * e


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("path", ["gemv", "tiny", "gemm", "gemm_cm"])
def test_epilogue(coopmat_on, gpu, rng, path, chain):
    cm = path == "gemm_cm"
    if cm and not use_coopmat(gpu.caps, Q.Q4_K):
        pytest.skip(f"{gpu.caps.name} offers no f16×f16→f32 cooperative matrix (or VKFLASH_DISABLE_COOPMAT=1)")
    p, act, bias, mul, res, scale = _setup(gpu, rng, path.removesuffix("_cm"), chain)
    full = CHAINS[chain][1]
    outs = []
    for fuse in (True, False):
        bv, mv, rv = _views(gpu, p, bias, mul, res, full)
        g = gpu.graph("mm_ep")
        matmul(g, p.w, p.xv, p.yv, Epilogue(scale=scale, bias=bv, act=act, mul=mv, res=rv), coopmat=cm, fuse=fuse)
        g.run()
        outs.append(read_view(p.yv))
        n_ops = 1 if fuse else 1 + (5 if full else 3)
        assert len(g.ops) == n_ops, f"fuse={fuse}: {len(g.ops)} dispatches, expected {n_ops}"
    acc, bound = reference(p)
    want, tol = _expected(acc, bound, p.w.k, scale, bias[None, :].astype(np.float64), act,
                          mul.astype(np.float64), res.astype(np.float64), full, cm)
    err = np.abs(outs[0] - want)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert (err <= tol).all(), f"{path} {chain}: worst {worst} got {outs[0][worst]} want {want[worst]} tol {tol[worst]}"
    assert np.array_equal(outs[0], outs[1]), f"{path} {chain}: fused store differs from the plain eltwise path"
