"""Decode attention (MODEL.md §5.5 A5–A7, §5.6 Q9/S3) for T ≤ 8 queries: shaders/attn_decode.comp.

The flash kernel tiles q rows for prefill; at decode its 16-row tiles and few KV chunks leave a big
GPU mostly idle. This kernel reads each K/V row of a kv head once for all T·G rows of its group (up
to 16 rows per workgroup), splits the positions over many workgroups (grid-stride tiles: no context
ceiling), loads rows with 128-bit loads into shared memory and spreads keys over subgroups; the
split partials are merged by shaders/attn_decode_combine.comp, parallel over the splits. Dense,
masked and gathered (cell list) attention, f32/f16/q8_0 caches. `attention()` routes T ≤ 8 here
unless VKFLASH_ATTN_DECODE=0. With row lists (any T) every token brings its own cell list and params
(a prefill's per-query QSA selections): a workgroup serves one token's GQA group, reading each row of
that token's selection once for all its q heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from vkflash.gpu.device import Capabilities
from vkflash.gpu.memory import Buffer
from vkflash.gpu.interface import SpecConstants, u32
from vkflash.gpu.ops.attention import (AttnCombinePush, AttnPush, Cache, CacheType, CellList, CellMask, Heads,
                                       check_attention, partial_bytes)
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class DecodePush(AttnPush):
    """attn_decode.comp's push constants (see its header): the flash kernels' common ones, then the
    mode flags (1 gated, 2 masked, 4 gather, 8 split) and the row lists' stride (0: one list)."""

    flags: u32
    cell_stride: u32 = 0


@dataclass(frozen=True)
class DecodeSpec(SpecConstants):
    """attn_decode.comp's head dim, q rows per workgroup, keys per tile and lanes per key."""

    dh: u32
    rc: u32
    bc: u32
    d: u32


@dataclass(frozen=True)
class DecodeCombineSpec(SpecConstants):
    """attn_decode_combine.comp's head dim, whether the output is gated, dims per workgroup."""

    dh: u32
    gated: u32
    dc: u32


KERNELS = (
    [Kernel(f"attn_decode_{c.value}", "attn_decode.comp", 9, defines=((c.define, 1),), local_size=128,
            push=DecodePush, spec=DecodeSpec) for c in CacheType]
    + [Kernel("attn_decode_combine", "attn_decode_combine.comp", 3, local_size=256, push=AttnCombinePush,
              spec=DecodeCombineSpec)]
)
MAX_TOKENS = 8
"""Queries of a step this kernel serves (decode, MTP verify)."""
MAX_ROWS = 16
"""q rows (token × q head of one kv head) per workgroup: 4 accumulators each per invocation."""
MAX_LOADS = 8
"""16-byte vectors each invocation keeps in flight per tile (bounds the key tile)."""
COMBINE_DIMS = 64
"""Dims per combine workgroup (the others of its 256 invocations take other splits)."""


def target_workgroups(caps: Capabilities) -> int:
    """Workgroups in flight to keep the memory busy: two per SM of the biggest GPUs (132 on the H200;
    one wave, so no half-empty second wave) when discrete, a 40-CU APU's worth when integrated, few
    on a CPU driver. Each adds a partial of T·H·(Dh+2) floats for the combine."""
    return {"cpu": 8, "integrated": 128}.get(caps.device_type, 256)


@dataclass(frozen=True)
class DecodePlan:
    """Launch shape: rc rows per workgroup in n_chunks chunks, bc keys per tile, d lanes per key in
    the score phase, n_split workgroups along the keys."""

    rc: int
    n_chunks: int
    bc: int
    d: int
    n_split: int


def _span_vectors(dim: int, ctype: CacheType) -> int:
    """16-byte vectors a cache row's span may cover (two more than the row when not 16-byte aligned)."""
    rb = ctype.row_bytes(dim)
    return rb // 16 if rb % 16 == 0 else rb // 16 + 2


def _lanes_per_key(caps: Capabilities, dim: int) -> int:
    """D: the largest power of two ≤ 8 and ≤ the smallest subgroup that divides the row's 8-chunks."""
    d = 8
    while d > 1 and (d > caps.subgroup_min or (dim // 8) % d):
        d //= 2
    return d


def shared_bytes(rc: int, bc: int, dim: int, ctype: CacheType) -> int:
    """Shared memory of attn_decode.comp: q rows, the key tile, scores and row stats, key positions."""
    return 4 * rc * dim + 16 * bc * _span_vectors(dim, ctype) + 16 + 4 * bc * rc + 12 * rc + 4 * bc


def _shape(caps: Capabilities, rows: int, dim: int, ctype: CacheType) -> tuple[int, int, int, int] | None:
    """(rc, n_chunks, bc, d) for `rows` q rows per kv head, or None when the kernel cannot run: the
    largest row chunk (fewest re-reads of K/V), then the largest key tile (≤ 4 keys per lane in the
    score phase) whose shared arrays fit, preferring ≤ MAX_LOADS loads per lane."""
    wg = kernel(f"attn_decode_{ctype.value}").workgroup(caps)
    if dim % 32 or wg % (dim // 4):
        return None
    d = _lanes_per_key(caps, dim)
    fits = []
    for cap in (MAX_ROWS, 8, 4):
        n_chunks = -(-rows // cap)
        for per_lane in (4, 2, 1):
            bc = wg // d * per_lane
            rc = -(-rows // n_chunks // 4) * 4  # multiples of 4: few pipelines, ≤ 3 idle rows
            while (per_lane * rc) % d:  # the reduce-scatter splits P·RC values evenly over D lanes
                rc += 4
            if shared_bytes(rc, bc, dim, ctype) <= caps.shared_memory:
                fits.append(((rc, n_chunks, bc, d), -(-bc * _span_vectors(dim, ctype) // wg)))
    few_loads = [f for f, loads in fits if loads <= MAX_LOADS]
    return (few_loads or [f for f, _ in fits] or [None])[0]


def supported(caps: Capabilities, T: int, H: int, H_kv: int, dim: int, ctype: CacheType,
              row_lists: bool = False) -> bool:
    """Whether the kernel runs this shape on this device (else attention() uses flash); with row
    lists one token's GQA group must fit a workgroup (one row chunk, as `plan` needs)."""
    shape = _shape(caps, H // H_kv if row_lists else T * (H // H_kv), dim, ctype)
    return shape is not None and (not row_lists or shape[1] == 1)


def plan(caps: Capabilities, T: int, H: int, H_kv: int, dim: int, ctype: CacheType, n_keys: int,
         max_split: int | None = None, row_lists: bool = False) -> DecodePlan:
    """The launch shape for T queries of H heads over at most n_keys keys (_shape; with row lists one
    chunk per token), with splits to reach target_workgroups, at most one per key tile (a short cell
    list, e.g. the 2051-cell QSA gather, still spreads over all its tiles) and at most max_split."""
    shape = _shape(caps, H // H_kv if row_lists else T * (H // H_kv), dim, ctype)
    if shape is None or row_lists and shape[1] > 1:
        raise ValueError(f"attn_decode does not support head dim {dim} {ctype.value} here (needs a multiple of 32 "
                         f"whose quarter divides the workgroup, and a key tile in {caps.shared_memory} B"
                         + (f"; row lists: ≤ {MAX_ROWS} q heads per kv head)" if row_lists else ")"))
    rc, n_chunks, bc, d = shape
    if row_lists:
        n_chunks = T
    return DecodePlan(rc, n_chunks, bc, d, key_splits(caps, H_kv * n_chunks, n_keys, bc, max_split))


def key_splits(caps: Capabilities, groups: int, n_keys: int, bc: int, max_split: int | None = None) -> int:
    """KV splits for `groups` workgroups of queries over at most n_keys keys in tiles of bc: enough
    to reach target_workgroups, at most one per key tile, at most max_split and the grid's z limit."""
    want = -(-target_workgroups(caps) // groups)
    return max(1, min(want, max(1, -(-n_keys // bc)), max_split or want, caps.max_workgroup_count[2]))


def decode_partial_bytes(caps: Capabilities, max_tokens: int, H: int, H_kv: int, dim: int, ctype: CacheType,
                         n_keys: int) -> int:
    """Partial buffer that lets every step of ≤ max_tokens queries use its planned split count."""
    return max(partial_bytes(T, H, dim, plan(caps, T, H, H_kv, dim, ctype, n_keys).n_split)
               for T in range(1, max_tokens + 1))


def _check_aliases(name: str, params: Buffer, q: Heads, k: Cache, v: Cache, out: Heads, gate: Heads | None,
                   mask: CellMask | None, cells: CellList | None, partial: Buffer | None) -> None:
    """The output may not overlap q or the gate (other workgroups still read them), and the partial
    buffer is none of the operands."""
    for x, what in ((q, "q"), (gate, "gate")):
        if x is not None and x.rows.overlaps(out.rows):
            raise ValueError(f"{name}: output overlaps {what}")
    others = [params, q.rows.buf, k.buf, v.buf, out.rows.buf] + [x.rows.buf for x in (gate,) if x is not None] \
        + [x.buf for x in (mask, cells) if x is not None]
    if partial is not None and any(partial is b for b in others):
        raise ValueError(f"{name}: the partial buffer {partial.name!r} is also an operand")


def attn_decode(g: "Graph", params: Buffer, param_off: int, q: Heads, k: Cache, v: Cache, out: Heads, *,
                gate: Heads | None = None, mask: CellMask | None = None, cells: CellList | None = None,
                partial: Buffer | None = None, n_split: int | None = None,
                row_lists: bool = False, name: str = "attn") -> None:
    """attention() (A5)–(A7) for T ≤ 8 queries with the decode kernel: the same operands and params
    words (p0, n_kv at param_off). Splits: n_split, else plan()'s (at most what a given `partial`
    holds); one split writes the output directly, more add a combine dispatch whose partials go to
    `partial` (default: an intermediate of the graph). With `row_lists` (any T, `cells` needed, no
    mask) token t attends through its own list at cells.off + t·capacity with its own params
    (position p_t, count) at param_off + 2t, seeing positions ≤ p_t."""
    T, H, Dh, H_kv = q.n_tokens, q.n_heads, q.dim, k.n_heads
    if row_lists and (cells is None or mask is not None):
        raise ValueError(f"{name}: row lists need a cell list per token and no mask")
    check_attention(name, params, param_off, q, k, v, out, gate, mask, cells, T if row_lists else 1)
    if T > MAX_TOKENS and not row_lists:
        raise ValueError(f"{name}: attn_decode serves at most {MAX_TOKENS} queries, got {T}")
    _check_aliases(name, params, q, k, v, out, gate, mask, cells, partial)
    caps = g.gpu.caps
    n_keys = cells.capacity if cells is not None else k.n_ctx
    room = max(1, partial.nbytes // partial_bytes(T, H, Dh, 1)) if partial is not None else None
    if n_split is not None and (n_split < 1 or room is not None and n_split > room):
        raise ValueError(f"{name}: n_split={n_split} needs a partial buffer of {partial_bytes(T, H, Dh, n_split)} B")
    pl = plan(caps, T, H, H_kv, Dh, k.type, n_keys, max_split=room, row_lists=row_lists)
    if n_split is not None:
        pl = replace(pl, n_split=n_split)
    split = pl.n_split > 1
    if split and partial is None:
        partial = g.temp(partial_bytes(T, H, Dh, pl.n_split), f"{name}.partial")
    flags = (1 if gate is not None and not split else 0) | (2 if mask else 0) | (4 if cells else 0) | (8 if split else 0)
    gv = gate if gate is not None else q
    dst = partial if split else None  # the partials' buffer; None: the output is written directly
    bufs = [params, q.rows.buf, gv.rows.buf, k.buf, v.buf, mask.buf if mask else k.buf,
            cells.buf if cells else k.buf, out.rows.buf if dst is None else k.buf, k.buf if dst is None else dst]
    push = DecodePush(T, H // H_kv, H_kv, k.n_ctx, q.off, q.rows.stride, q.head_stride, gv.off, gv.rows.stride,
                      gv.head_stride, out.off, out.rows.stride, out.head_stride, param_off, mask.off if mask else 0,
                      mask.stride if mask else 0, cells.off if cells else 0, pl.n_split,
                      1.0 / np.sqrt(Dh), flags,
                      cells.capacity if row_lists and cells is not None else 0)
    kv_bytes = 2 * n_keys * H_kv * k.type.row_bytes(Dh) * pl.n_chunks
    g.dispatch(f"attn_decode_{k.type.value}", bufs, [pl.n_chunks, H_kv, pl.n_split], push=push,
               spec=DecodeSpec(Dh, pl.rc, pl.bc, pl.d), writes=[7 if dst is None else 8], name=name,
               desc=f"T={T} H={H}/{H_kv} Dh={Dh} {k.type.value} rows={pl.rc}x{pl.n_chunks} tile={pl.bc} "
               f"split={pl.n_split}" + (" gated" * (gate is not None)) + (" masked" * (mask is not None))
               + (" gather" * (cells is not None)) + (" row lists" * row_lists),
               nbytes=kv_bytes, flops=4 * T * H * Dh * n_keys)
    if dst is not None:
        g.dispatch("attn_decode_combine", [dst, gv.rows.buf, out.rows.buf], [H, T, Dh // min(Dh, COMBINE_DIMS)],
                   push=AttnCombinePush(T, H, pl.n_split, gv.off, gv.rows.stride, gv.head_stride,
                                        out.off, out.rows.stride, out.head_stride),
                   spec=DecodeCombineSpec(Dh, gate is not None, min(Dh, COMBINE_DIMS)), name=f"{name}.combine",
                   desc=f"T={T} H={H} split={pl.n_split}", nbytes=partial_bytes(T, H, Dh, pl.n_split))
