"""Prefill attention benchmarks for `vkflash bench kernels`: flash-attention prefill TFLOP/s, scalar
vs cooperative matrix, and the QSA prefill attention of one ubatch at depth: each query through its own
cell list (the default: the decode kernel, and the coopmat kernel in every LIST_SHAPES shape that fits),
per-tile unions (old: one dispatch per query tile; new: every tile in one dispatch) and masked dense
(GP=0).

Dense rows: T queries at the end of an n-key f16 / q8_0 cache (Flash-Next 24/2 and Qwen3-Next 16/2
heads of 256), FLOP/s counted over the keys each query sees (4·H·Dh per query-key pair). QSA rows:
Flash-Next's selection (B = 2048 cells in blocks of r = 4, plus the tail) for T queries at depth n;
neighbouring queries share most blocks as a real model's do (each query keeps its predecessor's
blocks but for 4%, replaced at random: the union of 128 neighbours then covers ~40% of a 32k cache,
as reported for the real model: 30–50%), the per-tile union built by qsa_union as the engine does; FLOP/s count only
the selected cells (the useful work). Rows are dict(name, shape, seconds, "TFLOP/s") like
vkflash/bench/matmul.py, with seconds per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkflash.bench.kernels import gpu_seconds
from vkflash.gpu.context import Gpu
from vkflash.gpu.graph import Graph
from vkflash.gpu.ops.attention import (CM_SHAPES, LIST_SHAPES, SG_SHAPES, Cache, CacheType, CellList, CellMask,
                                       CmTiles, Flash, Heads, SgTiles, cm_fits, cm_tiles, coopmat_flash_possible,
                                       flash_attention, list_fits, partial_bytes, rows_flash_possible, sg_fits,
                                       sg_tiles)
from vkflash.gpu.ops.attn_decode import attn_decode
from vkflash.gpu.ops.qsa import qsa_union
from vkflash.gpu.ops.views import Rows

GATHER_TILE = 64  # queries per union tile, as the engine's hybrid.GATHER_TILE
DRIFT = 0.043  # share of a query's blocks not kept from its predecessor


@dataclass(frozen=True)
class Shape:
    """One attention benchmark: T queries ending at depth n, H/H_kv heads of Dh; QSA budget B, block r."""

    T: int
    n: int
    H: int
    H_kv: int
    Dh: int = 256
    B: int = 2048
    r: int = 4

    def __str__(self) -> str:
        return f"T={self.T} n={self.n} H={self.H}/{self.H_kv} Dh={self.Dh}"


FULL = (Shape(512, 32768 + 512, 16, 2), Shape(512, 32768 + 512, 24, 2))
QUICK = (Shape(96, 512, 8, 2, Dh=64, B=128),)  # lavapipe: small, two union tiles, sparse beyond W = 131


def _seconds(g: Graph, quick: bool) -> float:
    """Median GPU seconds of a few replays of a built graph."""
    return float(np.median(gpu_seconds(g, 1 if quick else 5)))


def _coopmat(gpu: Gpu, dim: int) -> bool:
    """Whether prefill attention runs on the coopmat kernel here (device and VKFLASH_FA_COOPMAT)."""
    return gpu.options.fa_coopmat and coopmat_flash_possible(gpu.caps, dim)


def _rows(gpu: Gpu, dim: int) -> bool:
    """Whether the subgroup-rows coopmat kernel can run here (device and VKFLASH_FA_COOPMAT)."""
    return gpu.options.fa_coopmat and rows_flash_possible(gpu.caps, dim)


def _default(gpu: Gpu, dim: int) -> Flash:
    """The kernel prefill attention runs on here (attention.flash_kind's choice for f16 caches)."""
    if _rows(gpu, dim) and gpu.options.fa_rows:
        return Flash.ROWS
    return Flash.COOPMAT if _coopmat(gpu, dim) else Flash.SCALAR


def _setup(gpu: Gpu, s: Shape, ctype: CacheType, rng: np.random.Generator) -> tuple:
    """(params [p0, n], q heads, K, V, out heads) with random contents (they do not change the speed)."""
    def cache(name: str) -> Cache:
        c = Cache(gpu.buffer(Cache.nbytes(s.n, s.H_kv, s.Dh, ctype), name), s.n, s.H_kv, s.Dh, ctype)
        if ctype is CacheType.Q8_0:  # valid blocks: f16 scale 1/64, random codes
            raw = rng.integers(-127, 128, (c.buf.nbytes // 34, 34)).astype(np.int8).view(np.uint8)
            raw[:, :2] = np.frombuffer(np.float16(1 / 64).tobytes(), np.uint8)
            c.buf.write(raw.reshape(-1))
        else:
            c.buf.write(rng.standard_normal(c.buf.nbytes // 2).astype(np.float16).view(np.uint8))
        return c

    params = gpu.upload(np.array([s.n - s.T, s.n], np.int32), "bench.params")
    q = Heads(Rows(gpu.upload(rng.standard_normal((s.T, s.H * s.Dh)).astype(np.float32), "bench.q"), s.T,
                   s.H * s.Dh), s.H, s.Dh)
    out = Heads(Rows(gpu.buffer(4 * s.T * s.H * s.Dh, "bench.o"), s.T, s.H * s.Dh), s.H, s.Dh)
    return params, q, cache("bench.K"), cache("bench.V"), out


def prefill_tflops(gpu: Gpu, quick: bool = False) -> list[dict]:
    """TFLOP/s of dense causal prefill attention: scalar f16; where the device runs each coopmat
    kernel (split head dim: coopmat, shapes BRxBC/parts; subgroup rows: rows, shapes BRxBC), its
    default shape on f16 and q8_0 with the keys whole and in 2 splits + combine (more workgroups: 512
    queries of GQA 8 make only 128 of 64 rows), and every other shape that fits on f16, to choose the
    defaults from (attention.ROWS_DIMS, ROWS_SPLITS, CM_SHAPES, SG_SHAPES)."""
    rng = np.random.default_rng()
    rows = []
    for s in QUICK if quick else FULL:
        flops = 4 * s.H * s.Dh * sum(s.n - s.T + t + 1 for t in range(s.T))
        runs: list[tuple[CacheType, Flash, CmTiles | SgTiles | None, int]] = [(CacheType.F16, Flash.SCALAR, None, 1)]
        families: list[tuple[Flash, CmTiles | SgTiles | None, list]] = []
        if _coopmat(gpu, s.Dh):
            families.append((Flash.COOPMAT, cm_tiles(gpu.caps, s.Dh), [t for t in CM_SHAPES if cm_fits(gpu.caps, s.Dh, t)]))
        if _rows(gpu, s.Dh):
            families.append((Flash.ROWS, sg_tiles(gpu.caps, s.Dh), [t for t in SG_SHAPES if sg_fits(gpu.caps, s.Dh, t)]))
        for kind, best, shapes in families:
            runs += [(c, kind, best, n) for c in (CacheType.F16, CacheType.Q8_0) for n in (1, 2)]
            runs += [(CacheType.F16, kind, t, 1) for t in shapes if t != best]
        for ctype, kind, shape, n_split in runs:
            params, q, K, V, out = _setup(gpu, s, ctype, rng)
            part = gpu.buffer(partial_bytes(s.T, s.H, s.Dh, n_split), "bench.partial") if n_split > 1 else None
            g = gpu.graph("bench.flash")
            flash_attention(g, params, 0, q, K, V, out, kind=kind, shape=shape, n_split=n_split, partial=part)
            sec = _seconds(g, quick)
            tag = (f" {shape.br}x{shape.bc}" + (f"/{shape.parts}" if isinstance(shape, CmTiles) else
                                                 " prefetch" * shape.prefetch) if shape else "") \
                + (f" split={n_split}" if n_split > 1 else "")
            rows.append({"name": f"flash prefill {ctype.value} {kind.value}{tag}", "shape": str(s), "seconds": sec,
                         "TFLOP/s": flops / sec / 1e12})
    return rows


def _selections(s: Shape, rng: np.random.Generator) -> np.ndarray:
    """Bool (T, n) Sel_t of T queries at positions n-T.. : B/r drifting blocks among the visible ones
    plus the tail (MODEL.md Q8 shape; every query is sparse when n - T + 1 > B + r - 1)."""
    kb, p0 = s.B // s.r, s.n - s.T
    sel = np.zeros((s.T, s.n), bool)
    blocks = rng.choice((p0 + 1) // s.r, kb, replace=False)
    for t in range(s.T):
        nb = (p0 + t + 1) // s.r
        fresh = np.setdiff1d(rng.choice(nb, min(nb, 4 * kb), replace=False), blocks)[:rng.binomial(kb, DRIFT)]
        blocks = np.concatenate([rng.permutation(blocks)[len(fresh):], fresh])
        sel[t, (blocks[:, None] * s.r + np.arange(s.r)).reshape(-1)] = True
        sel[t, nb * s.r: p0 + t + 1] = True
    return sel


def _lists(gpu: Gpu, s: Shape, sel: np.ndarray) -> tuple[CellList, object]:
    """Every query's own sorted cell list (rows W = B + r - 1 apart) and its (position, count) params,
    as qsa_select's listing mode writes them for VKFLASH_QSA_ROWS."""
    W = s.B + s.r - 1
    cells = np.zeros((s.T, W), np.uint32)
    counts = sel.sum(axis=1)
    for t in range(s.T):
        cells[t, :counts[t]] = np.nonzero(sel[t])[0]
    params = np.stack([s.n - s.T + np.arange(s.T), counts], 1).astype(np.int32)
    return CellList(gpu.upload(cells, "bench.lists"), W), gpu.upload(params, "bench.lists.params")


@dataclass(frozen=True)
class Union:
    """qsa_union's output for query tiles of `tile`: per-tile params, lists and slot rows, mean |U|."""

    tile: int
    gp: object
    cells: object
    slots: object
    mean: int
    seconds: float


def _union(gpu: Gpu, s: Shape, params, sel_rows: Rows, tile: int, quick: bool) -> Union:
    """Run (and time) qsa_union over the selection bit rows in tiles of `tile`."""
    n_tiles, words = -(-s.T // tile), sel_rows.n_cols
    gp, cells = gpu.buffer(8 * n_tiles, f"bench.gp{tile}"), gpu.buffer(4 * n_tiles * s.n, f"bench.cells{tile}")
    slots = gpu.buffer(4 * s.T * words, f"bench.slots{tile}")
    g = gpu.graph(f"bench.union{tile}")
    qsa_union(g, params, 0, sel_rows, gp, cells, s.n, Rows(slots, s.T, words), tile=tile)
    sec = _seconds(g, quick)
    return Union(tile, gp, cells, slots, int(gp.read(np.int32, 2 * n_tiles)[1::2].mean()), sec)


def qsa_prefill(gpu: Gpu, quick: bool = False) -> list[dict]:
    """Seconds (and useful TFLOP/s) of one ubatch's QSA prefill attention at depth over an f16 cache:
    per-query lists on the decode kernel and on the coopmat kernel (each LIST_SHAPES shape that fits);
    unions: old = one dispatch per query tile of GATHER_TILE (the scalar kernel), new = all tiles in one
    dispatch on the scalar and the default kernel (the default also at tiles of GATHER_TILE/2 and
    2·GATHER_TILE, to choose hybrid.GATHER_TILE from; the other coopmat kernel at GATHER_TILE), and
    GP=0's masked dense attention; qsa_union's own time on rows of its own."""
    rng = np.random.default_rng()
    s = (QUICK if quick else FULL)[-1]
    params, q, K, V, out = _setup(gpu, s, CacheType.F16, rng)
    sel = _selections(s, rng)
    words = -(-s.n // 32)
    bits = np.zeros((s.T, words * 32), np.uint64)
    bits[:, :s.n] = sel
    packed = (bits.reshape(s.T, words, 32) << np.arange(32, dtype=np.uint64)).sum(axis=-1).astype(np.uint32)
    sel_rows = Rows(gpu.upload(packed, "bench.sel"), s.T, words)  # bit j of word j/32: as qsa_select writes
    flops = 4 * s.H * s.Dh * int(sel.sum())
    default = _default(gpu, s.Dh)
    rows = []

    def row(name: str, u: Union | None, build) -> None:
        g = gpu.graph(f"bench.{name}")
        build(g)
        sec = _seconds(g, quick)
        shape = f"{s} W={s.B + s.r - 1}" + (f" tiles of {u.tile}, |U|={u.mean}" if u else "")
        rows.append({"name": name, "shape": shape, "seconds": sec, "TFLOP/s": flops / sec / 1e12})

    def one(g, u: Union, kind: Flash) -> None:
        flash_attention(g, u.gp, 0, q, K, V, out, mask=CellMask(u.slots, words), cells=CellList(u.cells, s.n),
                        tile=u.tile, kind=kind)

    def per_tile(g, u: Union, kind: Flash) -> None:
        for k in range(-(-s.T // u.tile)):
            t0 = k * u.tile
            nt = min(s.T, t0 + u.tile) - t0
            flash_attention(g, u.gp, 2 * k, Heads(Rows(q.rows.buf, nt, s.H * s.Dh, t0 * s.H * s.Dh), s.H, s.Dh),
                            K, V, Heads(Rows(out.rows.buf, nt, s.H * s.Dh, t0 * s.H * s.Dh), s.H, s.Dh),
                            mask=CellMask(u.slots, words, t0 * words), cells=CellList(u.cells, s.n, k * s.n),
                            kind=kind, n_split=1, name=f"attn.{k}")

    unions = {t: _union(gpu, s, params, sel_rows, t, quick) for t in (GATHER_TILE // 2, GATHER_TILE, 2 * GATHER_TILE)}
    for u in unions.values():
        rows.append({"name": f"qsa_union tile={u.tile}", "shape": f"{s} |U|={u.mean}", "seconds": u.seconds,
                     "TFLOP/s": flops / u.seconds / 1e12})
    u = unions[GATHER_TILE]
    row("qsa prefill old: per tile, scalar", u, lambda g: per_tile(g, u, Flash.SCALAR))
    row("qsa prefill one dispatch, scalar", u, lambda g: one(g, u, Flash.SCALAR))
    row("qsa prefill masked dense (GP=0), scalar", None, lambda g: flash_attention(
        g, params, 0, q, K, V, out, mask=CellMask(sel_rows.buf, words), kind=Flash.SCALAR))
    lists, lp = _lists(gpu, s, sel)
    row("qsa prefill per-query lists, decode kernel", None, lambda g: attn_decode(
        g, lp, 0, q, K, V, out, cells=lists, row_lists=True))
    for t in LIST_SHAPES if _coopmat(gpu, s.Dh) else ():
        if list_fits(gpu.caps, s.Dh, s.H // s.H_kv, t):
            row(f"qsa prefill per-query lists, coopmat {t.br}x{t.bc}/{t.parts}", None, lambda g, t=t: flash_attention(
                g, lp, 0, q, K, V, out, cells=lists, tile=1, n_split=1, kind=Flash.COOPMAT, shape=t))
    if default is not Flash.SCALAR:
        for t, ut in unions.items():
            row(f"qsa prefill one dispatch, {default.value} tile={t}", ut, lambda g, ut=ut: one(g, ut, default))
        other = {Flash.ROWS: Flash.COOPMAT if _coopmat(gpu, s.Dh) else None,
                 Flash.COOPMAT: Flash.ROWS if _rows(gpu, s.Dh) else None}[default]
        if other is not None:
            row(f"qsa prefill one dispatch, {other.value} tile={GATHER_TILE}", u, lambda g: one(g, u, other))
        row(f"qsa prefill masked dense (GP=0), {default.value}", None, lambda g: flash_attention(
            g, params, 0, q, K, V, out, mask=CellMask(sel_rows.buf, words), kind=default))
    return rows
