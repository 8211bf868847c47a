"""Fused matmul epilogues (scale, bias, sigmoid/silu, ⊙ tensor, + residual, in place) vs float64
NumPy, the fused store vs the plain path of separate eltwise dispatches (bit for bit), and the
fusion pass folding those eltwise ops into the matmul (Fusion.EPILOGUE)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from matmul_util import U32, make_problem, read_view, reference, tolerance
from vkflash.gpu.graph import ROW_ALIGN, Graph
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.matmul import Epilogue, matmul, use_coopmat
from vkflash.gpu.ops.views import Rows
from vkflash.gpu.options import Fusion, GpuOptions

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


def _reduces(g: Graph) -> int:
    """Split-K reduce passes of the graph's matmul (a GPU with many cores splits a short K loop;
    the epilogue then runs in the reduce)."""
    return sum(" reduce " in op.desc for op in g.ops)


def _options(cm: bool, fused: bool) -> GpuOptions:
    """Coopmat as the path asks, the epilogue fused or not."""
    opts = GpuOptions(coopmat=cm)
    return opts if fused else opts.without(Fusion.EPILOGUE)


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("path", ["gemv", "tiny", "gemm", "gemm_cm"])
def test_epilogue(gpu, rng, path, chain):
    """An explicit epilogue: one dispatch, or with Fusion.EPILOGUE off the matmul and eltwise ops."""
    cm = path == "gemm_cm"
    if cm and not use_coopmat(gpu.with_options(GpuOptions(coopmat=True)), Q.Q4_K):
        pytest.skip(f"{gpu.caps.name} offers no f16×f16→f32 cooperative matrix")
    p, act, bias, mul, res, scale = _setup(gpu, rng, path.removesuffix("_cm"), chain)
    full = CHAINS[chain][1]
    outs = []
    for fuse in (True, False):
        bv, mv, rv = _views(gpu, p, bias, mul, res, full)
        g = Graph(gpu, "mm_ep", options=_options(cm, fuse))
        matmul(g, p.w, p.xv, p.yv, Epilogue(scale=scale, bias=bv, act=act, mul=mv, res=rv), coopmat=cm)
        g.run()
        outs.append(read_view(p.yv))
        n_ops = 1 + _reduces(g) + (0 if fuse else 5 if full else 3)
        assert len(g.ops) == n_ops, f"fuse={fuse}: {len(g.ops)} dispatches, expected {n_ops}"
    acc, bound = reference(p)
    want, tol = _expected(acc, bound, p.w.k, scale, bias[None, :].astype(np.float64), act,
                          mul.astype(np.float64), res.astype(np.float64), full, cm)
    err = np.abs(outs[0] - want)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert (err <= tol).all(), f"{path} {chain}: worst {worst} got {outs[0][worst]} want {want[worst]} tol {tol[worst]}"
    assert np.array_equal(outs[0], outs[1]), f"{path} {chain}: fused store differs from the plain eltwise path"


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("path", ["gemv", "tiny", "gemm"])
def test_epilogue_pass(gpu, rng, path, chain):
    """Fusion.EPILOGUE: a matmul into an intermediate t, then scale t, t + bias, act(t), t ⊙ m and
    (full chain) y + t into the residual y — one dispatch storing into y, bit for bit the five or
    six plain dispatches (m and y strided like t: an epilogue operand shares the store's stride)."""
    p, act, bias, mul, res, scale = _setup(gpu, rng, path, chain)
    full = CHAINS[chain][1]
    n_tok, n_out = mul.shape
    stride = -(-n_out // ROW_ALIGN) * ROW_ALIGN

    def strided(a: np.ndarray, name: str) -> Rows:
        buf = np.full((n_tok, stride), np.nan, np.float32)
        buf[:, :n_out] = a
        return Rows(gpu.upload(buf, name), n_tok, n_out, 0, stride)

    outs = []
    for fuse in (True, False):
        bv = Rows(gpu.upload(bias, "bias"), 1, n_out)
        m, y = strided(mul, "m"), strided(res if full else np.full_like(res, np.nan), "y")
        g = Graph(gpu, "mm_pass", options=_options(False, fuse))
        t = g.tensor(n_tok, n_out, "t")
        matmul(g, p.w, p.xv, t, name="mm")
        if scale is not None:
            E.scale(g, t, scale, t, name="scale")
        E.add(g, t, bv, t, name="bias")
        (E.silu if act == "silu" else E.sigmoid)(g, t, t, name="act")
        E.mul(g, t, m, t if full else y, name="mul")
        if full:
            E.add(g, y, t, y, name="res")
        g.run()
        outs.append(read_view(y))
        plain = 4 + (scale is not None) + full
        assert len(g.ops) == _reduces(g) + (1 if fuse else plain), f"fuse={fuse}: {len(g.ops)} dispatches"
    assert np.array_equal(outs[0], outs[1]), f"{path} {chain}: the pass changed the result"
    acc, bound = reference(p)
    want, tol = _expected(acc, bound, p.w.k, scale, bias[None, :].astype(np.float64), act,
                          mul.astype(np.float64), res.astype(np.float64), full, False)
    assert (np.abs(outs[0] - want) <= tol).all(), f"{path} {chain}: max err {np.abs(outs[0] - want).max():.3g}"
