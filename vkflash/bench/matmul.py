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
from vkflash.gpu.ops.matmul import CM_TILES, CmTile, QWeight, cm_shape, cm_tile, coopmat_possible, matmul
from vkflash.gpu.ops.views import Rows

GEMV_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.F16)
DENSE = (2560, 12288)  # Flash-Next dense projection {in, out}: 9–18 MB at 4–6 bits
LM_HEAD = (2560, 248320)  # the Q6_K LM head
ROTATE_BYTES = 400 << 20  # weight bytes one rotation touches at least (H200 L2 is 50 MB)
CALLS = 48  # dispatches per recorded graph
GEMMS = ((Q.F16, 4096, 4096, 4096), (Q.Q4_K, 2560, 12288, 2048))
"""Prefill GEMMs (type, K, n_out, n_tok): f16 4096³, and a Q4_K dense Flash-Next projection over a
2048-token ubatch (the issue's goals: ≥ 150 and ≥ 100 TFLOP/s on the H200)."""
GEMMS_QUICK = ((Q.F16, 128, 128, 128), (Q.Q4_K, 256, 192, 80))


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


def gemm_tflops(gpu: Gpu, shapes: Iterable[tuple[Q, int, int, int]] | None = None, quick: bool = False,
                tiles: bool = True) -> list[dict]:
    """TFLOP/s of the prefill GEMM for each (type, K, n_out, n_tok) (default GEMMS): the scalar f32
    GEMM, and where the device offers coopmat the coopmat GEMM at the tile cm_tile picks and (tiles)
    at every other tile that fits (named with the tile; the default one is marked)."""
    rng = np.random.default_rng()
    rows = []
    for q, k, n_out, n_tok in shapes or (GEMMS_QUICK if quick else GEMMS):
        nbytes = n_out * row_bytes(q, k)
        ws = _weights(gpu, q, k, n_out, _rotation(nbytes, quick), rng)
        x = gpu.upload(rng.standard_normal(n_tok * k, dtype=np.float32), "bench.x")
        ys = [gpu.buffer(4 * n_tok * n_out, f"bench.y{i}") for i in range(3)]
        variants: list[tuple[str, CmTile | None]] = [("scalar", None)]
        shape = cm_shape(gpu.caps)
        best = cm_tile(gpu.caps, n_out, n_tok)
        if coopmat_possible(gpu.caps, q) and best is not None:
            others = [t for t in CM_TILES if t != best and t.valid(shape) and t.smem(shape.n) <= gpu.caps.shared_memory]
            variants += [(f"coopmat {best} (default)", best)] + ([(f"coopmat {t}", t) for t in others] if tiles else [])
        calls = max(3 if quick else 12, len(ws))
        for label, tile in variants:
            g = gpu.graph("bench.gemm")
            for i in range(calls):
                matmul(g, ws[i % len(ws)], Rows(x, n_tok, k), Rows(ys[i % 3], n_tok, n_out), name=f"gemm{i}",
                       coopmat=tile is not None, tile=tile)
            s = timed(g, 1 if quick else 5) / calls
            rows.append({"name": f"gemm {q.name.lower()} {label}", "shape": f"{k}x{n_out} n={n_tok}", "seconds": s,
                         "TFLOP/s": 2.0 * k * n_out * n_tok / s / 1e12, "weight_bytes": nbytes})
    return rows
