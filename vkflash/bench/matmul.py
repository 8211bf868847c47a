"""Matmul benchmarks for `vkflash bench kernels`: GEMV weight bandwidth and GEMM TFLOP/s.

Each measurement records one graph of many dispatches that rotate among several weight buffers
(at least 3, and enough to exceed any last-level cache several times over, so no rotation re-reads
a cached weight) and times many replays by wall clock (kernels.timed). Rows are
dict(name, shape, seconds, <unit>) with seconds per call and unit "GB/s" (weight bytes) or "TFLOP/s".
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.bench.kernels import timed
from vkflash.formats.quant_blocks import row_bytes
from vkflash.formats.quants import random_blocks
from vkflash.gpu.context import Gpu
from vkflash.gpu.ops.matmul import QWeight, matmul, use_coopmat
from vkflash.gpu.ops.views import Rows

GEMV_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.F16)
DENSE = (2560, 12288)  # Flash-Next dense projection {in, out}: 9–18 MB at 4–6 bits
LM_HEAD = (2560, 248320)  # the Q6_K LM head
ROTATE_BYTES = 400 << 20  # weight bytes one rotation touches at least (H200 L2 is 50 MB)
CALLS = 48  # dispatches per recorded graph


def _weights(gpu: Gpu, q: Q, k: int, n_out: int, n_bufs: int, rng: np.random.Generator) -> list[QWeight]:
    """n_bufs buffers holding the same random valid weight (content does not change the speed)."""
    raw = random_blocks(q, k * n_out, rng)
    return [QWeight(gpu.upload(raw, f"bench.w{i}"), int(q), k, n_out) for i in range(n_bufs)]


def _rotation(nbytes: int, quick: bool) -> int:
    return 3 if quick else max(3, min(32, -(-ROTATE_BYTES // nbytes)))


def gemv_bandwidth(gpu: Gpu, shapes: Iterable[tuple[Q, int, int]] | None = None, n_tok: int = 1,
                   quick: bool = False) -> list[dict]:
    """Weight bytes per second of the decode GEMV for each (type, in, out).

    Defaults: every GEMV_TYPES at the dense Flash-Next shape, and the Q6_K LM head.
    """
    rng = np.random.default_rng()
    if shapes is None:
        shapes = [(q, 256, 512) if quick else (q, *DENSE) for q in GEMV_TYPES]
        shapes.append((Q.Q6_K, 256, 1024) if quick else (Q.Q6_K, *LM_HEAD))
    rows = []
    for q, k, n_out in shapes:
        nbytes = n_out * row_bytes(q, k)
        ws = _weights(gpu, q, k, n_out, _rotation(nbytes, quick), rng)
        x = gpu.upload(rng.standard_normal(n_tok * k, dtype=np.float32), "bench.x")
        calls = len(ws) if quick else max(CALLS, len(ws))
        g = gpu.graph(f"bench.gemv.{q.name}")
        for i in range(calls):  # distinct outputs: no barriers between the calls
            y = gpu.buffer(4 * n_tok * n_out, f"bench.y{i}")
            matmul(g, ws[i % len(ws)], Rows(x, n_tok, k), Rows(y, n_tok, n_out), name=f"gemv{i}")
        s = timed(g, 2 if quick else 20) / calls
        rows.append({"name": f"gemv {q.name.lower()}", "shape": f"{k}x{n_out} n={n_tok}", "seconds": s,
                     "GB/s": nbytes / s / 1e9})
    return rows


def gemm_tflops(gpu: Gpu, size: int | None = None, n_tok: int | None = None, qtype: Q = Q.F16,
                quick: bool = False) -> list[dict]:
    """TFLOP/s of the prefill GEMM (coopmat when the device offers it, else scalar) at size³."""
    rng = np.random.default_rng()
    size = size or (128 if quick else 4096)
    n_tok = n_tok or size
    nbytes = size * row_bytes(qtype, size)
    ws = _weights(gpu, qtype, size, size, 3, rng)
    x = gpu.upload(rng.standard_normal(n_tok * size, dtype=np.float32), "bench.x")
    cm = use_coopmat(gpu, qtype)
    g = gpu.graph("bench.gemm")
    calls = 3 if quick else 12
    ys = [gpu.buffer(4 * n_tok * size, f"bench.y{i}") for i in range(3)]
    for i in range(calls):
        matmul(g, ws[i % 3], Rows(x, n_tok, size), Rows(ys[i % 3], n_tok, size), name=f"gemm{i}")
    s = timed(g, 1 if quick else 5) / calls
    kind = "coopmat" if cm else "scalar"
    return [{"name": f"gemm {qtype.name.lower()} {kind}", "shape": f"{size}x{size} n={n_tok}", "seconds": s,
             "TFLOP/s": 2.0 * size * size * n_tok / s / 1e12, "weight_bytes": nbytes}]
