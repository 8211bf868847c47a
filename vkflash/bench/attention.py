"""Decode attention benchmark for `vkflash bench kernels`: K/V bytes per second of the decode kernel
(ops/attn_decode.py) and of the flash path it replaces (VKFLASH_ATTN_DECODE=0), one query.

Shapes: qwen4exp attention (H 24 / H_kv 2, Dh 256), dense over 32k, 64k and 128k keys, and the QSA
decode gather of W = 2051 cells from a 128k cache. Each graph holds CALLS calls that rotate among
cache sets (dense) or cell lists (gathered) touching well over the last-level cache, with distinct
outputs and partials, so calls do not wait on each other. Rows are dict(name, shape, seconds,
GB/s) with seconds per call (attention + combine) and GB/s = K/V bytes read ÷ seconds.
"""

from __future__ import annotations

import numpy as np

from vkflash.bench.kernels import timed
from vkflash.formats.quants import random_blocks
from vkflash.gpu.context import Gpu
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.attention import Cache, CacheType, CellList, Heads, decode_splits, flash_attention, partial_bytes
from vkflash.gpu.ops.attn_decode import attn_decode, decode_partial_bytes
from vkflash.gpu.ops.views import Rows

H, H_KV, DH = 24, 2, 256
CONTEXTS = (32768, 65536, 131072)
QSA_CELLS = 2051  # W = B + r − 1 of qwen4exp's QSA layers
TYPES = (CacheType.F16, CacheType.Q8_0)
ROTATE_BYTES = 400 << 20  # K/V bytes one rotation reads at least (H200 L2 is 50 MB)
CALLS = 24
PATTERN = 4096  # positions of random rows repeated to fill a cache (contents do not change speed)


def _cache_bytes(ctype: CacheType, n_ctx: int) -> np.ndarray:
    """Bytes of a [n_ctx, H_KV, DH] cache of `ctype` holding repeated random rows."""
    raw = random_blocks(ctype.qtype, min(n_ctx, PATTERN) * H_KV * DH, np.random.default_rng())
    return np.resize(raw, Cache.nbytes(n_ctx, H_KV, DH, ctype))


def _caches(gpu: Gpu, ctype: CacheType, n_ctx: int, n_sets: int) -> list[tuple[Cache, Cache]]:
    """n_sets (K, V) cache pairs, all holding the same random rows."""
    raw = _cache_bytes(ctype, n_ctx)

    def cache(name: str) -> Cache:
        return Cache(gpu.upload(raw, name), n_ctx, H_KV, DH, ctype)

    return [(cache(f"bench.K{i}"), cache(f"bench.V{i}")) for i in range(n_sets)]


def _seconds(gpu: Gpu, flash: bool, params: Buffer, caches: list[tuple[Cache, Cache]],
             lists: list[CellList | None], quick: bool) -> float:
    """Seconds per call of a graph of one call per entry of `lists` (its cell list, or None for dense)
    rotating among `caches`: the decode kernel with its planned splits, or the flash path with the
    engine's flash-decode split count."""
    rng = np.random.default_rng()
    qh = Heads(Rows(gpu.upload(rng.standard_normal(H * DH, dtype=np.float32), "bench.q"), 1, H * DH), H, DH)
    k0 = caches[0][0]
    n_keys = lists[0].capacity if lists[0] is not None else k0.n_ctx
    n_split = decode_splits(k0.n_ctx)
    nbytes = (partial_bytes(1, H, DH, n_split) if flash
              else decode_partial_bytes(gpu.caps, 1, H, H_KV, DH, k0.type, n_keys))
    g = gpu.graph("bench.attn")
    for i, cells in enumerate(lists):  # distinct outputs and partials: no barriers between the calls
        k, v = caches[i % len(caches)]
        out = Heads(Rows(gpu.buffer(4 * H * DH, f"bench.o{i}"), 1, H * DH), H, DH)
        part = gpu.buffer(nbytes, f"bench.part{i}")
        if flash:
            flash_attention(g, params, 0, qh, k, v, out, cells=cells, n_split=n_split, partial=part, name=f"flash{i}")
        else:
            attn_decode(g, params, 0, qh, k, v, out, cells=cells, partial=part, name=f"decode{i}")
    return timed(g, 2 if quick else 20) / len(lists)


def decode_bandwidth(gpu: Gpu, quick: bool = False) -> list[dict]:
    """K/V GB/s of one decode query, decode kernel vs flash path, dense and QSA-gathered."""
    rng = np.random.default_rng()
    contexts = (1024,) if quick else CONTEXTS
    n_cells, gather_ctx = (64, 1024) if quick else (QSA_CELLS, CONTEXTS[-1])
    calls = 3 if quick else CALLS
    rows = []
    for ctype in TYPES:
        cases: list[tuple[str, int, int | None]] = [(f"ctx={n}", n, None) for n in contexts]
        cases.append((f"cells={n_cells}/{gather_ctx}", gather_ctx, n_cells))
        for label, n_ctx, cells_n in cases:
            n_keys = cells_n or n_ctx
            kv_bytes = 2 * n_keys * H_KV * ctype.row_bytes(DH)
            n_sets = 1 if cells_n else (3 if quick else max(3, min(16, -(-ROTATE_BYTES // kv_bytes))))
            caches = _caches(gpu, ctype, n_ctx, n_sets)
            lists = [CellList(gpu.upload(np.sort(rng.choice(n_ctx, n_keys, replace=False)).astype(np.uint32),
                                         f"bench.cells{i}"), n_keys) if cells_n else None for i in range(calls)]
            params = gpu.upload(np.array([n_ctx - 1, n_keys], np.int32), "bench.params")
            for path in ("decode", "flash"):
                s = _seconds(gpu, path == "flash", params, caches, lists, quick)
                rows.append({"name": f"attn {path} {ctype.value}", "shape": f"{label} H={H}/{H_KV} Dh={DH} T=1",
                             "seconds": s, "GB/s": kv_bytes / s / 1e9})
    return rows
