"""Attention ops (MODEL.md §5.5 A4–A7, §5.6 Q9/S1–S3): KV-cache append and flash attention.

Steps of ≤ 8 queries go to ops/attn_decode.py (unless VKFLASH_ATTN_DECODE=0); the rest to two flash
kernels that share one interface (shaders/common/attn.glsl): the scalar f32 attn_flash.comp, and
attn_flash_cm.comp, whose Q·Kᵀ and P·V run as f16 cooperative-matrix products accumulated in f32
(prefill of at least COOPMAT_MIN_TOKENS tokens over f16 / q8_0 caches where the device has them,
unless VKFLASH_FA_COOPMAT=0); that family has two kernels: attn_flash_sg.comp, in which each subgroup
owns 16 rows over the whole head dim (S, softmax and O without cross-subgroup sums), and the earlier
attn_flash_cm.comp, in which two subgroups split a row block's head dim and add their S through shared
memory (VKFLASH_FA_ROWS=0). Rows are the (token, q head) pairs of one kv head, so K/V tiles are
shared by the whole GQA group; key tiles that a mask hides from every row of a workgroup are
skipped. Queries may come in tiles with their own params and cell lists (gathered QSA prefill: every
tile of the ubatch in one dispatch; a tile of one token for each query's own list, `row_lists`), and a
dispatch may serve only the queries in a range of positions (the rest of its output is another's).
With n_split > 1 the KV range is cut into n_split chunks whose partial (o, m, l) are merged by
shaders/attn_combine.comp (flash-decode). Positions and lengths come from a step-params buffer, so
one recorded graph replays at any context length. Caches are [n_ctx, heads, Dh] in f32, f16 or q8_0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable, TypeVar

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.formats.quant_blocks import row_bytes
from vkflash.formats.quants import dequantize
from vkflash.gpu.graph import Node
from vkflash.gpu.interface import PushConstants, SpecConstants, boolean, f32, u32
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.views import F32, Rows, grid
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.device import Capabilities
    from vkflash.gpu.graph import Graph


class CacheType(str, Enum):
    """Storage type of a K/V (or indexer-key) cache row; q8_0 = blocks of f16 scale + 32 int8."""

    F32 = "f32"
    F16 = "f16"
    Q8_0 = "q8_0"

    @property
    def define(self) -> str:
        return {"f32": "KV_F32", "f16": "KV_F16", "q8_0": "KV_Q8_0"}[self.value]

    @property
    def qtype(self) -> Q:
        """The GGML type of a cache row (its block geometry is formats/quant_blocks.py's)."""
        return {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0}[self.value]

    def row_bytes(self, n: int) -> int:
        """Bytes of n consecutive elements (n a multiple of 32 for q8_0)."""
        return row_bytes(self.qtype, n)


@dataclass(frozen=True)
class AppendPush(PushConstants):
    """kv_append.comp's push constants: tokens, heads, the source view, positions' offset, cache length,
    the second source's view."""

    T: u32
    n_heads: u32
    src_off: u32
    src_row: u32
    pos_off: u32
    n_ctx: u32
    src2_off: u32
    src2_row: u32


@dataclass(frozen=True)
class AppendSpec(SpecConstants):
    """kv_append.comp's head dim and whether a second (src, cache) pair is appended."""

    dh: u32
    pair: boolean


@dataclass(frozen=True)
class AttnPush(PushConstants):
    """The attention kernels' common push constants (shaders/common/attn.glsl): sizes, the q, gate
    and output views, params, mask and cell offsets, splits and the score scale."""

    T: u32
    G: u32
    H_kv: u32
    kv_rows: u32
    q_off: u32
    q_row: u32
    q_head: u32
    gate_off: u32
    gate_row: u32
    gate_head: u32
    o_off: u32
    o_row: u32
    o_head: u32
    param_off: u32
    mask_off: u32
    mask_stride: u32
    cell_off: u32
    n_split: u32
    scale: f32


@dataclass(frozen=True)
class FlashPush(AttnPush):
    """The flash kernels' push constants: AttnPush, then the query tiles (TQ queries each, params and
    cell lists p_stride and c_stride apart), then the positions [pos_lo, pos_hi) of the queries served."""

    TQ: u32
    p_stride: u32
    c_stride: u32
    pos_lo: u32
    pos_hi: u32


@dataclass(frozen=True)
class FlashSpec(SpecConstants):
    """attn_flash.comp's head dim, row and key tiles, and flags (1 gated, 2 masked, 4 gather, 8 split)."""

    dh: u32
    br: u32
    bc: u32
    flags: u32


@dataclass(frozen=True)
class FlashCmSpec(SpecConstants):
    """attn_flash_cm.comp's head dim, rows and key tile, flags (as FlashSpec) and matrix workers."""

    dh: u32
    br: u32
    bc: u32
    flags: u32
    nw: u32


@dataclass(frozen=True)
class FlashSgSpec(SpecConstants):
    """attn_flash_sg.comp's head dim, rows (16 per worker subgroup), key tile, flags (as FlashSpec) and
    whether the next key tile is fetched during this one's math."""

    dh: u32
    br: u32
    bc: u32
    flags: u32
    prefetch: boolean


@dataclass(frozen=True)
class AttnCombinePush(PushConstants):
    """attn_combine.comp's push constants: tokens, q heads, splits, the gate and output head views."""

    T: u32
    H: u32
    n_split: u32
    gate_off: u32
    gate_row: u32
    gate_head: u32
    o_off: u32
    o_row: u32
    o_head: u32


@dataclass(frozen=True)
class AttnCombineSpec(SpecConstants):
    """attn_combine.comp's head dim and whether the output is gated."""

    dh: u32
    gated: u32


CM_WG = 256  # invocations of the coopmat flash kernel: 8 subgroups of 32 (or 4 of 64)
SG_WG = 256  # invocations of the subgroup-rows kernel: 8 subgroups of 32 (or 4 of 64)
KERNELS = (
    [Kernel(f"kv_append_{c.value}", "kv_append.comp", 5, defines=((c.define, 1),), local_size=64,
            push=AppendPush, spec=AppendSpec) for c in CacheType]
    + [Kernel(f"attn_flash_{c.value}", "attn_flash.comp", 9, defines=((c.define, 1),), local_size=128,
              push=FlashPush, spec=FlashSpec) for c in CacheType]
    + [Kernel(f"attn_flash_cm_{c.value}", "attn_flash_cm.comp", 9, defines=((c.define, 1),), local_size=CM_WG,
              needs=frozenset({"coopmat_f16"}), push=FlashPush, spec=FlashCmSpec) for c in CacheType]
    + [Kernel(f"attn_flash_sg_{c.value}", "attn_flash_sg.comp", 9, defines=((c.define, 1),), local_size=SG_WG,
              needs=frozenset({"coopmat_f16"}), push=FlashPush, spec=FlashSgSpec) for c in CacheType]
    + [Kernel("attn_combine", "attn_combine.comp", 3, local_size=64, push=AttnCombinePush,
              spec=AttnCombineSpec)]
)
MAX_GROUPS = 4096  # grid-stride loop of kv_append covers the rest
COOPMAT_MIN_TOKENS = 9  # fewer query tokens (decode, MTP verify) never take the coopmat flash kernel
CM_KERNEL = "attn_flash_cm"  # kernel family of the coopmat flash kernel (tests swap in an emulated build)
SG_KERNEL = "attn_flash_sg"  # kernel family of the subgroup-rows coopmat kernel (likewise)
SKIP_WINDOW = 32 * 4  # bytes of the tile-skip bitset in both flash kernels' shared memory (common/attn.glsl)
ALL_POSITIONS = 0xFFFFFFFF  # flash_attention's `positions` bound that serves every query


@dataclass(frozen=True)
class Cache:
    """A cache buffer of n_ctx positions × n_heads rows of `dim` elements of `type`."""

    buf: Buffer
    n_ctx: int
    n_heads: int
    dim: int
    type: CacheType

    def __post_init__(self) -> None:
        if self.type is CacheType.Q8_0 and self.dim % 32:
            raise ValueError(f"q8_0 cache rows need a head dim that is a multiple of 32, got {self.dim}")
        need = self.nbytes(self.n_ctx, self.n_heads, self.dim, self.type)
        if need > self.buf.nbytes:
            raise ValueError(f"cache {self.buf.name!r}: {self.n_ctx}x{self.n_heads}x{self.dim} {self.type.value} "
                             f"needs {need} B, buffer has {self.buf.nbytes} B")

    @staticmethod
    def nbytes(n_ctx: int, n_heads: int, dim: int, type: CacheType) -> int:
        return n_ctx * n_heads * type.row_bytes(dim)

    def read(self, n: int) -> np.ndarray:
        """Positions [0, n) decoded to float32, (n, n_heads, dim): for tests and debugging."""
        m = n * self.n_heads * self.dim
        if self.type is CacheType.F32:
            x = self.buf.read(np.float32, m)
        elif self.type is CacheType.F16:
            x = self.buf.read(np.float16, m).astype(np.float32)
        else:
            x = dequantize(self.buf.read(np.uint8, self.type.row_bytes(m)), self.type.qtype, m)
        return x.reshape(n, self.n_heads, self.dim)


@dataclass(frozen=True)
class Heads:
    """n_heads vectors of `dim` f32 in each row of `rows`: head h of row t starts at element
    rows.off + t*rows.stride + col + h*head_stride (head_stride defaults to dim)."""

    rows: Rows
    n_heads: int
    dim: int
    head_stride: int = -1
    col: int = 0

    def __post_init__(self) -> None:
        if self.head_stride == -1:
            object.__setattr__(self, "head_stride", self.dim)
        if self.head_stride < self.dim or self.col < 0:
            raise ValueError(f"heads of {self.dim}: head stride {self.head_stride} or column {self.col} invalid")
        if self.col + (self.n_heads - 1) * self.head_stride + self.dim > self.rows.n_cols:
            raise ValueError(f"{self.n_heads} heads of {self.dim} (stride {self.head_stride}, column {self.col}) "
                             f"do not fit a row of {self.rows.n_cols}")

    @property
    def off(self) -> int:
        return self.rows.off + self.col

    @property
    def n_tokens(self) -> int:
        return self.rows.n_rows


def q_and_gate(qg: Rows, n_heads: int, dim: int) -> tuple[Heads, Heads]:
    """(A1) the interleaved projection QG: q_h = QG[2h·Dh, 2h·Dh+Dh), gate_h = QG[2h·Dh+Dh, 2(h+1)·Dh)."""
    return Heads(qg, n_heads, dim, 2 * dim), Heads(qg, n_heads, dim, 2 * dim, dim)


def _check_append(name: str, params: Buffer, pos_off: int, src: Heads, cache: Cache) -> None:
    if (src.n_heads, src.dim) != (cache.n_heads, cache.dim):
        raise ValueError(f"{name}: source has {src.n_heads}x{src.dim} heads, cache {cache.n_heads}x{cache.dim}")
    if src.head_stride != src.dim:
        raise ValueError(f"{name}: source heads must be contiguous (head stride {src.head_stride} != {src.dim})")
    if src.dim % 32:
        raise ValueError(f"{name}: head dim {src.dim} is not a multiple of 32")
    if 4 * (pos_off + src.n_tokens) > params.nbytes:
        raise ValueError(f"{name}: positions [{pos_off}, {pos_off + src.n_tokens}) overflow the params buffer")


@dataclass(frozen=True)
class KvAppend(Node):
    """cache[p_t] = round(src[t]) at the positions params[pos_off + t]; `second` = (src2, cache2)
    appended in the same dispatch (Fusion.KV_APPEND: a layer's V beside its K)."""

    params: Buffer
    pos_off: int
    src: Heads
    cache: Cache
    name: str
    second: tuple[Heads, Cache] | None = None

    def __post_init__(self) -> None:
        _check_append(self.name, self.params, self.pos_off, self.src, self.cache)
        if self.second is not None:
            src2, cache2 = self.second
            _check_append(self.name, self.params, self.pos_off, src2, cache2)
            if (src2.n_tokens, cache2.type, cache2.n_ctx) != (self.src.n_tokens, self.cache.type, self.cache.n_ctx):
                raise ValueError(f"{self.name}: the two pairs differ in tokens, cache type or length")

    def inputs(self) -> tuple[Rows | Buffer, ...]:
        return (self.params, self.src.rows) + ((self.second[0].rows,) if self.second is not None else ())

    def outputs(self) -> tuple[Buffer, ...]:
        return (self.cache.buf,) + ((self.second[1].buf,) if self.second is not None else ())

    def lower(self, g: "Graph") -> None:
        src, cache = self.src, self.cache
        src2, cache2 = self.second if self.second is not None else (src, cache)
        T = src.n_tokens
        kname = f"kv_append_{cache.type.value}"
        wg = kernel(kname).workgroup(g.gpu.caps)
        n_pairs = 2 if self.second is not None else 1
        n_blocks = n_pairs * T * src.n_heads * src.dim // 32
        g.dispatch(kname, [self.params, src.rows.buf, cache.buf, src2.rows.buf, cache2.buf],
                   [grid(n_blocks, wg, MAX_GROUPS)],
                   push=AppendPush(T, src.n_heads, src.off, src.rows.stride, self.pos_off, cache.n_ctx, src2.off,
                                   src2.rows.stride),
                   spec=AppendSpec(src.dim, self.second is not None), writes=[2, 4] if self.second is not None else [2],
                   name=self.name, desc=f"T={T} {n_pairs}x{src.n_heads}x{src.dim} {cache.type.value}",
                   nbytes=n_pairs * T * src.n_heads * (F32 * src.dim + cache.type.row_bytes(src.dim)))


def kv_append(g: "Graph", params: Buffer, pos_off: int, src: Heads, cache: Cache, name: str = "kv_append") -> None:
    """(A4, Q1) cache[p_t, h, :] = round(src[t, h, :]) with p_t = params[pos_off + t] (int32) for each
    token t of `src`; positions outside [0, n_ctx) are skipped."""
    g.add(KvAppend(params, pos_off, src, cache, name))


@dataclass(frozen=True)
class CellMask:
    """Per-query bit rows (S3/Q9): query t may see iteration slot i iff bit i%32 of
    word buf[off + t*stride + i//32] is set (slot = cache position, or list slot with a CellList)."""

    buf: Buffer
    stride: int
    off: int = 0


@dataclass(frozen=True)
class CellList:
    """Gathered attention (S2): iteration slot i reads cache position buf[off + i] (uint32); the number
    of slots replaces n_kv in the params buffer."""

    buf: Buffer
    capacity: int
    off: int = 0


@dataclass(frozen=True)
class DenseHead:
    """Row lists whose queries before position `end` hold every earlier cell (QSA, MODEL.md Q6): those
    queries may attend as plain causal attention with the step's (p0, n_kv) at params[off]."""

    params: Buffer
    off: int
    end: int


class Flash(str, Enum):
    """Which flash kernel runs: scalar f32, cooperative matrix with the head dim split over subgroups
    (CM_KERNEL), or cooperative matrix with subgroup-owned rows (SG_KERNEL)."""

    SCALAR = "scalar"
    COOPMAT = "coopmat"
    ROWS = "rows"


def flash_tiles(dim: int, rows: int, shared_bytes: int) -> tuple[int, int]:
    """(BR, BC) of the scalar kernel: rows per workgroup (≤ 4096/Dh, no more than needed) and the
    largest key tile (≤ 32: one mask word) whose shared arrays (q rows, padded K/V tile, scores,
    3 row stats, skip bitset) fit the device's shared memory."""
    br_max = max(4, 4096 // dim)
    br = min(br_max, 1 << max(0, (rows - 1).bit_length()))
    for bc in (32, 16, 8, 4):
        if 4 * (br * dim + bc * (dim + 1) + br * bc + 3 * br) + SKIP_WINDOW <= shared_bytes:
            return br, bc
    raise ValueError(f"head dim {dim} does not fit {shared_bytes} B of shared memory")


@dataclass(frozen=True)
class CmTiles:
    """Coopmat kernel shape: BR rows (BR/16 row blocks) × key tiles of BC, `parts` workers per row
    block splitting the head dim (workers = BR/16 · parts subgroups)."""

    br: int
    bc: int
    parts: int

    @property
    def workers(self) -> int:
        return self.br // 16 * self.parts

    def shared_bytes(self, dim: int) -> int:
        """sKV (f16, row stride Dh+8) + sS (f32, parts copies, stride BC+4) + sP (f16, stride BC+8)
        + sJ + 3 row stats + the skip bitset, as declared in attn_flash_cm.comp."""
        return (2 * self.bc * (dim + 8) + 4 * self.parts * self.br * (self.bc + 4) + 2 * self.br * (self.bc + 8)
                + 4 * self.bc + 12 * self.br + SKIP_WINDOW)


CM_SHAPES = (CmTiles(64, 32, 2), CmTiles(64, 32, 1), CmTiles(32, 32, 4), CmTiles(64, 16, 2), CmTiles(64, 16, 1))
"""In order of preference: 8 workers (subgroups of ≤ 32) with halves of Dh each hold 8 Q and 8 O
blocks (Dh 256); 4 workers (subgroups of 64, e.g. RADV wave64) hold whole rows; 32 rows in quarters
of Dh (half the registers per worker, K/V tiles shared by half the rows); BC=16 where shared memory
is short. `vkflash bench kernels` times every shape that fits."""


def cm_fits(caps: "Capabilities", dim: int, t: CmTiles) -> bool:
    """Whether the device can run shape t at head dim `dim`: enough subgroups for its workers at the
    largest subgroup size, a row's softmax invocations (CM_WG/BR) within the smallest, Dh/16 blocks
    that split evenly, and its shared arrays within the device's shared memory."""
    sg_max = max(caps.subgroup_size, caps.subgroup_max)
    sg_min = min(caps.subgroup_size, caps.subgroup_min)
    return (dim % 16 == 0 and caps.max_invocations >= CM_WG and t.workers <= CM_WG // sg_max
            and CM_WG // t.br <= sg_min and (dim // 16) % t.parts == 0 and t.shared_bytes(dim) <= caps.shared_memory)


def cm_tiles(caps: "Capabilities", dim: int) -> CmTiles | None:
    """The first CM_SHAPES entry the device can run at head dim `dim` (cm_fits), if any."""
    return next((t for t in CM_SHAPES if cm_fits(caps, dim, t)), None)


@dataclass(frozen=True)
class SgTiles:
    """Subgroup-rows kernel shape: BR rows (one worker subgroup per 16) × key tiles of BC; with
    `prefetch` the next tile's K and V are fetched into registers during this tile's math."""

    br: int
    bc: int
    prefetch: bool = False

    @property
    def workers(self) -> int:
        return self.br // 16

    def shared_bytes(self, dim: int) -> int:
        """sK, sV (f16, row stride Dh+8) + sS (f32, stride BC+4) + sP (f16, stride BC+8) + sJ + 3 row
        stats + the skip bitset, as declared in attn_flash_sg.comp."""
        return (4 * self.bc * (dim + 8) + 4 * self.br * (self.bc + 4) + 2 * self.br * (self.bc + 8)
                + 4 * self.bc + 12 * self.br + SKIP_WINDOW)


SG_SHAPES = (SgTiles(128, 16), SgTiles(128, 16, True), SgTiles(64, 32), SgTiles(64, 16))
"""In order of preference: 8 worker subgroups of ≤ 32 on 16-key tiles (35 KiB of shared memory at
Dh 256), the same with the next tile fetched ahead, 4 workers (subgroups of 64), 16-key tiles where
shared memory is short. On the H200 at 512 × 33k, Dh 256, 2 splits: 128x16 48.7 TFLOP/s f16 (46.8
q8_0), with prefetch 50.7 f16 (measured once, f16 only: not the default yet); 64x32 44.5 (one run
each; `vkflash bench kernels --only attn_prefill` prints them all)."""


def sg_fits(caps: "Capabilities", dim: int, t: SgTiles) -> bool:
    """Whether the device can run subgroup-rows shape t at head dim `dim`: enough subgroups for its
    workers at the largest subgroup size, power-of-two subgroups (the softmax's lanes per row), and
    its shared arrays within the device's shared memory."""
    sg_max = max(caps.subgroup_size, caps.subgroup_max)
    sg_min = min(caps.subgroup_size, caps.subgroup_min)
    return (dim % 16 == 0 and caps.max_invocations >= SG_WG and t.workers <= SG_WG // sg_max
            and sg_min & (sg_min - 1) == 0 and t.shared_bytes(dim) <= caps.shared_memory)


def sg_tiles(caps: "Capabilities", dim: int) -> SgTiles | None:
    """The first SG_SHAPES entry the device can run at head dim `dim` (sg_fits), if any."""
    return next((t for t in SG_SHAPES if sg_fits(caps, dim, t)), None)


def rows_flash_possible(caps: "Capabilities", dim: int) -> bool:
    """Whether the device can run the subgroup-rows kernel at head dim `dim`: 16×16×16 f16 matrices,
    the kernel usable, and an SG_SHAPES entry that fits."""
    return (has_coopmat_16(caps) and kernel(f"{SG_KERNEL}_f16").usable(caps) and sg_tiles(caps, dim) is not None
            and kernel(f"{SG_KERNEL}_f16").workgroup(caps) == SG_WG)


LIST_SHAPES = (CmTiles(16, 16, 4), CmTiles(16, 16, 8), CmTiles(16, 32, 4), CmTiles(16, 32, 8), CmTiles(32, 16, 4),
               CmTiles(32, 32, 4))
"""Shapes of the coopmat kernel for row lists (a query tile of one token: its G q heads padded to BR
rows), in order of preference: 16 rows (G ≤ 16), then 32 where a softmax row's 16 invocations would
not fit a subgroup (or G > 16); in each, as the H200 ranked them for 512 queries of GQA 12 at depth
32768 (W = 2051, Dh 256, f16; one run each, `vkflash bench kernels --only attn_prefill`): 16x16/4
1.51 ms, 16x16/8 1.53, 16x32/4 1.54, 16x32/8 1.68, 32x16/4 2.15, 32x32/4 2.20."""


def list_fits(caps: "Capabilities", dim: int, G: int, t: CmTiles) -> bool:
    """Whether shape t holds a token's G q heads and the device runs it at head dim `dim` (cm_fits)."""
    return t.br >= G and cm_fits(caps, dim, t)


def list_tiles(caps: "Capabilities", dim: int, G: int) -> CmTiles | None:
    """The first LIST_SHAPES (then CM_SHAPES: up to 64 rows) entry that list_fits, if any."""
    return next((t for t in LIST_SHAPES + CM_SHAPES if list_fits(caps, dim, G, t)), None)


def has_coopmat_16(caps: "Capabilities") -> bool:
    """Whether the device offers 16×16×16 f16·f16 + f32 cooperative matrices (the coopmat kernel's)."""
    return any((s.m, s.n, s.k, s.a, s.b, s.c, s.result) == (16, 16, 16, "f16", "f16", "f32", "f32")
               for s in caps.coopmat)


def coopmat_flash_possible(caps: "Capabilities", dim: int) -> bool:
    """Whether the device can run the coopmat flash kernel at head dim `dim`: 16×16×16 f16 matrices,
    the kernel usable, and a CM_SHAPES entry that fits."""
    return (has_coopmat_16(caps) and kernel(f"{CM_KERNEL}_f16").usable(caps) and cm_tiles(caps, dim) is not None
            and kernel(f"{CM_KERNEL}_f16").workgroup(caps) == CM_WG)


ROWS_DIMS = (256,)
"""Head dims at which dense prefill defaults to the subgroup-rows kernel: where the H200 measured it
faster (512 × 33k keys, 2 splits, vs the split-head-dim kernel at 1 as the engine ran it: Qwen3-Next
16/2 heads f16 48.7 vs 45.3 TFLOP/s, q8_0 46.8 vs 37.7; 24/2 heads f16 37.5 vs 34.9)."""
ROWS_SPLITS = 2
"""KV splits of the subgroup-rows kernel's prefill by default: its 128-row workgroups are too few to
fill a GPU otherwise (25.3 TFLOP/s at 1 split in the measurement above)."""


def flash_kind(g: "Graph", T: int, dim: int, cache: CacheType, gathered: bool = False) -> Flash:
    """The default kernel for T query tokens over a cache of type `cache`: for prefill
    (T ≥ COOPMAT_MIN_TOKENS) of f16 / q8_0 caches where the graph's options allow matrices
    (VKFLASH_FA_COOPMAT), the subgroup-rows kernel for dense attention at ROWS_DIMS where
    rows_flash_possible (unless VKFLASH_FA_ROWS=0), else the split-head-dim coopmat kernel where
    coopmat_flash_possible (gathered QSA prefill too: the subgroup-rows kernel was not faster there);
    else scalar. f32 caches stay scalar (as F32 weights keep the f32 GEMM): rounding them to f16 would
    undo what f32 storage is for."""
    if T >= COOPMAT_MIN_TOKENS and cache is not CacheType.F32 and g.options.fa_coopmat:
        if g.options.fa_rows and not gathered and dim in ROWS_DIMS and rows_flash_possible(g.gpu.caps, dim):
            return Flash.ROWS
        if coopmat_flash_possible(g.gpu.caps, dim):
            return Flash.COOPMAT
    return Flash.SCALAR


SPLIT_MAX_TOKENS = 8
"""Steps of at most this many tokens (decode, MTP verify) use flash-decode (split KV + combine)."""


def decode_splits(n_ctx: int) -> int:
    """Flash-decode splits for a cache of n_ctx positions: about one per 128, at most 64 (× kv heads
    workgroups: about one wave on a GPU of 100+ compute units; 16 left the H200 idle)."""
    return max(1, min(64, -(-n_ctx // 128)))


def check_attention(name: str, params: Buffer, param_off: int, q: Heads, k: Cache, v: Cache, out: Heads,
                    gate: Heads | None, mask: CellMask | None, cells: CellList | None, n_tiles: int = 1) -> None:
    """Shapes of an attention call agree and every operand covers what the kernels read (n_tiles query
    tiles: as many (p0, n_kv) params and cell lists)."""
    T, H, Dh, H_kv = q.n_tokens, q.n_heads, q.dim, k.n_heads
    if (v.n_heads, v.dim, v.type, v.n_ctx) != (H_kv, k.dim, k.type, k.n_ctx) or k.dim != Dh:
        raise ValueError(f"{name}: K {k.n_heads}x{k.dim} {k.type.value} [{k.n_ctx}], V {v.n_heads}x{v.dim} "
                         f"{v.type.value} [{v.n_ctx}] and q heads of {Dh} must agree")
    if H % H_kv:
        raise ValueError(f"{name}: {H} q heads are not a multiple of {H_kv} kv heads")
    if (out.n_tokens, out.n_heads, out.dim) != (T, H, Dh):
        raise ValueError(f"{name}: output is {out.n_tokens}x{out.n_heads}x{out.dim}, needs {T}x{H}x{Dh}")
    if gate is not None and (gate.n_tokens, gate.n_heads, gate.dim) != (T, H, Dh):
        raise ValueError(f"{name}: gate is {gate.n_tokens}x{gate.n_heads}x{gate.dim}, needs {T}x{H}x{Dh}")
    if 4 * (param_off + 2 * n_tiles) > params.nbytes:
        raise ValueError(f"{name}: params [{param_off}, {param_off + 2 * n_tiles}) overflow the params buffer")
    if mask is not None:
        slots = cells.capacity if cells is not None else k.n_ctx
        if mask.stride * 32 < slots or 4 * (mask.off + T * mask.stride) > mask.buf.nbytes:
            raise ValueError(f"{name}: mask rows of {mask.stride} words do not cover {slots} slots x {T} queries")
    if cells is not None and 4 * (cells.off + n_tiles * cells.capacity) > cells.buf.nbytes:
        raise ValueError(f"{name}: {n_tiles} cell list(s) of {cells.capacity} overflow their buffer")


def attention(g: "Graph", params: Buffer, param_off: int, q: Heads, k: Cache, v: Cache, out: Heads, *,
              gate: Heads | None = None, mask: CellMask | None = None, cells: CellList | None = None,
              tile: int = 0, n_split: int | None = None, partial: Buffer | None = None,
              kind: Flash | None = None, row_lists: bool = False, dense_head: DenseHead | None = None,
              name: str = "attn") -> None:
    """(A5)–(A7) out[t, h] = softmax_j((q_{t,h}·k_{j,g})/√Dh + M_t[j]) · v_{j,g} (⊙ σ(gate_{t,h}) if
    gate), g = ⌊h/(H/H_kv)⌋, for queries at positions p0 + t with p0 = params[param_off] and
    n_kv = params[param_off + 1] keys (or list slots). M is causal, ∩ `mask` when given; `cells`
    gathers keys by position list. `tile` > 0 (with `cells`): queries in tiles of `tile`, tile k with
    its own (first position, count) at params[param_off + 2k …] and list at cells.off + k·capacity, all
    in one dispatch (S2–S3 over qsa_union's tiles). `row_lists` (with `cells`): every query its own
    list (at cells.off + t·capacity) and params (its position, count at param_off + 2t): a prefill's
    per-query QSA selections, as query tiles of one token on the coopmat kernel (list_tiles, KV splits by
    attn_decode.key_splits unless given) where the flash prefill would take matrices (VKFLASH_FA_COOPMAT) or `kind`
    asks for it, else on the decode kernel; on the coopmat kernel in one split, the queries before
    `dense_head`.end take the dense causal kernel instead (VKFLASH_QSA_DENSE_HEAD). Steps of ≤ 8
    queries in one tile run on the decode kernel (ops/attn_decode.py, its own split count, at most what
    a given `partial` holds) unless VKFLASH_ATTN_DECODE=0 or a flash `kind` is asked for; else
    flash_attention()."""
    from vkflash.gpu.ops import attn_decode as dec

    if row_lists:
        if kind not in (None, Flash.COOPMAT):
            raise ValueError(f"{name}: row lists run on the coopmat flash kernel or the decode kernel, "
                             f"not {kind.value}")
        if cells is None or mask is not None:
            raise ValueError(f"{name}: row lists need a cell list per token and no mask")
        T, H, Dh = q.n_tokens, q.n_heads, q.dim
        shape = list_tiles(g.gpu.caps, Dh, H // k.n_heads)
        if (kind or flash_kind(g, T, Dh, k.type, gathered=True)) is Flash.COOPMAT and shape is not None:
            if n_split is None:
                room = partial.nbytes // partial_bytes(T, H, Dh, 1) if partial is not None else None
                n_split = dec.key_splits(g.gpu.caps, T * k.n_heads, cells.capacity, shape.bc, room)
            lo = 0
            if dense_head is not None and n_split == 1 and g.options.qsa_dense_head:
                flash_attention(g, dense_head.params, dense_head.off, q, k, v, out, gate=gate, n_split=1,
                                positions=(0, dense_head.end), name=f"{name}.dense")
                lo = dense_head.end
            flash_attention(g, params, param_off, q, k, v, out, gate=gate, cells=cells, tile=1, n_split=n_split,
                            partial=partial, kind=Flash.COOPMAT, shape=shape,
                            positions=(lo, ALL_POSITIONS), name=name)
        elif kind is Flash.COOPMAT:
            raise ValueError(f"{name}: {g.gpu.caps.name} has no coopmat shape for row lists of {H // k.n_heads} "
                             f"q heads per kv head at head dim {Dh}")
        else:
            dec.attn_decode(g, params, param_off, q, k, v, out, gate=gate, cells=cells, partial=partial,
                            n_split=n_split, row_lists=True, name=name)
        return
    if tile and -(-q.n_tokens // tile) == 1:
        tile = 0  # one tile: an ordinary call with its params and list
    if (not tile and kind is None and q.n_tokens <= dec.MAX_TOKENS and g.options.attn_decode
            and dec.supported(g.gpu.caps, q.n_tokens, q.n_heads, k.n_heads, q.dim, k.type)):
        dec.attn_decode(g, params, param_off, q, k, v, out, gate=gate, mask=mask, cells=cells, partial=partial,
                        name=name)
    else:
        flash_attention(g, params, param_off, q, k, v, out, gate=gate, mask=mask, cells=cells, tile=tile,
                        n_split=n_split, partial=partial, kind=kind, name=name)


def row_lists_possible(g: "Graph", T: int, H: int, H_kv: int, dim: int, cache: CacheType) -> bool:
    """Whether attention(row_lists=True) runs T queries of this shape here (the coopmat flash with a
    list tile shape, else the decode kernel); where not, a graph gathers through per-tile unions."""
    from vkflash.gpu.ops import attn_decode as dec

    coopmat = (flash_kind(g, T, dim, cache, gathered=True) is Flash.COOPMAT
               and list_tiles(g.gpu.caps, dim, H // H_kv) is not None)
    return coopmat or dec.supported(g.gpu.caps, T, H, H_kv, dim, cache, row_lists=True)


def flash_attention(g: "Graph", params: Buffer, param_off: int, q: Heads, k: Cache, v: Cache, out: Heads, *,
                    gate: Heads | None = None, mask: CellMask | None = None, cells: CellList | None = None,
                    tile: int = 0, n_split: int | None = None, partial: Buffer | None = None,
                    kind: Flash | None = None, shape: CmTiles | SgTiles | None = None,
                    positions: tuple[int, int] = (0, ALL_POSITIONS), name: str = "attn") -> None:
    """attention() on a flash kernel whatever the number of queries (the plain decode path): `kind`
    (default flash_kind(...)), in `shape` (coopmat: a CmTiles, default cm_tiles(...); rows: an SgTiles,
    default sg_tiles(...); benches and tests override them). n_split (default: flash-decode splits for
    steps of at most SPLIT_MAX_TOKENS tokens, else 1) > 1 adds a combine dispatch; its partials go to
    `partial` (default: an intermediate of the graph; the subgroup-rows kernel's prefill default is
    ROWS_SPLITS). Only queries at positions in [lo, hi) = `positions` are computed and written (the
    rest of `out` is left as it is): lo > 0 needs tiles of one query, and either bound one split."""
    T, H, Dh, H_kv = q.n_tokens, q.n_heads, q.dim, k.n_heads
    kind = flash_kind(g, T, Dh, k.type, cells is not None) if kind is None else kind
    if n_split is None:
        n_split = decode_splits(k.n_ctx) if T <= SPLIT_MAX_TOKENS else ROWS_SPLITS if kind is Flash.ROWS else 1
    if n_split > 1 and partial is None:
        partial = g.temp(partial_bytes(T, H, Dh, n_split), f"{name}.partial")
    if tile < 0 or (tile and cells is None):
        raise ValueError(f"{name}: query tiles (tile={tile}) need a cell list per tile")
    n_tiles = -(-T // tile) if tile else 1
    check_attention(name, params, param_off, q, k, v, out, gate, mask, cells, n_tiles)
    if n_split < 1:
        raise ValueError(f"{name}: n_split must be ≥ 1, got {n_split}")
    split = n_split > 1
    if split and (partial is None or partial.nbytes < partial_bytes(T, H, Dh, n_split)):
        raise ValueError(f"{name}: n_split={n_split} needs a partial buffer of {partial_bytes(T, H, Dh, n_split)} B")
    lo, hi = positions
    if not 0 <= lo <= hi <= ALL_POSITIONS or (lo > 0 and tile != 1) or ((lo, hi) != (0, ALL_POSITIONS) and split):
        raise ValueError(f"{name}: positions [{lo}, {hi}) need 0 ≤ lo ≤ hi, tiles of one query when lo > 0, "
                         "and one split (the combine writes every row)")

    caps = g.gpu.caps
    G, TQ = H // H_kv, tile or T
    flags = (1 if gate is not None and not split else 0) | (2 if mask else 0) | (4 if cells else 0) | (8 if split else 0)
    spec: SpecConstants
    if kind is Flash.SCALAR:
        kname = f"attn_flash_{k.type.value}"
        br, bc = flash_tiles(Dh, TQ * G, caps.shared_memory)
        spec = FlashSpec(Dh, br, bc, flags)
    elif kind is Flash.COOPMAT:
        kname = f"{CM_KERNEL}_{k.type.value}"
        cm = _runnable(name, caps, Dh, shape or cm_tiles(caps, Dh), CmTiles, cm_fits, coopmat_flash_possible, "coopmat")
        br, bc = cm.br, cm.bc
        spec = FlashCmSpec(Dh, br, bc, flags, cm.workers)
    else:
        kname = f"{SG_KERNEL}_{k.type.value}"
        st = _runnable(name, caps, Dh, shape or sg_tiles(caps, Dh), SgTiles, sg_fits, rows_flash_possible,
                       "subgroup-rows")
        br, bc = st.br, st.bc
        spec = FlashSgSpec(Dh, br, bc, flags, st.prefetch)
    gv = gate if gate is not None else q
    bufs = [params, q.rows.buf, gv.rows.buf, k.buf, v.buf, mask.buf if mask else k.buf,
            cells.buf if cells else k.buf, k.buf if split else out.rows.buf, partial if split else k.buf]
    push = FlashPush(T, G, H_kv, k.n_ctx, q.off, q.rows.stride, q.head_stride, gv.off, gv.rows.stride,
                     gv.head_stride, out.off, out.rows.stride, out.head_stride, param_off, mask.off if mask else 0,
                     mask.stride if mask else 0, cells.off if cells else 0, n_split,
                     1.0 / np.sqrt(Dh), TQ, 2 if tile else 0,
                     cells.capacity if tile and cells else 0, lo, hi)
    # a graph is recorded once for every position, so its cost is sized for the most keys it may see
    n_keys = cells.capacity if cells is not None else min(k.n_ctx, hi)  # positions < hi see keys < hi
    kv_bytes = 2 * n_tiles * n_keys * H_kv * k.type.row_bytes(Dh)
    g.dispatch(kname, bufs, [n_tiles * -(-TQ * G // br), H_kv, n_split], push=push, spec=spec,
               writes=[8 if split else 7], name=name,
               desc=f"T={T} H={H}/{H_kv} Dh={Dh} {k.type.value} split={n_split} {kind.value}"
               + (f" tiles={n_tiles}x{TQ}" * (tile > 1)) + (" row lists" * (tile == 1))
               + (" gated" * (gate is not None))
               + (" masked" * (mask is not None)) + (" gather" * (cells is not None))
               + (f" positions {lo}..{hi}" if hi < ALL_POSITIONS else f" positions {lo}.." if lo else ""),
               nbytes=kv_bytes, flops=4 * T * H * Dh * n_keys)
    if split:
        g.dispatch("attn_combine", [partial, gv.rows.buf, out.rows.buf], [H, T],
                   push=AttnCombinePush(T, H, n_split, gv.off, gv.rows.stride, gv.head_stride,
                                        out.off, out.rows.stride, out.head_stride),
                   spec=AttnCombineSpec(Dh, gate is not None), name=f"{name}.combine",
                   desc=f"T={T} H={H} split={n_split}",
                   nbytes=partial_bytes(T, H, Dh, n_split))


T_ = TypeVar("T_")


def _runnable(name: str, caps: "Capabilities", Dh: int, tiles: object, kind: type[T_],
              fits: Callable[["Capabilities", int, T_], bool], possible: Callable[["Capabilities", int], bool],
              label: str) -> T_:
    """`tiles` when it is a `kind` shape the device runs at head dim Dh, else one ValueError."""
    if not isinstance(tiles, kind) or not fits(caps, Dh, tiles) or not possible(caps, Dh):
        raise ValueError(f"{name}: {caps.name} cannot run the {label} flash kernel at head dim {Dh}"
                         + (f" in shape {tiles}" if tiles else ""))
    return tiles


def partial_bytes(T: int, H: int, dim: int, n_split: int) -> int:
    """Size of the split-KV partials: (o[dim], m, l) f32 per split, token and q head."""
    return 4 * n_split * T * H * (dim + 2)
