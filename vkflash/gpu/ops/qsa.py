"""QSA ops (MODEL.md §5.6 Q2–Q8, S1–S3): pooled-key summary rows, block scores, the selection and
the per-tile union of a gathered prefill.

The raw indexer keys are written with attention.kv_append (one head of D_I). `qsa_pool` fills the
summary rows of blocks an ubatch completes (or re-pools every complete block); `qsa_scores`
computes s_{t,b}; `qsa_select` runs an exact top-k over blocks (ties to the lower index, any kb) in
`block` or `cell` mode (one 1024-wide workgroup per query, 3 radix passes and workgroup scans:
qsa_topk_wide.comp; VKFLASH_TOPK_WIDE=0: qsa_topk.comp's 8 passes) and emits either the sorted cell
list + gather params of a gathered decode
attention, or per-query bit rows for masked prefill attention; `qsa_union` turns those bit rows into
one sorted cell list per query tile with per-query slot rows (gathered prefill, S1–S3).
Positions and lengths come from the params buffer ([p0, n] at param_off), as for attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vkflash.gpu.interface import PushConstants, SpecConstants, f32, u32
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.attention import SPLIT_MAX_TOKENS, Cache, CacheType
from vkflash.gpu.ops.views import Rows
from vkflash.gpu.registry import Kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class PoolPush(PushConstants):
    """qsa_pool.comp's push constants: params offset, block size, summary rows, RoPE dims, ε, θ, re-pool."""

    param_off: u32
    r: u32
    n_blocks: u32
    n_rot: u32
    eps: f32
    theta: f32
    repool: u32


@dataclass(frozen=True)
class HeadDimSpec(SpecConstants):
    """The indexer head dim D_I (qsa_pool.comp)."""

    dh: u32


@dataclass(frozen=True)
class ScoresPush(PushConstants):
    """qsa_scores.comp's push constants: params offset, block size, summary rows, the qI and scores
    views, queries."""

    param_off: u32
    r: u32
    n_blocks: u32
    q_off: u32
    q_row: u32
    s_off: u32
    s_row: u32
    n_tok: u32


@dataclass(frozen=True)
class ScoresSpec(SpecConstants):
    """qsa_scores.comp's head dim D_I, indexer heads n_I and queries per workgroup (1: one per query)."""

    dh: u32
    n_i: u32
    qt: u32 = 1


@dataclass(frozen=True)
class TopkPush(PushConstants):
    """qsa_topk.comp's push constants: params offset, r, kb, W, the scores, cell-list, gather-params and
    bit-row views."""

    param_off: u32
    r: u32
    kb: u32
    W: u32
    s_off: u32
    s_row: u32
    list_off: u32
    list_row: u32
    gp_off: u32
    bits_off: u32
    bits_row: u32


@dataclass(frozen=True)
class TopkSpec(SpecConstants):
    """qsa_topk.comp's output (1: cell lists, 0: bit rows) and mode (1: `cell`, 0: `block`)."""

    list: u32
    cell: u32


@dataclass(frozen=True)
class UnionPush(PushConstants):
    """qsa_union.comp's push constants: params offset, queries, tile, the selection view, list capacity,
    the slot-row view."""

    param_off: u32
    T: u32
    TQ: u32
    m_off: u32
    m_row: u32
    cap: u32
    s_off: u32
    s_row: u32


@dataclass(frozen=True)
class UnionSpec(SpecConstants):
    """qsa_union.comp's pass: 0 the lists, 1 the slot rows."""

    phase: u32


KERNELS = (
    [Kernel(f"qsa_pool_{c.value}", "qsa_pool.comp", 4, defines=((c.define, 1),), local_size=128,
            push=PoolPush, spec=HeadDimSpec) for c in CacheType]
    + [Kernel("qsa_scores", "qsa_scores.comp", 4, local_size=64, push=ScoresPush, spec=ScoresSpec),
       Kernel("qsa_topk", "qsa_topk.comp", 5, local_size=256, push=TopkPush, spec=TopkSpec),
       Kernel("qsa_topk_wide", "qsa_topk_wide.comp", 5, local_size=1024, push=TopkPush, spec=TopkSpec),
       Kernel("qsa_union", "qsa_union.comp", 5, local_size=256, push=UnionPush, spec=UnionSpec)]
)
SCORE_GROUPS = 64  # workgroups per query (tile of queries) striding over blocks (grid-stride: any depth)
SCORE_DOTS = 32  # dots an invocation of the tiled qsa_scores keeps in registers (QT·n_I)
SCORE_DC = 32  # dims the tiled qsa_scores stages per pass (qsa_scores.comp DC)
REPOOL_GROUPS = 256  # workgroups striding over all complete blocks when re-pooling (POOLED=0)


def qsa_pool(g: "Graph", params: Buffer, param_off: int, keys: Cache, gain: Buffer, summary: Rows, *,
             r: int, T: int, n_rot: int, theta: float, eps: float, repool: bool = False,
             name: str = "qsa_pool") -> None:
    """(Q2)–(Q3) κ_b = RoPE_{br}(rms((1/r)Σ_i ρ_{br+i}) ⊙ gain) for every block b an ubatch of T tokens
    at p0 = params[param_off] completes (n = params[param_off+1] keys after it), or with `repool` for
    every complete block b < ⌊n/r⌋ (same bits per row); summary row b at b·D."""
    D = keys.dim
    if keys.n_heads != 1 or summary.n_cols != D or summary.stride != D or gain.nbytes < 4 * D:
        raise ValueError(f"{name}: needs one key head of {D}, dense summary rows of {D} and a gain of {D}")
    if summary.off:
        raise ValueError(f"{name}: summary rows must start at element 0")
    if n_rot % 2 or n_rot > D or r < 1:
        raise ValueError(f"{name}: n_rot {n_rot} / r {r} invalid for D_I {D}")
    kname = f"qsa_pool_{keys.type.value}"
    groups = min(summary.n_rows, REPOOL_GROUPS) if repool else T // r + 1
    g.dispatch(kname, [params, keys.buf, gain, summary.buf], [groups],
               push=PoolPush(param_off, r, summary.n_rows, n_rot, eps, theta, repool), spec=HeadDimSpec(D),
               name=name, desc=f"T={T} r={r} D_I={D} {keys.type.value}" + " repool" * repool)


def qsa_scores(g: "Graph", params: Buffer, param_off: int, qI: Rows, summary: Rows, scores: Rows, *,
               n_I: int, r: int, name: str = "qsa_scores") -> None:
    """(Q5) scores[t, b] = Σ_h relu(qI_{t,h}·κ_b) for b < ⌊(p0+t+1)/r⌋ (other entries untouched);
    qI rows hold n_I heads of D_I, scores rows have room for every summary row."""
    D, T = summary.n_cols, qI.n_rows
    if qI.n_cols != n_I * D or scores.n_rows != T or scores.n_cols < summary.n_rows or summary.stride != D:
        raise ValueError(f"{name}: qI {qI.n_rows}x{qI.n_cols}, summary {summary.n_rows}x{D}, scores "
                         f"{scores.n_rows}x{scores.n_cols} do not fit n_I={n_I}")
    qt = score_tile(g, T, n_I, D)
    g.dispatch("qsa_scores", [params, qI.buf, summary.buf, scores.buf], [SCORE_GROUPS, -(-T // qt)],
               push=ScoresPush(param_off, r, summary.n_rows, qI.off, qI.stride, scores.off, scores.stride, T),
               spec=ScoresSpec(D, n_I, qt), name=name, desc=f"T={T} n_I={n_I} D_I={D} QT={qt}")


def score_tile(g: "Graph", T: int, n_I: int, D: int) -> int:
    """Queries per qsa_scores workgroup: 1 for steps that attend row by row (decode, verify: their
    rows stay what decode computes) or with VKFLASH_QSA_SCORE_TILE=0, else SCORE_DOTS / n_I dots
    per invocation where the head dim is whole staging passes."""
    if T <= SPLIT_MAX_TOKENS or not g.options.qsa_score_tile or D % SCORE_DC:
        return 1
    return max(1, SCORE_DOTS // n_I)


def qsa_select(g: "Graph", params: Buffer, param_off: int, scores: Rows, out: Rows, *, r: int, B: int,
               cell: bool = False, gather_params: Buffer | None = None, gp_off: int = 0,
               name: str = "qsa_select") -> None:
    """(Q6)–(Q8) Sel_t for the T = scores.n_rows queries at p0 + t, in `block` mode or (cell=True)
    `cell` mode with tie rule `index` (lower cell first). With gather_params:
    out row t = sorted cells of Sel_t (needs ≥ W = B + r − 1 columns) and gather_params[gp_off+2t],
    [gp_off+2t+1] = (position, count); else out row t = bit words of Sel_t (≥ ⌈n_ctx/32⌉ columns)."""
    if B < r or B % r:
        raise ValueError(f"{name}: token budget B={B} is not a positive multiple of the block size r={r}")
    W, T = B + r - 1, scores.n_rows
    if out.n_rows != T:
        raise ValueError(f"{name}: output has {out.n_rows} rows for {T} queries")
    listing = gather_params is not None
    if listing and (out.n_cols < W or gather_params.nbytes < 4 * (gp_off + 2 * T)):
        raise ValueError(f"{name}: cell lists need {W} columns and {2 * T} gather-params words")
    cells, bits = (out, None) if listing else (None, out)
    kname = "qsa_topk_wide" if g.options.topk_wide else "qsa_topk"
    g.dispatch(kname, [params, scores.buf, gather_params if listing else params, cells.buf if cells else params,
                            bits.buf if bits else params], [T],
               push=TopkPush(param_off, r, B // r, W, scores.off, scores.stride, cells.off if cells else 0,
                             cells.stride if cells else 0, gp_off, bits.off if bits else 0, bits.stride if bits else 0),
               spec=TopkSpec(listing, cell), writes=[2, 3] if listing else [4], name=name,
               desc=f"T={T} kb={B // r} r={r} {'cell' if cell else 'block'} {'list' if listing else 'mask'}")


def qsa_union(g: "Graph", params: Buffer, param_off: int, sel: Rows, gp: Buffer, cells: Buffer, cap: int,
              slots: Rows, *, tile: int, name: str = "qsa_union") -> int:
    """(S1)–(S3) for the T = sel.n_rows queries at p0 + t in tiles of `tile`: tile k gets the sorted
    union U_k of the queries' selections (bit rows `sel` over positions, from qsa_select) at
    cells[k·cap …], slot rows `slots` (bit u of query t = U_k[u] ∈ Sel_t) and gp[2k], gp[2k+1] =
    (p0 + k·tile, |U_k|); a tile whose union exceeds half its causal range gets the dense range
    instead (masked dense through the same path). Two dispatches: the lists (one workgroup per tile),
    then the slot rows (one per query). cap ≥ the cache length. Returns the number of tiles."""
    T = sel.n_rows
    n_tiles = -(-T // tile)
    if slots.n_rows != T or slots.n_cols * 32 < cap or sel.n_cols * 32 < cap:
        raise ValueError(f"{name}: {T} queries need selection and slot rows of ⌈{cap}/32⌉ words, got "
                         f"{sel.n_rows}x{sel.n_cols} and {slots.n_rows}x{slots.n_cols}")
    if cells.nbytes < 4 * n_tiles * cap or gp.nbytes < 8 * n_tiles or tile < 1:
        raise ValueError(f"{name}: {n_tiles} tiles of {tile} need {n_tiles}x{cap} list words and {2 * n_tiles} "
                         f"gather-params words")
    bufs = [params, sel.buf, gp, cells, slots.buf]
    push = UnionPush(param_off, T, tile, sel.off, sel.stride, cap, slots.off, slots.stride)
    g.dispatch("qsa_union", bufs, [n_tiles], push=push, spec=UnionSpec(0), writes=[2, 3], name=name,
               desc=f"T={T} tile={tile} cap={cap} lists")
    g.dispatch("qsa_union", bufs, [n_tiles, min(tile, T)], push=push, spec=UnionSpec(1), writes=[4],
               name=f"{name}.slots",
               desc=f"T={T} tile={tile} cap={cap} slot rows")
    return n_tiles
