"""Shared helpers of the matmul tests: random GGML weights with per-block scales, float64 oracle, bounds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.formats.quant_blocks import BLOCK, SCALE_FIELDS
from vkflash.formats.quants import dequantize, random_blocks
from vkflash.gpu.ops.matmul import QWeight
from vkflash.gpu.ops.views import Rows

U32 = 2.0**-24  # unit roundoff of f32
U16 = 2.0**-11  # unit roundoff of f16 (coopmat inputs)


def random_weight(q: Q, n_out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes of an {k, n_out} weight: random codes, and f16 scale fields that differ per block.

    random_blocks gives every block the same scales; a kernel that read the wrong block's scale
    would pass on those, so each scale field is multiplied by its own factor in [1/4, 1].
    """
    raw = random_blocks(q, n_out * k, rng).copy()
    if q in SCALE_FIELDS:
        blocks = raw.reshape(-1, BLOCK[q][1])
        for off in SCALE_FIELDS[q]:
            f = blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32)
            f *= rng.uniform(0.25, 1.0, size=f.shape).astype(np.float32)
            blocks[:, off:off + 2] = f.astype(np.float16).view(np.uint8)
    return raw


def dequant_rows(raw: np.ndarray, q: Q, n_out: int, k: int) -> np.ndarray:
    """W ∈ R^{n_out×k} in float64 from the raw bytes (the NumPy oracle of the shader decoders)."""
    return dequantize(raw, q, n_out * k).reshape(n_out, k).astype(np.float64)


@dataclass
class Problem:
    """One matmul on the GPU: W (raw + float64), x, and the views the kernel reads and writes."""

    w: QWeight
    wd: np.ndarray  # float64 W
    x: np.ndarray  # (n_tok, k) float32
    xv: Rows
    yv: Rows


def make_problem(gpu, q: Q, n_out: int, k: int, n_tok: int, rng: np.random.Generator, expert: int = 0) -> Problem:
    """Upload a random weight (as expert `expert` of a stack of expert+1) and a strided, offset x;
    y is a strided, offset view of a NaN-poisoned buffer."""
    raw = random_weight(q, (expert + 1) * n_out, k, rng)
    wd = dequant_rows(raw, q, (expert + 1) * n_out, k)[expert * n_out:]
    w = QWeight(gpu.upload(raw, "w"), int(q), k, n_out, row0=expert * n_out)
    x = rng.standard_normal((n_tok, k), dtype=np.float32)
    x_off, x_stride = 4 * int(rng.integers(0, 3)), k + 4 * int(rng.integers(0, 3))
    xb = np.zeros(x_off + n_tok * x_stride, np.float32)
    for n in range(n_tok):
        xb[x_off + n * x_stride:x_off + n * x_stride + k] = x[n]
    y_off, y_stride = int(rng.integers(0, 5)), n_out + int(rng.integers(0, 5))
    yb = gpu.buffer(4 * (y_off + n_tok * y_stride + 3), "y")
    yb.fill(np.nan)
    return Problem(w, wd, x, Rows(gpu.upload(xb, "x"), n_tok, k, x_off, x_stride), Rows(yb, n_tok, n_out, y_off, y_stride))


def read_view(v: Rows) -> np.ndarray:
    """The view's elements as (n_rows, n_cols) float64."""
    a = v.buf.read(np.float32)
    return np.stack([a[v.off + i * v.stride:v.off + i * v.stride + v.n_cols] for i in range(v.n_rows)]).astype(np.float64)


def outside_untouched(v: Rows) -> bool:
    """Every element of the buffer outside the view is still the NaN poison (no stray writes)."""
    a = v.buf.read(np.float32)
    mask = np.ones(a.size, bool)
    for i in range(v.n_rows):
        mask[v.off + i * v.stride:v.off + i * v.stride + v.n_cols] = False
    return bool(np.isnan(a[mask]).all())


def reference(p: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(y = x Wᵀ, Σ_k |W[r, k]||x[n, k]|) in float64, both (n_tok, n_out)."""
    x = p.x.astype(np.float64)
    return x @ p.wd.T, np.abs(x) @ np.abs(p.wd).T


def tolerance(bound: np.ndarray, k: int, f16_inputs: bool) -> np.ndarray:
    """Per-output bound on |gpu − ref|: f32 accumulation of k products is within γ_{k+64}·Σ|W||x|
    (64 covers the decode rounding and the reduction tree); f16 inputs add 2·u16 per product.
    A dropped 32-element group moves y by ~√32/k of Σ|W||x| — far above either bound."""
    rel = 2 * (k + 64) * U32 + (2 * U16 if f16_inputs else 0.0)
    return rel * bound + 1e-30


def q8_steps(x: np.ndarray) -> np.ndarray:
    """d of every element's 32-block when x (…, k) is quantized to 8 bits as llama.cpp does (amax/127), in f32."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    return np.broadcast_to(d, blocks.shape).reshape(x.shape)


def q8_tolerance(p: Problem) -> np.ndarray:
    """Bound on |gpu − x Wᵀ| for the integer-dot GEMV: the activation rounding Σ_k |W[r,k]|·d_b(k)/2
    (x_q = roundf(x/d), so |x − d·x_q| ≤ d/2; 1e-3 relative slack for the f32 1/d), plus the f32
    bound on the products with the rounded x (|d·x_q| ≤ |x| + d/2)."""
    d = q8_steps(p.x).astype(np.float64)
    aw = np.abs(p.wd)
    half = (d / 2) @ aw.T
    return half * (1 + 1e-3) + tolerance((np.abs(p.x) + d / 2) @ aw.T, p.x.shape[1], False)


def q8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x_q, d per element) as ggml's quantize_row_q8_0/q8_1 compute them in f32: d = amax/127,
    x_q = roundf(x·(1/d)) (half away from zero; 0 where d = 0)."""
    x = x.astype(np.float32)
    d = q8_steps(x)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = (x * inv).astype(np.float32)
    a = np.abs(v)
    f = np.floor(a)
    q = np.sign(v) * (f + np.floor(2 * (a - f)))
    return q.astype(np.float32), d
