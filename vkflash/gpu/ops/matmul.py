"""Quantized matmul y[n, r] = epilogue(Σ_k W[r, k]·x[n, k]): GEMV, transposed GEMV, tiled GEMM.

W ∈ R^{out×K} is a GGML tensor {K, out} uploaded raw (shaders/common/quant.glsl decodes it);
x and y are f32 row views (one row per token). `matmul()` picks the kernel from the shapes:
  n_out ≤ 8 and n_tok > 8 → GEMV over the tokens (transposed; the HC inject projection W_inj),
  n_tok ≤ 8              → GEMV (decode, MTP verify): the row-group GEMV (shaders/gemv.comp; teams of
                           gemv_plan's width per few rows, on 8-bit activations and integer dots with
                           VKFLASH_GEMV_Q8 where the type has them), or with VKFLASH_GEMV_TEAMS=0
                           mul_mat_vec.comp's NDEC weight rows per workgroup (also the transposed GEMV);
                           both load each weight slice once for gemv_cols' columns at a time
                           (VKFLASH_GEMV_COLS; else once per column),
  otherwise              → tiled GEMM: cooperative-matrix (f16 in, f32 accumulate) when the device
                           offers it and VKFLASH_DISABLE_COOPMAT is off, else scalar f32. F32
                           weights always take the scalar GEMM: rounding them (and x) to f16 would
                           undo what F32 storage is for (routers, MODEL.md §7.4) and moves router
                           logits by ~1e-3, enough to flip near-tied experts.
The coopmat GEMM (shaders/mul_mat_cm.comp on common/mm_cm.glsl) takes its tile (CmTile: output rows
× tokens per workgroup, warp tile), the coopmat shape and the subgroup bound as specialization
constants chosen here from the capabilities (cm_shape, cm_tile): 128×128 tiles of 8 warp tiles where
the shape and shared memory allow, smaller ones for short outputs or few tokens.
Split-K (VKFLASH_MM_SPLITK): a tiled GEMM whose grid of output tiles leaves compute units idle (the
HC down projection ℓ_pre = W_dn X: 320 rows × 512 tokens = 12 tiles of 128×128 on 132 SMs, K = 10240)
cuts K into S chunks of whole 32-groups over grid z (split_k: about SPLIT_WAVES workgroups per compute
unit); each chunk stores its raw f32 partial tile into a temp buffer [S, n_tok, n_out] and
shaders/mm_reduce.comp sums the S partials in order s = 0, 1, … (deterministic; no atomics) and
applies the epilogue through the same store. The sum's order differs from the unsplit kernel's
(within the f32 accumulation bound; the f16 rounding of coopmat inputs is the same).
The transposed GEMV (n_out ≤ 8) takes fewer tokens per workgroup at prefill sizes (tiny_tokens).
The epilogue (scale, bias, sigmoid/silu, ⊙ tensor, + residual) is applied in the store: the
fusion pass folds the eltwise ops after a matmul into it (Fusion.EPILOGUE); an explicit epilogue
with that fusion off runs as separate eltwise dispatches. An expert stack {K, out, E} is addressed
by QWeight.row0 = e·out (see shaders/mul_mat_vec.comp). Two fused decode GEMVs (n_tok ≤ 8), made
by the fusion pass, combine stacked row blocks in the store, one dispatch each: `GluGemv`
(silu(gate) ⊙ up of a stacked [gate; up] weight) and `HcMixGemv` (the hyper-connection up
projection with hc_pre before it and hc_mix after it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Literal

from gguf import GGMLQuantizationType as Q

from vkflash.formats.quant_blocks import row_bytes
from vkflash.gpu.graph import Node
from vkflash.gpu.interface import PushConstants, SpecConstants, boolean, f32, u32
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops import eltwise
from vkflash.gpu.ops.views import Rows, check_alias
from vkflash.gpu.options import Fusion
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.device import Capabilities, CoopmatShape
    from vkflash.gpu.graph import Graph

TYPES: tuple[Q, ...] = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
"""Weight types every matmul kernel decodes (one #define variant each)."""
COOPMAT_TYPES: tuple[Q, ...] = tuple(t for t in TYPES if t != Q.F32)
"""Weight types with a cooperative-matrix GEMM (see the module docstring for F32)."""

GEMV_WG = 64  # invocations of a GEMV workgroup
GEMV_ROWS: dict[Q, int] = {Q.F32: 2, Q.F16: 4, Q.BF16: 4}
"""Weight rows per GEMV workgroup (NDEC; their slices' loads are in flight together): fewer for
wide raw slices (F32: 32 registers a row); GEMV_ROWS_QUANT for every block-quantized type."""
GEMV_ROWS_QUANT = 8
GEMV_K_QUANTS: tuple[Q, ...] = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
"""K-quant GEMVs decode more per slice: 128 invocations × 4 rows measured 1.0–1.35× of 64 × 8 on
the H200 (Q6_K LM head 887 → 1193 GB/s), so they get GEMV_WG_K and GEMV_ROWS_K."""
GEMV_WG_K, GEMV_ROWS_K = 128, 4
GEMV_MIN_GROUPS = 128  # fewer rows per workgroup for short outputs, so a GEMV fills the GPU
GEMV_ROWS_CPU = 2  # CPU drivers (lavapipe): LLVM compile time grows with NDEC, speed is moot
GEMV_STACK_ROWS_CPU = 4  # fused-mode GEMV rows there: 2 output rows per block (GLU, hc = 2) for the tests to cover
GEMV_MAX_COLS = 8  # token columns of one GEMV (gemv_cols of them per pass over the weights)
GEMV_COLS_CPU = 1
"""Columns per pass on CPU drivers (lavapipe): LLVM's compile time grows with the unrolled columns × rows
(8 columns: ~10× one), speed is moot; the tests raise it to cover the multi-column passes."""
TINY_OUT = 8  # outputs at most this many rows go through the transposed GEMV
TINY_TOKENS = 8  # most tokens per workgroup of the transposed GEMV
TINY_GROUPS = 512
"""Workgroups the transposed GEMV aims for (fewer tokens each: 8 per workgroup left 64 of 64 lanes on
132 SMs at 512 tokens, ~0.1 ms for the HC inject's 4×10240 on the H200)."""
TILE = 64  # scalar GEMM tile: 64 weight rows × 64 tokens
CM_WG = 256
"""Invocations of a coopmat GEMM workgroup: 8 subgroups of 32 (on a device whose subgroups may be
64 wide, 4 subgroups that own two warp tiles each). Half fetch weights, half activations."""
CM_BK = 32  # k per pipeline step of the coopmat GEMMs: one 32-element group per weight row
CM_PITCH = 80  # bytes per shared-memory row of a step: 32 f16 + 8 pad (rows hit distinct 16-B bank groups)
CM_KERNEL = "mul_mat_cm"  # kernel family of the coopmat GEMM (tests swap in an emulated build)

SPLIT_WAVES = 2  # workgroups per compute unit a split-K GEMM aims for (a tile's 8 warps: two fit an SM)
SPLIT_MIN_STEPS = 8  # fewest 32-groups per split-K chunk (each chunk pays a tile prologue and a partial store)
SPLIT_CU_GPU = 64  # compute units assumed on a GPU that does not report them
REDUCE_WG = 256  # invocations of an mm_reduce.comp workgroup (one output element each)

TEAM_WG = 128  # invocations of a row-group GEMV workgroup (gemv.comp): WG / TPR teams
TEAM_TPR_MIN = 8
"""Fewest invocations per team: a team's lanes read ≥ 8 consecutive slices (≥ 256 contiguous bytes per load)."""
TEAM_THREADS = 1 << 16
"""Invocations a row-group GEMV should spread over (memory parallelism; gemv_plan trades it against idle lanes)."""
TEAM_THREADS_CPU = 64  # CPU drivers: speed is moot, this keeps the tests' small GEMVs on varied team widths
TEAM_STACK_ROWS = 4  # weight rows a team decodes in the fused modes (GLU: 2 output rows, HC: hc blocks of 1)
TEAM_ROWS_WIDE = 4
"""Rows per team of a plain row-group GEMV of several token columns (MTP verify) on a GPU, while the
teams still span TEAM_THREADS / 2 invocations: each x slice loaded serves 4 rows, not 2. H200, one
call, 4 rows against 2 at team_width's width, 7 columns: 1.2–1.7× faster (Q6_K LM head 1243 → 856 µs,
Q6_K / Q5_K / Q4_K 2560×12288 63 → 44, 105 → 60, 89 → 74 µs); 8 rows were 1.05–7× slower (registers).
Decode's single column keeps 2: there half the teams made whole decode steps 2–11% slower (a GEMV's
latency between barriers, not its throughput, is what counts)."""
Q8_TYPES: tuple[Q, ...] = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
"""Weight types with an integer-dot GEMV on 8-bit activations (common/quant_q8.glsl)."""
Q8_SLICE_64: tuple[Q, ...] = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # their integer-dot slices hold 64 elements (else 32)

EP_SCALE, EP_BIAS, EP_SIGMOID, EP_SILU, EP_MUL, EP_RES = 1, 2, 4, 8, 16, 32
GEMV_GLU, GEMV_HC, GEMV_MOE = 1, 2, 3  # fused modes of mul_mat_vec.comp (constant_id 6; 0 = plain)


@dataclass(frozen=True)
class MatMulPush(PushConstants):
    """common/mm.glsl's push constants: shapes, W's first row, x and y views, epilogue offsets and scale."""

    K: u32
    n_out: u32
    n_tok: u32
    w_row0: u32
    x_off: u32
    x_stride: u32
    y_off: u32
    y_stride: u32
    bias_off: u32
    mul_off: u32
    res_off: u32
    scale: f32


@dataclass(frozen=True)
class MatMulSplitPush(MatMulPush):
    """The tiled GEMMs' (mul_mat.comp, mul_mat_cm.comp): common/mm.glsl's, then the 32-groups per
    split-K chunk (K / 32 unsplit; grid z = the chunks)."""

    k_chunk: u32


@dataclass(frozen=True)
class MatMulReducePush(MatMulPush):
    """mm_reduce.comp's: common/mm.glsl's, then the number of split-K partials summed."""

    n_split: u32


@dataclass(frozen=True)
class MatVecPush(MatMulPush):
    """mul_mat_vec.comp's: common/mm.glsl's, then the fused modes' streams view and 1/hc (GEMV_HC),
    ys offset (y's row stride) and shared-gate view (GEMV_MOE)."""

    streams_off: u32 = 0
    streams_stride: u32 = 0
    inv_hc: f32 = 1.0
    ys_off: u32 = 0
    gate_off: u32 = 0
    gate_stride: u32 = 0


@dataclass(frozen=True)
class MatMulSpec(SpecConstants):
    """common/mm.glsl's epilogue flags (EP_*): all the scalar GEMM has."""

    epilogue: u32


@dataclass(frozen=True)
class MatMulCmSpec(MatMulSpec):
    """mul_mat_cm.comp's (common/mm_cm.glsl): the epilogue, the cooperative-matrix shape, the largest
    subgroup size and the tile (cm_spec)."""

    tm: u32
    tn: u32
    tk: u32
    sg_max: u32
    bm: u32
    bn: u32
    wm: u32
    wn: u32


@dataclass(frozen=True)
class MatVecSpec(MatMulSpec):
    """mul_mat_vec.comp's: the epilogue, rows and columns per workgroup, layout, smallest subgroup
    size, then the fused mode (GEMV_*; 0 plain) with its hc and top-k, and the columns per pass."""

    ndec: u32
    nplain: u32
    transposed: boolean
    sg_min: u32
    mode: u32 = 0
    hc: u32 = 1
    topk: u32 = 1
    ncol: u32 = 1


@dataclass(frozen=True)
class GemvSpec(MatMulSpec):
    """gemv.comp's: the epilogue, invocations per team, weight rows per team, columns, smallest
    subgroup size, then the fused mode (GEMV_*; 0 plain) with its hc and top-k, the columns per pass,
    and whether weights are decoded once for all columns (VKFLASH_GEMV_DEQ)."""

    tpr: u32
    nr: u32
    nplain: u32
    sg_min: u32
    mode: u32 = 0
    hc: u32 = 1
    topk: u32 = 1
    ncol: u32 = 1
    deq: u32 = 1


@dataclass(frozen=True)
class GemvQ8Spec(GemvSpec):
    """gemv.comp's integer-dot variant (Q8X): GemvSpec's, then the shared x capacity kq (= K)."""

    kq: u32 = 32


def _kernels() -> list[Kernel]:
    out = []
    for t in TYPES:
        d = (("QTYPE", int(t)),)
        out.append(Kernel(f"gemv_{t.name.lower()}", "gemv.comp", 9, d, local_size=TEAM_WG, push=MatVecPush,
                          spec=GemvSpec))
        if t in Q8_TYPES:
            out.append(Kernel(f"gemv_q8_{t.name.lower()}", "gemv.comp", 9, d + (("Q8X", 1),), local_size=TEAM_WG,
                              needs=frozenset({"int_dot"}), push=MatVecPush, spec=GemvQ8Spec))
        out.append(Kernel(f"mul_mat_vec_{t.name.lower()}", "mul_mat_vec.comp", 9, d,
                          local_size=GEMV_WG_K if t in GEMV_K_QUANTS else GEMV_WG, push=MatVecPush, spec=MatVecSpec))
        out.append(Kernel(f"mul_mat_{t.name.lower()}", "mul_mat.comp", 6, d, local_size=256,
                          push=MatMulSplitPush, spec=MatMulSpec))
        if t in COOPMAT_TYPES:
            out.append(Kernel(f"mul_mat_cm_{t.name.lower()}", "mul_mat_cm.comp", 6, d, local_size=CM_WG,
                              needs=frozenset({"coopmat_f16"}), push=MatMulSplitPush, spec=MatMulCmSpec))
    out.append(Kernel("mm_reduce", "mm_reduce.comp", 6, local_size=REDUCE_WG, push=MatMulReducePush, spec=MatMulSpec))
    return out


KERNELS = _kernels()


@dataclass(frozen=True)
class QWeight:
    """W ∈ R^{n_out×k} stored raw as GGML `qtype` rows of k elements, starting at row `row0` of `buf`."""

    buf: Buffer
    qtype: int
    k: int
    n_out: int
    row0: int = 0

    def __post_init__(self) -> None:
        q = Q(self.qtype)
        if q not in TYPES:
            raise ValueError(f"matmul: weight type {q.name} not supported (have {', '.join(t.name for t in TYPES)})")
        if self.k % 32 or self.k < 32:
            raise ValueError(f"matmul: row length {self.k} of {q.name} weight must be a multiple of 32")
        need = (self.row0 + self.n_out) * row_bytes(q, self.k)
        if self.n_out < 1 or need > self.buf.nbytes:
            raise ValueError(f"matmul: {q.name} weight rows {self.row0}..{self.row0 + self.n_out} of {self.k} "
                             f"need {need} B, buffer {self.buf.name!r} has {self.buf.nbytes} B")

    @property
    def type_name(self) -> str:
        return Q(self.qtype).name.lower()

    @property
    def nbytes(self) -> int:
        return self.n_out * row_bytes(Q(self.qtype), self.k)


@dataclass(frozen=True)
class Epilogue:
    """y = ((act(scale·acc + bias[r])) ⊙ mul[n, r]) + res[n, r]; each part optional.

    bias is one row of n_out; mul and res have y's shape (res may be y itself: in-place residual).
    """

    scale: float | None = None
    bias: Rows | None = None
    act: Literal["", "sigmoid", "silu"] = ""
    mul: Rows | None = None
    res: Rows | None = None

    @property
    def flags(self) -> int:
        return ((EP_SCALE if self.scale is not None else 0) | (EP_BIAS if self.bias is not None else 0)
                | {"": 0, "sigmoid": EP_SIGMOID, "silu": EP_SILU}[self.act]
                | (EP_MUL if self.mul is not None else 0) | (EP_RES if self.res is not None else 0))


PLAIN = Epilogue()


@dataclass(frozen=True)
class CmTile:
    """A coopmat GEMM workgroup tile: bm output rows (per weight block) × bn tokens, cut into warp
    tiles of wm × wn (spec constants 6–9 of common/mm_cm.glsl)."""

    bm: int
    bn: int
    wm: int
    wn: int

    @property
    def warp_tiles(self) -> int:
        return (self.bm // self.wm) * (self.bn // self.wn)

    def smem(self, tn: int, nb: int = 1) -> int:
        """Shared bytes: two pipeline stages of nb·bm weight rows and bn tokens, or the epilogue
        staging (a wm × tn f32 block per warp tile) where that is larger."""
        return max(2 * (nb * self.bm + self.bn) * CM_PITCH, 4 * self.warp_tiles * self.wm * tn)

    def valid(self, shape: "CoopmatShape") -> bool:
        """Whether the tile is made of whole warp tiles and coopmat tiles of this shape."""
        return (self.bm % self.wm == 0 and self.bn % self.wn == 0 and self.wm % shape.m == 0
                and self.wn % shape.n == 0)

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}/{self.wm}x{self.wn}"


CM_TILES: tuple[CmTile, ...] = (CmTile(128, 128, 64, 32), CmTile(128, 64, 32, 32), CmTile(64, 128, 32, 32),
                                CmTile(64, 64, 32, 16))
"""Dense coopmat tiles, 8 warp tiles each, largest first (40 / 30 / 30 / 20 KiB of shared memory)."""


def cm_shape(caps: "Capabilities") -> "CoopmatShape | None":
    """The device's f16×f16→f32 coopmat shape the coopmat GEMMs use: the largest M·N·K whose K divides
    the 32-wide step in 16-byte pieces (K % 8 == 0) and whose M keeps the f32 staging 16-byte aligned."""
    ok = [s for s in caps.coopmat if (s.a, s.b, s.c, s.result) == ("f16", "f16", "f32", "f32")
          and s.k % 8 == 0 and CM_BK % s.k == 0 and s.m % 4 == 0 and s.m <= 16 and s.n <= 16]
    return max(ok, key=lambda s: (s.m * s.n * s.k, s.m), default=None)


def cm_sg_max(caps: "Capabilities") -> int:
    """The largest subgroup size the device may run a coopmat GEMM with (the shaders' SG_MAX)."""
    return max(caps.subgroup_max, caps.subgroup_size, 1)


def cm_tile(caps: "Capabilities", n_out: int, n_tok: int) -> CmTile | None:
    """The dense coopmat tile for this GEMM: 128-wide sides where n_out / n_tok exceed 64, else 64;
    the largest such tile that fits the shape and shared memory (then any that does)."""
    shape = cm_shape(caps)
    if shape is None:
        return None
    want = (128 if n_out > 64 else 64, 128 if n_tok > 64 else 64)
    order = sorted(CM_TILES, key=lambda t: (t.bm > want[0] or t.bn > want[1], -t.bm * t.bn))
    return next((t for t in order if t.valid(shape) and t.smem(shape.n) <= caps.shared_memory), None)


def cm_spec(caps: "Capabilities", tile: CmTile) -> list[int]:
    """Spec constants 2..9 of common/mm_cm.glsl: coopmat shape, subgroup bound, tile."""
    shape = cm_shape(caps)
    assert shape is not None
    sg = cm_sg_max(caps)
    if CM_WG % (2 * sg):
        raise ValueError(f"coopmat GEMM: subgroups of up to {sg} invocations do not split {CM_WG} into two halves")
    if not tile.valid(shape):
        raise ValueError(f"coopmat GEMM: tile {tile} is not made of {shape.m}x{shape.n} coopmat tiles")
    return [shape.m, shape.n, shape.k, sg, tile.bm, tile.bn, tile.wm, tile.wn]


def coopmat_possible(caps: "Capabilities", qtype: int) -> bool:
    """Whether GEMMs of this weight type can run on cooperative matrices on this device (never F32
    weights), whatever the options say (benchmarks compare both)."""
    if Q(qtype) not in COOPMAT_TYPES:
        return False
    k = kernel(f"mul_mat_cm_{Q(qtype).name.lower()}")
    return k.usable(caps) and cm_tile(caps, 1, 1) is not None and k.workgroup(caps) == CM_WG


def use_coopmat(gpu: "Gpu", qtype: int) -> bool:
    """Whether GEMMs of this weight type run on cooperative matrices here: possible, and the options'
    coopmat switch (VKFLASH_DISABLE_COOPMAT) on."""
    return gpu.options.coopmat and coopmat_possible(gpu.caps, qtype)


def _check(w: QWeight, x: Rows, y: Rows, ep: Epilogue) -> None:
    if x.n_cols != w.k:
        raise ValueError(f"matmul: x rows have {x.n_cols} elements, weight expects {w.k}")
    if (y.n_rows, y.n_cols) != (x.n_rows, w.n_out):
        raise ValueError(f"matmul: y is {y.n_rows}x{y.n_cols}, expected {x.n_rows}x{w.n_out}")
    if x.off % 4 or x.stride % 4:
        raise ValueError(f"matmul: x offset {x.off} and stride {x.stride} must be multiples of 4 (vec4 loads)")
    if x.buf is y.buf and x.overlaps(y):
        raise ValueError("matmul: y overlaps x")
    if ep.bias is not None and (ep.bias.n_rows, ep.bias.n_cols) != (1, w.n_out):
        raise ValueError(f"matmul: bias must be one row of {w.n_out}")
    for nm, v in (("mul", ep.mul), ("res", ep.res)):
        if v is None:
            continue
        if (v.n_rows, v.n_cols, v.stride) != (y.n_rows, y.n_cols, y.stride):
            raise ValueError(f"matmul: {nm} view must have y's shape and stride")
        if v.buf is y.buf and v.overlaps(y) and v.off != y.off:
            raise ValueError(f"matmul: {nm} partly overlaps y (in place needs the identical view)")


def tiny_tokens(n_tok: int, on: bool = True) -> int:
    """Tokens per workgroup of the transposed GEMV: TINY_TOKENS, halved while the grid has fewer
    than TINY_GROUPS workgroups (`on` off, VKFLASH_MM_SPLITK=0: always TINY_TOKENS)."""
    t = TINY_TOKENS
    while on and t > 1 and -(-n_tok // t) < TINY_GROUPS:
        t //= 2
    return t


def gemv_rows(caps: "Capabilities", qtype: int, n_out: int, cpu_rows: int = GEMV_ROWS_CPU) -> int:
    """Weight rows a mul_mat_vec.comp workgroup decodes (VKFLASH_GEMV_TEAMS=0, transposed GEMV): per
    type (cpu_rows on CPU drivers), halved while the n_out output rows would give fewer than
    GEMV_MIN_GROUPS workgroups."""
    if caps.device_type == "cpu":
        return cpu_rows
    t = Q(qtype)
    rows = GEMV_ROWS_K if t in GEMV_K_QUANTS else GEMV_ROWS.get(t, GEMV_ROWS_QUANT)
    while rows > 1 and -(-n_out // rows) < GEMV_MIN_GROUPS:
        rows //= 2
    return rows


@dataclass(frozen=True)
class GemvPlan:
    """How a row-group GEMV runs: tpr invocations per team, m output rows per team (a team decodes
    m·n_stack weight rows), on 8-bit activations or not."""

    tpr: int
    m: int
    q8: bool = False

    def kernel(self, qtype: int) -> str:
        return f"gemv_{'q8_' if self.q8 else ''}{Q(qtype).name.lower()}"

    def rows_per_group(self) -> int:
        """Output rows of one workgroup."""
        return (TEAM_WG // self.tpr) * self.m

    def __str__(self) -> str:
        return f"tpr={self.tpr} m={self.m}{' q8' if self.q8 else ''}"


def slice_elems(qtype: int, q8: bool) -> int:
    """Elements of one slice of a row-group GEMV (what one lane reads per step)."""
    return 64 if q8 and Q(qtype) in Q8_SLICE_64 else 32


def team_width(caps: "Capabilities", slices: int, rows: int) -> tuple[int, int]:
    """(tpr, nr): invocations per team and weight rows per team for rows of `slices` slices, chosen
    to spread over TEAM_THREADS invocations without idle lanes: the best of util · min(1, threads /
    TEAM_THREADS) (util = slices / (tpr · steps)), then more rows per team, then narrower teams."""
    cpu = caps.device_type == "cpu"
    target = TEAM_THREADS_CPU if cpu else TEAM_THREADS
    best: tuple[tuple[float, int, int], int, int] | None = None
    for nr in (2, 1):
        tpr = TEAM_TPR_MIN
        while tpr <= TEAM_WG:
            steps = -(-slices // tpr)
            util = slices / (tpr * steps)
            score = util * min(1.0, -(-rows // nr) * tpr / target)
            key = (round(score, 3), nr, -tpr)
            if best is None or key > best[0]:
                best = (key, tpr, nr)
            tpr *= 2
    assert best is not None
    return best[1], best[2]


def q8_possible(caps: "Capabilities", qtype: int, k: int) -> bool:
    """Whether the integer-dot GEMV can take this weight type and row length here: the device's
    integer dot product, subgroups of ≥ 2 (block halves exchange by shuffle) and shared memory for
    the quantized row (k + k/4 bytes) beside the team partials."""
    if Q(qtype) not in Q8_TYPES or k % slice_elems(qtype, True) or caps.subgroup_min < 2:
        return False
    if not kernel(f"gemv_q8_{Q(qtype).name.lower()}").usable(caps):
        return False
    return k + k // 4 + 4 * (TEAM_WG // max(1, caps.subgroup_min)) * TEAM_STACK_ROWS * 2 <= caps.shared_memory


def gemv_cols(g: "Graph", n_tok: int, smem: Callable[[int], int]) -> int:
    """Token columns a decode GEMV dots with each loaded weight slice (one pass over the weights per
    that many columns): with VKFLASH_GEMV_COLS all n_tok (GEMV_COLS_CPU at most on CPU drivers), or as
    many as the device's shared memory holds (smem(columns): the shader's bytes), spread evenly over
    the passes; without it 1 (a pass per column, the previous loop)."""
    if not g.options.gemv_cols:
        return 1
    most = min(n_tok, GEMV_COLS_CPU) if g.gpu.caps.device_type == "cpu" else n_tok
    fit = next((c for c in range(most, 0, -1) if smem(c) <= g.gpu.caps.shared_memory), 1)
    passes = -(-n_tok // fit)
    return -(-n_tok // passes)


def team_smem(caps: "Capabilities", k: int, nr: int, q8: bool, ncol: int) -> int:
    """Shared bytes of gemv.comp: the teams' subgroup partials (nr rows × ncol columns per subgroup)
    and, on 8-bit activations, ncol quantized x rows (k codes and k/32 8-byte block headers each)."""
    return 4 * (TEAM_WG // max(1, caps.subgroup_min)) * nr * ncol + (ncol * (k + k // 4) if q8 else 0)


TEAMS_SLOWER: frozenset[Q] = frozenset({Q.F16, Q.BF16, Q.Q8_0})
"""Types whose f32-activation decode GEMV reads faster on mul_mat_vec.comp than in row groups (H200,
2560x12288: F16/BF16 0.88 vs 0.67 of copy, Q8_0 0.57 vs 0.44); their integer-dot GEMV
(VKFLASH_GEMV_Q8, Q8_0 0.95) runs in row groups."""


def use_teams(g: "Graph", qtype: int, k: int) -> bool:
    """Whether a decode GEMV of this weight runs on the row-group kernel (VKFLASH_GEMV_TEAMS, and the
    faster of the two kernels for the type)."""
    if not g.options.gemv_teams:
        return False
    return Q(qtype) not in TEAMS_SLOWER or (g.options.gemv_q8 and q8_possible(g.gpu.caps, qtype, k))


def gemv_plan(g: "Graph", qtype: int, k: int, rows: int, n_stack: int = 1, tpr: int | None = None,
              m: int | None = None, n_tok: int = 1) -> GemvPlan:
    """The row-group GEMV plan for weight rows of k elements. `rows` is the row count of the plain
    GEMV(s) a fused mode replaces (GLU: F, HC: hc·d, MoE: d), so fused and plain pick the same team
    width and sum in the same order; n_stack weight blocks per output row (1 plain; on a GPU a plain
    GEMV of n_tok > 1 columns gives its teams TEAM_ROWS_WIDE rows where enough teams remain, with
    VKFLASH_GEMV_COLS). 8-bit activations where the options (VKFLASH_GEMV_Q8) ask for them and
    q8_possible; tpr and m override the choice (benches, tests)."""
    caps = g.gpu.caps
    q8 = g.options.gemv_q8 and q8_possible(caps, qtype, k)
    w, nr = team_width(caps, k // slice_elems(qtype, q8), rows)
    if n_stack > 1:
        nr = max(1, TEAM_STACK_ROWS // n_stack)
    elif n_tok > 1 and g.options.gemv_cols and caps.device_type != "cpu" and \
            -(-rows // TEAM_ROWS_WIDE) * w >= TEAM_THREADS // 2:
        nr = max(nr, TEAM_ROWS_WIDE)  # the team width (so the sums' order) stays team_width's
    plan = GemvPlan(tpr or w, m or nr, q8)
    if plan.tpr & (plan.tpr - 1) or not 1 <= plan.tpr <= TEAM_WG or plan.m < 1:
        raise ValueError(f"matmul: GEMV plan {plan} (tpr a power of two ≤ {TEAM_WG})")
    return plan


def _gemv_spec(g: "Graph", plan: GemvPlan, k: int, epilogue: int, n_tok: int, mode: int = 0, hc: int = 1,
               topk: int = 1) -> GemvSpec:
    caps = g.gpu.caps
    n_stack = 2 if mode == GEMV_GLU else (hc if mode == GEMV_HC else 1)
    nr = plan.m * n_stack
    ncol = gemv_cols(g, n_tok, lambda c: team_smem(caps, k, nr, plan.q8, c))
    args = (epilogue, plan.tpr, nr, n_tok, max(1, caps.subgroup_min), mode, hc, topk, ncol, int(g.options.gemv_deq))
    return GemvQ8Spec(*args, kq=k) if plan.q8 else GemvSpec(*args)


def _mv_spec(g: "Graph", epilogue: int, ndec: int, n_tok: int, mode: int = 0, hc: int = 1, topk: int = 1) -> MatVecSpec:
    """mul_mat_vec.comp's constants in its normal (not transposed) mode, gemv_cols columns per pass
    (its shared memory: ndec × columns subgroup partials per subgroup of a ≤ GEMV_WG_K workgroup)."""
    sg = max(1, g.gpu.caps.subgroup_min)
    ncol = gemv_cols(g, n_tok, lambda c: 4 * ndec * c * (GEMV_WG_K // sg))
    return MatVecSpec(epilogue, ndec, n_tok, False, sg, mode, hc, topk, ncol)


def _cols(ncol: int) -> str:
    """A dispatch description's note of the columns per pass (none for one)."""
    return f" cols={ncol}" if ncol > 1 else ""


def _grid(caps: "Capabilities", n: int) -> tuple[int, int]:
    """A 2-D grid of at least n workgroups (shaders fold it to x + y·groups_x)."""
    gx = min(n, caps.max_workgroup_count[0])
    return gx, -(-n // gx)


def _dispatch(g: "Graph", w: QWeight, x: Rows, y: Rows, ep: Epilogue, coopmat: bool, name: str,
              tile: CmTile | None = None, plan: GemvPlan | None = None, split: int | None = None) -> None:
    caps = g.gpu.caps
    n_tok, t = x.n_rows, w.type_name
    bias, mul, res = ep.bias, ep.mul, ep.res
    bufs = [w.buf, x.buf, (bias or x).buf, (mul or x).buf, (res or x).buf, y.buf]
    push = (w.k, w.n_out, n_tok, w.row0, x.off, x.stride, y.off, y.stride, bias.off if bias else 0,
            mul.off if mul else 0, res.off if res else 0, 1.0 if ep.scale is None else ep.scale)
    flops = 2 * w.k * w.n_out * n_tok
    desc = f"{t} {w.k}x{w.n_out} n={n_tok}"
    if n_tok <= GEMV_MAX_COLS and (plan is not None or use_teams(g, w.qtype, w.k)):
        plan = plan or gemv_plan(g, w.qtype, w.k, w.n_out, n_tok=n_tok)
        spec = _gemv_spec(g, plan, w.k, ep.flags, n_tok)
        g.dispatch(plan.kernel(w.qtype), bufs + [x.buf] * 3, _grid(caps, -(-w.n_out // plan.rows_per_group())),
                   MatVecPush(*push), spec, name=name, writes=[5], desc=f"{desc} {plan}{_cols(spec.ncol)}",
                   nbytes=w.nbytes + 4 * (x.size + y.size), flops=flops)
        return
    if n_tok <= GEMV_MAX_COLS or w.n_out <= TINY_OUT:
        tr = n_tok > GEMV_MAX_COLS
        rows = gemv_rows(caps, w.qtype, w.n_out)
        ndec, nplain = (w.n_out, tiny_tokens(n_tok, g.options.mm_splitk)) if tr else (rows, n_tok)
        groups = _grid(caps, -(-(n_tok if tr else w.n_out) // (nplain if tr else ndec)))
        spec = MatVecSpec(ep.flags, ndec, nplain, tr, max(1, caps.subgroup_min)) if tr else \
            _mv_spec(g, ep.flags, ndec, n_tok)
        g.dispatch(f"mul_mat_vec_{t}", bufs + [x.buf] * 3, groups, MatVecPush(*push), spec, name=name, writes=[5],
                   desc=f"{desc}{_cols(spec.ncol)}", nbytes=w.nbytes + 4 * (x.size + y.size), flops=flops)
        return
    if coopmat:
        shape, tile = cm_shape(caps), tile or cm_tile(caps, w.n_out, n_tok)
        if shape is None or tile is None or tile.smem(shape.n) > caps.shared_memory:
            raise ValueError(f"matmul: no coopmat tile {tile or ''} fits {caps.name}")
        if kernel(f"{CM_KERNEL}_{t}").workgroup(caps) != CM_WG:
            raise ValueError(f"matmul: the coopmat GEMM needs {CM_WG} invocations per workgroup")
        kname, bm, bn, spec = f"{CM_KERNEL}_{t}", tile.bm, tile.bn, MatMulCmSpec(0, *cm_spec(caps, tile))
        desc += f" cm {tile}"
    else:
        if kernel(f"mul_mat_{t}").workgroup(caps) != 256:
            raise ValueError("matmul: the scalar GEMM needs 256 invocations per workgroup")
        kname, bm, bn, spec = f"mul_mat_{t}", TILE, TILE, MatMulSpec(0)
    grid = (-(-w.n_out // bm), -(-n_tok // bn))
    n_split, k_chunk = split_chunks(w.k, split) if split is not None else \
        split_k(caps, grid[0] * grid[1], w.k, g.options.mm_splitk)
    nbytes = w.nbytes + 4 * (x.size + y.size)
    if n_split == 1:
        g.dispatch(kname, bufs, grid, MatMulSplitPush(*push, k_chunk), replace(spec, epilogue=ep.flags), name=name,
                   desc=desc, nbytes=nbytes, flops=flops)
        return
    # split-K: raw partial tiles [S, n_tok, n_out] (EPILOGUE 0), then mm_reduce sums them in order and stores y
    plane = n_tok * w.n_out
    part = g.temp(4 * n_split * plane, f"{name}.splitk")
    push_p = (w.k, w.n_out, n_tok, w.row0, x.off, x.stride, 0, w.n_out, 0, 0, 0, 1.0)
    g.dispatch(kname, [w.buf, x.buf, x.buf, x.buf, x.buf, part], grid + (n_split,), MatMulSplitPush(*push_p, k_chunk),
               spec, name=name, desc=f"{desc} split={n_split}x{32 * k_chunk}",
               nbytes=nbytes + 4 * n_split * plane, flops=flops)
    g.dispatch("mm_reduce", [part, part] + bufs[2:], _grid(caps, -(-plane // REDUCE_WG)),
               MatMulReducePush(*push, n_split), MatMulSpec(ep.flags), name=name,
               desc=f"{t} reduce {n_split}x{n_tok}x{w.n_out}", nbytes=4 * (n_split * plane + y.size))


def split_chunks(k: int, n_split: int) -> tuple[int, int]:
    """(S, k_chunk) for rows of k cut into about n_split chunks of whole 32-groups, none empty:
    k_chunk = ⌈(k/32) / n_split⌉ groups, S = ⌈(k/32) / k_chunk⌉ (S = 1: the whole row)."""
    gpr = k // 32
    chunk = -(-gpr // max(1, min(n_split, gpr)))
    return -(-gpr // chunk), chunk


def split_k(caps: "Capabilities", groups: int, k: int, on: bool = True) -> tuple[int, int]:
    """(S, k_chunk): the split-K of a tiled GEMM whose grid has `groups` workgroups, over rows of k.
    Only a grid that leaves compute units idle (groups < CUs) is split: into enough chunks for about
    SPLIT_WAVES workgroups per CU, each at least SPLIT_MIN_STEPS 32-groups long. Never with `on`
    off (VKFLASH_MM_SPLITK=0) nor on CPU drivers (speed is moot; tests ask for splits themselves)."""
    cu = caps.compute_units or (0 if caps.device_type == "cpu" else SPLIT_CU_GPU)
    if not on or groups >= cu:
        return split_chunks(k, 1)
    return split_chunks(k, min(-(-SPLIT_WAVES * cu // groups), k // 32 // SPLIT_MIN_STEPS))


def _plain_epilogue(g: "Graph", tmp: Rows, y: Rows, ep: Epilogue, name: str) -> None:
    """The epilogue as separate eltwise dispatches on tmp (in place), the last one writing y."""
    steps: list[Callable[[Rows, Rows], None]] = []
    if ep.scale is not None:
        steps.append(lambda a, o: eltwise.scale(g, a, ep.scale, o, name=f"{name}.scale"))
    if ep.bias is not None:
        steps.append(lambda a, o: eltwise.add(g, a, ep.bias, o, name=f"{name}.bias"))
    if ep.act == "sigmoid":
        steps.append(lambda a, o: eltwise.sigmoid(g, a, o, name=f"{name}.sigmoid"))
    if ep.act == "silu":
        steps.append(lambda a, o: eltwise.silu(g, a, o, name=f"{name}.silu"))
    if ep.mul is not None:
        steps.append(lambda a, o: eltwise.mul(g, a, ep.mul, o, name=f"{name}.mul"))
    if ep.res is not None:
        steps.append(lambda a, o: eltwise.add(g, a, ep.res, o, name=f"{name}.res"))
    for i, step in enumerate(steps):
        step(tmp, y if i == len(steps) - 1 else tmp)


@dataclass(frozen=True)
class MatMul(Node):
    """y[n, r] = epilogue(Σ_k W[r, k]·x[n, k]); coopmat None: the device and options decide."""

    w: QWeight
    x: Rows
    y: Rows
    epilogue: Epilogue
    name: str
    coopmat: bool | None = None
    tile: CmTile | None = None  # a coopmat tile instead of cm_tile's choice
    plan: GemvPlan | None = None  # a row-group GEMV plan instead of gemv_plan's (≤ GEMV_MAX_COLS tokens)
    split: int | None = None  # split-K chunks of a tiled GEMM instead of split_k's choice (1: unsplit)

    def __post_init__(self) -> None:
        _check(self.w, self.x, self.y, self.epilogue)
        if self.coopmat and Q(self.w.qtype) not in COOPMAT_TYPES:
            raise ValueError(f"matmul: {Q(self.w.qtype).name} weights have no cooperative-matrix GEMM")

    def inputs(self) -> tuple[Rows | Buffer, ...]:
        ep = self.epilogue
        return (self.w.buf, self.x) + tuple(v for v in (ep.bias, ep.mul, ep.res) if v is not None)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.y,)

    def lower(self, g: "Graph") -> None:
        cm = use_coopmat(g.gpu, self.w.qtype) if self.coopmat is None else self.coopmat
        if cm and not kernel(f"mul_mat_cm_{self.w.type_name}").usable(g.gpu.caps):
            raise ValueError(f"matmul: {g.gpu.caps.name} offers no f16 cooperative matrix")
        _dispatch(g, self.w, self.x, self.y, self.epilogue, cm, self.name, self.tile, self.plan, self.split)


def matmul(g: "Graph", w: QWeight, x: Rows, y: Rows, epilogue: Epilogue = PLAIN, name: str = "mul_mat",
           coopmat: bool | None = None, tile: CmTile | None = None, plan: GemvPlan | None = None,
           split: int | None = None) -> None:
    """y[n, r] = epilogue(Σ_k W[r, k]·x[n, k]) for every token row n of x.

    coopmat defaults to the device and options (use_coopmat); tests pass it to compare the paths.
    tile overrides cm_tile's choice for a coopmat GEMM (benchmarks and tests of other tiles); plan
    gemv_plan's for a decode GEMV (a row-group GEMV even with VKFLASH_GEMV_TEAMS=0); split split_k's
    for a tiled GEMM (about that many K chunks: split_chunks; 1 unsplit).
    An epilogue with Fusion.EPILOGUE off runs as eltwise ops after a plain matmul.
    """
    if epilogue.flags == 0 or g.options.fuses(Fusion.EPILOGUE):
        g.add(MatMul(w, x, y, epilogue, name, coopmat, tile, plan, split))
        return
    _check(w, x, y, epilogue)
    # plain path: matmul into y, or into a scratch view when an epilogue input aliases y
    aliased = any(v is not None and v.buf is y.buf and v.overlaps(y) for v in (epilogue.mul, epilogue.res))
    tmp = g.tensor(y.n_rows, y.n_cols, f"{name}.tmp") if aliased else y
    g.add(MatMul(w, x, tmp, PLAIN, name, coopmat, tile, plan, split))
    _plain_epilogue(g, tmp, y, epilogue, name)


def stacked_gemv(g: "Graph", w: QWeight, x: Rows, y: Rows, mode: int, name: str, nbytes: int,
                 X: Rows | None = None, hc: int = 1, moe: tuple[Rows, Rows, int] | None = None) -> None:
    """One fused-mode GEMV: y's n_cols output rows, each combining weight rows r + c·n_cols of the stacked blocks
    (GEMV_HC: the streams X and hc; GEMV_MOE: moe = (ys, gate, k) feed the store; the caller checks their shapes).

    A workgroup owns m output rows and decodes n_stack·m weight rows, about the plain GEMV's (same
    registers, same loads in flight); GEMV_STACK_ROWS_CPU on CPU drivers.
    """
    caps = g.gpu.caps
    n, n_tok = y.n_cols, x.n_rows
    n_stack = 2 if mode == GEMV_GLU else (hc if mode == GEMV_HC else 1)  # the shader's NSTACK
    streams = X or x  # buffer 6 (GEMV_HC; any buffer otherwise)
    ys, gate, k = moe or (x, x, 1)  # buffers 7, 8 (GEMV_MOE; any buffers otherwise)
    push = MatVecPush(w.k, n, n_tok, w.row0, x.off, x.stride, y.off, y.stride, 0, 0, 0, 1.0,
                      streams.off, streams.stride, 1.0 / hc, ys.off, gate.off, gate.stride)  # 1/hc as hc.comp's
    tag = {GEMV_GLU: "glu", GEMV_HC: f"hc={hc}", GEMV_MOE: f"moe k={k}"}[mode]
    bufs = [w.buf, x.buf, x.buf, x.buf, x.buf, y.buf, streams.buf, ys.buf, gate.buf]
    if use_teams(g, w.qtype, w.k):
        plan = gemv_plan(g, w.qtype, w.k, n * n_stack if mode == GEMV_HC else n, n_stack, n_tok=n_tok)
        spec = _gemv_spec(g, plan, w.k, 0, n_tok, mode, hc, k)
        g.dispatch(plan.kernel(w.qtype), bufs, _grid(caps, -(-n // plan.rows_per_group())), push, spec, writes=[5],
                   name=name, desc=f"{w.type_name} {w.k}x{w.n_out} n={n_tok} {tag} {plan}{_cols(spec.ncol)}",
                   nbytes=nbytes, flops=2 * w.k * w.n_out * n_tok)
        return
    rows = gemv_rows(caps, w.qtype, n * n_stack, GEMV_STACK_ROWS_CPU)
    m = max(1, rows // n_stack)  # output rows per workgroup
    spec = _mv_spec(g, 0, n_stack * m, n_tok, mode, hc, k)
    g.dispatch(f"mul_mat_vec_{w.type_name}", bufs, _grid(caps, -(-n // m)), push, spec, writes=[5], name=name,
               desc=f"{w.type_name} {w.k}x{w.n_out} n={n_tok} {tag}{_cols(spec.ncol)}",
               nbytes=nbytes, flops=2 * w.k * w.n_out * n_tok)


@dataclass(frozen=True)
class GluGemv(Node):
    """y = silu(x W_gateᵀ) ⊙ (x W_upᵀ) for a stacked W = [gate; up] of 2F rows, ≤ GEMV_MAX_COLS
    tokens, one GEMV dispatch (Fusion.GLU; rounds like the two matmuls it replaces)."""

    w: QWeight
    x: Rows
    y: Rows
    name: str

    def __post_init__(self) -> None:
        w, x, y = self.w, self.x, self.y
        if w.n_out % 2 or y.n_cols != w.n_out // 2:
            raise ValueError(f"{self.name}: stacked weight has {w.n_out} rows, y {y.n_cols} columns: "
                             "need 2F rows and F columns")
        _check(replace(w, n_out=w.n_out // 2), x, y, PLAIN)
        if x.n_rows > GEMV_MAX_COLS:
            raise ValueError(f"{self.name}: {x.n_rows} tokens, the fused GEMV takes at most {GEMV_MAX_COLS}")

    def inputs(self) -> tuple[Rows | Buffer, ...]:
        return (self.w.buf, self.x)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.y,)

    def lower(self, g: "Graph") -> None:
        stacked_gemv(g, self.w, self.x, self.y, GEMV_GLU, self.name, self.w.nbytes + 4 * (self.x.size + self.y.size))


@dataclass(frozen=True)
class HcMixGemv(Node):
    """u = (1/hc)·Σ_c σ(W_up,c silu(ℓ_pre/hc)) ⊙ X_c in one GEMV dispatch (hc_pre, the up matmul and
    hc_mix; Fusion.HC_MIX): W_up has hc·d rows (row c·d + i: stream c, position i) of lr =
    ell_pre.n_cols; X is T × hc·d, u T × d, T ≤ GEMV_MAX_COLS."""

    w_up: QWeight
    ell_pre: Rows
    X: Rows
    u: Rows
    hc: int
    name: str

    def __post_init__(self) -> None:
        w_up, ell_pre, X, u, hc, name = self.w_up, self.ell_pre, self.X, self.u, self.hc, self.name
        T, d = ell_pre.n_rows, u.n_cols
        if T > GEMV_MAX_COLS:
            raise ValueError(f"{name}: {T} tokens, the fused GEMV takes at most {GEMV_MAX_COLS}")
        if hc < 1:
            raise ValueError(f"{name}: hc must be ≥ 1, got {hc}")
        if w_up.n_out != hc * d:
            raise ValueError(f"{name}: W_up has {w_up.n_out} rows, expected hc·d = {hc}·{d}")
        if (X.n_rows, X.n_cols) != (T, hc * d) or u.n_rows != T:
            raise ValueError(f"{name}: X is {X.n_rows}x{X.n_cols} and u {u.n_rows}x{d}, "
                             f"expected X {T}x{hc * d}, u {T}x{d}")
        _check(replace(w_up, n_out=d), ell_pre, u, PLAIN)
        check_alias(name, u, X)

    def inputs(self) -> tuple[Rows | Buffer, ...]:
        return (self.w_up.buf, self.ell_pre, self.X)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.u,)

    def lower(self, g: "Graph") -> None:
        stacked_gemv(g, self.w_up, self.ell_pre, self.u, GEMV_HC, self.name,
                     self.w_up.nbytes + 4 * (self.ell_pre.size + self.X.size + self.u.size), self.X, self.hc)
