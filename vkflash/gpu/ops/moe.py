"""MoE on the GPU (MODEL.md §5.7 M1–M4): router, routing prepass, routed expert matmuls, combine.

Router: one workgroup per token (shaders/moe_router.comp; k argmax rounds, or with
VKFLASH_ROUTER_RANK=1 every expert's rank counted in one pass) turns the logits z = W_r u into expert
ids (int32, T × k, descending probability, ties to the lower index) and weights
w_i = p_{I_i} / max(Σ p_I, 2⁻¹⁴) (f32, T × k).
Routed experts: for prefill a one-workgroup prepass (moe_prepass.comp) sorts the T·k (token, slot)
rows by expert into a plan (counts, offsets, rows, live (expert, row-tile) pairs) on the GPU; the
tiled expert GEMM (mul_mat_id.comp, scalar f32; or mul_mat_id_cm.comp on cooperative matrices where
matmul.use_coopmat says so, the dense coopmat GEMM's core, its weight groups decoded from wide loads:
VKFLASH_MMID_FAST_FETCH) then launches a fixed grid of live_cap() slots whose dead workgroups exit at
once (VKFLASH_MMID_COMPACT=0: every expert × max tiles instead). Decode
(T ≤ 8) skips the plan: the expert GEMV reads the ids itself, one dispatch per pass over (row tile ×
(token, slot) pair) (gemv_id.comp's row groups, on 8-bit activations with VKFLASH_GEMV_Q8; with
VKFLASH_GEMV_TEAMS=0 mul_mat_id_vec.comp). Each
(token, slot) result w_j·down(h) gets its own row t·k + j; moe_combine sums the k slots in slot
order (deterministic, no atomics) and adds the σ-gated shared expert; the fusion pass folds the
shared expert's down projection into that sum for decode (`MoeOutGemv`, Fusion.MOE_OUT).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from gguf import GGMLQuantizationType as Q

from vkflash.formats.quant_blocks import row_bytes
from vkflash.gpu.graph import Node
from vkflash.gpu.interface import PushConstants, SpecConstants, boolean, u32
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.matmul import (CM_WG, COOPMAT_TYPES, GEMV_MAX_COLS, GEMV_MOE, Q8_TYPES, TEAM_WG, TYPES, CmTile,
                                    GemvPlan, QWeight, cm_shape, cm_spec, gemv_plan, stacked_gemv, use_coopmat,
                                    use_teams)
from vkflash.gpu.ops.views import F32, Rows, grid
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class RouterPush(PushConstants):
    """moe_router.comp's push constants: experts, k, tokens, then the logits', ids' and weights' views."""

    E: u32
    k: u32
    n_rows: u32
    z_off: u32
    z_stride: u32
    id_off: u32
    id_stride: u32
    w_off: u32
    w_stride: u32


@dataclass(frozen=True)
class MaxExpertsSpec(SpecConstants):
    """The expert count that sizes the router's and the prepass's shared arrays."""

    max_e: u32


@dataclass(frozen=True)
class RouterSpec(SpecConstants):
    """moe_router.comp's expert capacity and selection: rank counting (one pass) or k argmax rounds."""

    max_e: u32
    rank: boolean = True


KERNELS = [Kernel("moe_router", "moe_router.comp", 3, push=RouterPush, spec=RouterSpec)]
MAX_GROUPS = 65535  # router: one workgroup per token, more tokens loop; combine: grid-stride


def moe_router(g: "Graph", z: Rows, ids: Rows, w: Rows, k: int, name: str = "moe_router") -> None:
    """ids, w = top-k of softmax(z) per row of z (T × E); ids and w are T × k (ids as int32). A
    row with a NaN or +inf gets ids 0..k-1 and NaN weights (valid gathers, the fault carried on)."""
    T, E = z.n_rows, z.n_cols
    if not 1 <= k <= E:
        raise ValueError(f"{name}: k = {k} must be between 1 and the expert count {E}")
    for label, v in (("ids", ids), ("w", w)):
        if (v.n_rows, v.n_cols) != (T, k):
            raise ValueError(f"{name}: {label} is {v.n_rows}x{v.n_cols}, expected {T}x{k}")
        if v.overlaps(z):
            raise ValueError(f"{name}: {label} overlaps the logits z")
    if ids.overlaps(w):
        raise ValueError(f"{name}: ids and w overlap")
    caps = g.gpu.caps
    wg = kernel("moe_router").workgroup(caps)
    rank = g.options.router_rank
    shared = F32 * ((3 if rank else 1) * E + 2 * wg)  # probabilities (+ ranked ids, p) + common/reduce.glsl's slots
    if shared > caps.shared_memory:
        raise ValueError(f"{name}: {E} experts need {shared} B of shared memory, the device has {caps.shared_memory}")
    g.dispatch("moe_router", [z.buf, ids.buf, w.buf], [grid(T, 1, MAX_GROUPS)],
               push=RouterPush(E, k, T, z.off, z.stride, ids.off, ids.stride, w.off, w.stride),
               spec=RouterSpec(E, rank), writes=[1, 2], name=name,
               desc=f"T={T} E={E} k={k} {'rank' if rank else 'rounds'}", nbytes=F32 * T * (E + 2 * k))


# ---- routed experts (M4) ----------------------------------------------------------------------

TILES = (16, 32, 48, 64)  # row-tile widths of the prefill expert GEMM (mul_mat_id.comp BN)
GEMM_BM = 64  # weight rows per expert-GEMM workgroup
GEMM_WG = 256  # invocations of an expert-GEMM workgroup (16 × 16)
GEMV_WG = 64  # invocations of an expert-GEMV workgroup
GEMV_ROWS = 8  # weight rows per expert-GEMV workgroup
DECODE_MAX_T = 8  # at most this many tokens take the GEMV path (no prepass)
MAX_PACKED = 1 << 16  # live pairs pack e | tile << 16


class Mode(IntEnum):
    """Stores of the expert matmuls (mul_mat_id*.comp MODE)."""

    GATE = 0  # h = silu(W_g x)
    UP = 1  # h = h ⊙ W_u x   (after GATE into the same h)
    GATE_UP = 2  # h = silu(W_g x) ⊙ W_u x   (gate and up rows in one buffer)
    DOWN = 3  # y[t·k + j] = w[t, j]·W_d h


CM_KERNEL = "mul_mat_id_cm"  # kernel family of the coopmat expert GEMM (tests swap in an emulated build)


@dataclass(frozen=True)
class PrepassPush(PushConstants):
    """moe_prepass.comp's push constants: experts, k, tokens, the ids' view, tile width, live-pair bound."""

    E: u32
    k: u32
    T: u32
    id_off: u32
    id_stride: u32
    BN: u32
    live_cap: u32


@dataclass(frozen=True)
class ExpertGemmPush(PushConstants):
    """mul_mat_id.comp's push constants (see its header)."""

    K: u32
    n_out: u32
    E: u32
    k: u32
    live_cap: u32
    max_tiles: u32
    w_row0: u32
    w_row0b: u32
    w_estride: u32
    x_off: u32
    x_stride: u32
    y_off: u32
    y_stride: u32
    wt_off: u32
    wt_stride: u32


@dataclass(frozen=True)
class ExpertGemmSpec(SpecConstants):
    """mul_mat_id.comp's store (Mode), row-tile width and grid kind."""

    mode: u32
    bn: u32
    compact: boolean


@dataclass(frozen=True)
class ExpertGemvPush(PushConstants):
    """mul_mat_id_vec.comp's push constants (see its header)."""

    K: u32
    n_out: u32
    E: u32
    k: u32
    w_row0: u32
    w_row0b: u32
    w_estride: u32
    x_off: u32
    x_stride: u32
    y_off: u32
    y_stride: u32
    id_off: u32
    id_stride: u32
    wt_off: u32
    wt_stride: u32


@dataclass(frozen=True)
class ExpertGemvSpec(SpecConstants):
    """mul_mat_id_vec.comp's store (Mode), rows per workgroup and smallest subgroup size."""

    mode: u32
    ndec: u32
    sg_min: u32


@dataclass(frozen=True)
class ExpertTeamSpec(SpecConstants):
    """gemv_id.comp's store (Mode), invocations per team, weight rows per team, smallest subgroup size,
    weights decoded once for all columns (VKFLASH_GEMV_DEQ)."""

    mode: u32
    tpr: u32
    nr: u32
    sg_min: u32
    deq: u32 = 1


@dataclass(frozen=True)
class ExpertTeamQ8Spec(ExpertTeamSpec):
    """gemv_id.comp's integer-dot variant (Q8X): ExpertTeamSpec's, then the shared x capacity kq (= K)."""

    kq: u32 = 32


@dataclass(frozen=True)
class MoeCombinePush(PushConstants):
    """moe_combine.comp's push constants: tokens, d, k, then the ys, shared, gate and f views."""

    T: u32
    d: u32
    k: u32
    ys_off: u32
    ys_stride: u32
    s_off: u32
    s_stride: u32
    g_off: u32
    g_stride: u32
    f_off: u32
    f_stride: u32


@dataclass(frozen=True)
class MoeCombineSpec(SpecConstants):
    """moe_combine.comp: whether the gated shared expert is added."""

    shared: boolean


@dataclass(frozen=True)
class ExpertGemmCmSpec(SpecConstants):
    """mul_mat_id_cm.comp's store (Mode), the coopmat shape, subgroup bound and tile (cm_spec), grid kind,
    whether weight groups are decoded from wide loads (common/quant_group.glsl), and in halves on every
    invocation."""

    mode: u32
    tm: u32
    tn: u32
    tk: u32
    sg_max: u32
    bm: u32
    bn: u32
    wm: u32
    wn: u32
    compact: boolean
    fast: boolean = False
    half: boolean = False


def _expert_kernels() -> list[Kernel]:
    out = []
    for t in TYPES:
        d = (("QTYPE", int(t)),)
        out.append(Kernel(f"mul_mat_id_{t.name.lower()}", "mul_mat_id.comp", 5, d, local_size=GEMM_WG,
                          push=ExpertGemmPush, spec=ExpertGemmSpec))
        out.append(Kernel(f"mul_mat_id_vec_{t.name.lower()}", "mul_mat_id_vec.comp", 5, d, local_size=GEMV_WG,
                          push=ExpertGemvPush, spec=ExpertGemvSpec))
        out.append(Kernel(f"gemv_id_{t.name.lower()}", "gemv_id.comp", 5, d, local_size=TEAM_WG,
                          push=ExpertGemvPush, spec=ExpertTeamSpec))
        if t in Q8_TYPES:
            out.append(Kernel(f"gemv_id_q8_{t.name.lower()}", "gemv_id.comp", 5, d + (("Q8X", 1),), local_size=TEAM_WG,
                              needs=frozenset({"int_dot"}), push=ExpertGemvPush, spec=ExpertTeamQ8Spec))
        if t in COOPMAT_TYPES:
            out.append(Kernel(f"mul_mat_id_cm_{t.name.lower()}", "mul_mat_id_cm.comp", 5, d, local_size=CM_WG,
                              needs=frozenset({"coopmat_f16"}), push=ExpertGemmPush, spec=ExpertGemmCmSpec))
    return out


KERNELS += [Kernel("moe_prepass", "moe_prepass.comp", 2, local_size=256, push=PrepassPush, spec=MaxExpertsSpec),
            Kernel("moe_combine", "moe_combine.comp", 4, push=MoeCombinePush, spec=MoeCombineSpec)] + _expert_kernels()


@dataclass(frozen=True)
class ExpertStack:
    """Experts {k, n_out, E} stored raw: row r of expert e is row row0 + e·expert_rows + r of `buf`.

    expert_rows defaults to n_out (a plain stack); the fused {d, 2F, E} gate_up form is two stacks
    of expert_rows 2F at row0 0 and F (see `split_gate_up`).
    """

    buf: Buffer
    qtype: int
    k: int
    n_out: int
    n_exp: int
    row0: int = 0
    expert_rows: int = -1

    def __post_init__(self) -> None:
        if self.expert_rows == -1:
            object.__setattr__(self, "expert_rows", self.n_out)
        if self.n_exp < 1 or self.expert_rows < self.n_out:
            raise ValueError(f"experts: {self.n_exp} experts of {self.n_out} rows every {self.expert_rows} rows")
        # QWeight checks the type, the row length and that the last expert's rows fit the buffer
        QWeight(self.buf, self.qtype, self.k, self.row0 + (self.n_exp - 1) * self.expert_rows + self.n_out)

    @property
    def type_name(self) -> str:
        return Q(self.qtype).name.lower()

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's rows."""
        return self.n_out * row_bytes(Q(self.qtype), self.k)


def split_gate_up(buf: Buffer, qtype: int, d: int, F: int, E: int) -> tuple[ExpertStack, ExpertStack]:
    """Gate and up stacks of a fused ffn_gate_up_exps {d, 2F, E} (gate rows [0, F), up rows [F, 2F))."""
    return ExpertStack(buf, qtype, d, F, E, 0, 2 * F), ExpertStack(buf, qtype, d, F, E, F, 2 * F)


def tile_width(T: int, k: int, E: int) -> int:
    """Row-tile width for T tokens: the smallest of TILES holding the expected rows per expert T·k/E."""
    m = T * k / E
    return next((bn for bn in TILES if m <= bn), TILES[-1])


def live_cap(T: int, k: int, E: int, bn: int) -> int:
    """Grid bound on live (expert, row-tile) pairs: Σ_e ⌈c_e/BN⌉ < T·k/BN + E_live, E_live ≤ min(E, T·k),
    and no expert has more than T rows (⌈T/BN⌉ tiles)."""
    return min(-(-T * k // bn) + min(E, T * k), E * -(-T // bn))


@dataclass(frozen=True)
class MoEPlan:
    """The routing plan moe_prepass writes for T tokens, k slots, E experts and tile width bn
    (layout: shaders/moe_prepass.comp)."""

    buf: Buffer
    T: int
    k: int
    E: int
    bn: int

    def __post_init__(self) -> None:
        if self.bn not in TILES:
            raise ValueError(f"moe plan: tile width {self.bn} not one of {TILES}")
        if not 1 <= self.k <= self.E or self.T < 1:
            raise ValueError(f"moe plan: T = {self.T}, k = {self.k}, E = {self.E}")
        if self.E > MAX_PACKED or -(-self.T // self.bn) > MAX_PACKED:
            raise ValueError(f"moe plan: {self.E} experts or {self.T} tokens exceed the packed tile list")
        if self.words * 4 > self.buf.nbytes:
            raise ValueError(f"moe plan: needs {self.words * 4} B, buffer {self.buf.name!r} has {self.buf.nbytes} B")

    @property
    def live_cap(self) -> int:
        return live_cap(self.T, self.k, self.E, self.bn)

    @property
    def words(self) -> int:
        return plan_words(self.T, self.k, self.E, self.bn)

    @property
    def max_tiles(self) -> int:
        """Row tiles of the fullest possible expert (every token): the plain grid's tiles per expert."""
        return -(-self.T // self.bn)


def plan_words(T: int, k: int, E: int, bn: int) -> int:
    """uint32 words of a plan: header, counts, offsets, live list, rows."""
    return 1 + 2 * E + live_cap(T, k, E, bn) + T * k


def _check_ids(name: str, ids: Rows, wts: Rows | None, T: int, k: int) -> None:
    if (ids.n_rows, ids.n_cols) != (T, k) or (wts is not None and (wts.n_rows, wts.n_cols) != (T, k)):
        raise ValueError(f"{name}: ids / weights must be {T}x{k}")


def moe_prepass(g: "Graph", ids: Rows, plan: MoEPlan, name: str = "moe_prepass") -> None:
    """plan = per-expert row lists and live (expert, tile) pairs of the router's ids (T × k, int32)."""
    _check_ids(name, ids, None, plan.T, plan.k)
    if plan.buf is ids.buf:
        raise ValueError(f"{name}: the plan must not share the ids buffer")
    caps = g.gpu.caps
    wg = kernel("moe_prepass").workgroup(caps)
    shared = 4 * (6 * plan.E) + 16 * wg
    if shared > caps.shared_memory:
        raise ValueError(f"{name}: {plan.E} experts need {shared} B of shared memory, "
                         f"the device has {caps.shared_memory}")
    g.dispatch("moe_prepass", [ids.buf, plan.buf], [1],
               push=PrepassPush(plan.E, plan.k, plan.T, ids.off, ids.stride, plan.bn, plan.live_cap),
               spec=MaxExpertsSpec(plan.E),
               name=name, desc=f"T={plan.T} k={plan.k} E={plan.E} bn={plan.bn}",
               nbytes=4 * (plan.T * plan.k + plan.words))


def _check_stacks(name: str, w: ExpertStack, w2: ExpertStack | None, E: int) -> None:
    if w.n_exp != E:
        raise ValueError(f"{name}: weight has {w.n_exp} experts, the routing {E}")
    if w2 is not None and (w2.buf is not w.buf or w2.qtype != w.qtype or (w2.k, w2.n_out, w2.n_exp, w2.expert_rows)
                           != (w.k, w.n_out, w.n_exp, w.expert_rows)):
        raise ValueError(f"{name}: a fused gate/up pass needs both stacks in one buffer with the same layout")


def _check_pass(name: str, mode: Mode, w: ExpertStack, w2: ExpertStack | None, wts: Rows | None, x: Rows, y: Rows,
                T: int, k: int, E: int) -> None:
    """Operands of one expert pass: w2 exactly for GATE_UP, wts exactly for DOWN, x and y shapes per mode."""
    _check_stacks(name, w, w2, E)
    if (mode == Mode.GATE_UP) != (w2 is not None) or (mode == Mode.DOWN) != (wts is not None):
        raise ValueError(f"{name}: w2 goes with GATE_UP only and wts with DOWN only (got {mode.name})")
    _io_check(name, w, x, y, T * k if mode == Mode.DOWN else T, T * k)
    if wts is not None:
        _check_ids(name, wts, wts, T, k)


def _io_check(name: str, w: ExpertStack, x: Rows, y: Rows, x_rows: int, y_rows: int) -> None:
    if (x.n_rows, x.n_cols) != (x_rows, w.k):
        raise ValueError(f"{name}: x is {x.n_rows}x{x.n_cols}, expected {x_rows}x{w.k}")
    if (y.n_rows, y.n_cols) != (y_rows, w.n_out):
        raise ValueError(f"{name}: y is {y.n_rows}x{y.n_cols}, expected {y_rows}x{w.n_out}")
    if x.off % 4 or x.stride % 4:
        raise ValueError(f"{name}: x offset {x.off} and stride {x.stride} must be multiples of 4 (vec4 loads)")
    if x.overlaps(y):
        raise ValueError(f"{name}: y overlaps x")


def cm_expert_tile(caps, bn: int, nb: int) -> CmTile | None:
    """The coopmat expert GEMM's tile for plan tile width bn and nb weight blocks (2: fused gate/up):
    128 output rows (64 when fused: the gate and up rows make 128), all bn rows of the plan tile;
    8 warp tiles of 32 × bn/2 (fused: 16 × bn/2), or where bn/2 is no multiple of 16 (bn = 16, 48)
    warp tiles of 16 × bn (8 of them; fused 4). None where the shape or shared memory do not allow."""
    shape = cm_shape(caps)
    if shape is None:
        return None
    bm = 128 if nb == 1 else 64
    half = bn // 2
    if half % 16 == 0:
        t = CmTile(bm, bn, 32 if nb == 1 else 16, half)
    else:
        t = CmTile(bm, bn, 16, bn)
    extra = 12 * bn  # the tile's x rows, output rows and routing weights
    return t if t.valid(shape) and t.smem(shape.n, nb) + extra <= caps.shared_memory else None


HALF_TYPES = (Q.Q4_K, Q.Q5_K)
"""Weight types whose wide-load decoders (common/quant_group.glsl) also decode half groups (FAST + HALF).
The others' halves would each load the whole block: H200, Q5_0 down at 512 / 2048 tokens, 1–4% slower."""


def _folded(caps, n: int) -> tuple[int, int]:
    """(gy, gz) with gy·gz ≥ n within the device's grid limits (shaders use slot = z·gy + y)."""
    gy = min(n, caps.max_workgroup_count[1])
    return gy, -(-n // gy)


def expert_gemm(g: "Graph", plan: MoEPlan, mode: Mode, w: ExpertStack, x: Rows, y: Rows, wts: Rows | None = None,
                w2: ExpertStack | None = None, compact: bool | None = None, name: str = "mul_mat_id",
                coopmat: bool | None = None, fast: bool | None = None, half: bool | None = None) -> None:
    """One prefill expert pass over the plan's rows (mode: see Mode; rows of h follow the plan order).

    x is u (T × K) for the gate/up modes, h (T·k × K, plan order) for DOWN; y is h (T·k × n_out) or,
    for DOWN, the slot outputs (T·k × n_out, row t·k + j). wts (T × k) only for DOWN; w2 only for GATE_UP.
    coopmat defaults to matmul.use_coopmat for the weight type (VKFLASH_DISABLE_COOPMAT; never F32);
    fast (the coopmat GEMM's wide-load group decode, same values) to VKFLASH_MMID_FAST_FETCH, half (that
    decode in half groups on every invocation, same values; HALF_TYPES) to VKFLASH_MMID_HALF.
    """
    T, k = plan.T, plan.k
    _check_pass(name, mode, w, w2, wts, x, y, T, k, plan.E)
    if plan.buf in (x.buf, y.buf):
        raise ValueError(f"{name}: the plan shares a buffer with x or y")
    caps = g.gpu.caps
    cm = g.options.mmid_compact if compact is None else compact
    fast = g.options.mmid_fast_fetch if fast is None else fast
    half = fast and Q(w.qtype) in HALF_TYPES and (g.options.mmid_half if half is None else half)
    slots = plan.live_cap if cm else plan.E * plan.max_tiles
    gy, gz = _folded(caps, slots)
    nb = 2 if w2 is not None else 1
    use_cm = coopmat
    if use_cm is None:
        use_cm = use_coopmat(g.gpu, w.qtype) and cm_expert_tile(caps, plan.bn, nb) is not None
    if use_cm:
        if Q(w.qtype) not in COOPMAT_TYPES:
            raise ValueError(f"{name}: {Q(w.qtype).name} weights have no cooperative-matrix expert GEMM")
        tile = cm_expert_tile(caps, plan.bn, nb)
        if tile is None or not kernel(f"mul_mat_id_cm_{w.type_name}").usable(caps):
            raise ValueError(f"{name}: {caps.name} has no coopmat expert GEMM for tile width {plan.bn}")
        kname, bm = f"{CM_KERNEL}_{w.type_name}", tile.bm
        spec: SpecConstants = ExpertGemmCmSpec(mode, *cm_spec(caps, tile), cm, fast, half)
        if kernel(kname).workgroup(caps) != CM_WG:
            raise ValueError(f"{name}: the coopmat expert GEMM needs {CM_WG} invocations per workgroup")
    else:
        if kernel(f"mul_mat_id_{w.type_name}").workgroup(caps) != GEMM_WG:
            raise ValueError(f"{name}: the expert GEMM needs {GEMM_WG} invocations per workgroup (16×16)")
        kname, bm, spec, tile = f"mul_mat_id_{w.type_name}", GEMM_BM, ExpertGemmSpec(mode, plan.bn, cm), None
    g.dispatch(kname, [w.buf, x.buf, plan.buf, (wts or x).buf, y.buf],
               [-(-w.n_out // bm), gy, gz],
               push=ExpertGemmPush(w.k, w.n_out, plan.E, k, plan.live_cap, plan.max_tiles, w.row0, (w2 or w).row0,
                                   w.expert_rows, x.off, x.stride, y.off, y.stride, wts.off if wts else 0,
                                   wts.stride if wts else 0),
               spec=spec, name=name,
               desc=(f"{w.type_name} {w.k}x{w.n_out} T={T} k={k} E={plan.E} bn={plan.bn}{'' if cm else ' plain'}"
                     f"{f' cm {tile}' if tile else ''}{' fast' if tile and fast else ''}"
                     f"{' half' if tile and half else ''}"),
               nbytes=nb * min(plan.E, T * k) * w.expert_bytes + 4 * (x.size + y.size),
               flops=2 * nb * w.k * w.n_out * T * k)


def expert_gemv(g: "Graph", ids: Rows, mode: Mode, w: ExpertStack, x: Rows, y: Rows, wts: Rows | None = None,
                w2: ExpertStack | None = None, name: str = "mul_mat_id_vec", plan: GemvPlan | None = None) -> None:
    """One decode expert pass over the selected experts only (rows of h and y are pairs t·k + j).

    With VKFLASH_GEMV_TEAMS (or a plan) one row-group GEMV (gemv_id.comp) over (row tile × pair),
    on 8-bit activations with VKFLASH_GEMV_Q8 (matmul.gemv_plan over the T·k pairs' rows), else
    mul_mat_id_vec.comp."""
    T, k = ids.n_rows, ids.n_cols
    _check_pass(name, mode, w, w2, wts, x, y, T, k, w.n_exp)
    caps = g.gpu.caps
    if T * k > caps.max_workgroup_count[1]:
        raise ValueError(f"{name}: {T}x{k} pairs exceed the grid")
    nb = 2 if w2 is not None else 1
    bufs = [w.buf, x.buf, ids.buf, (wts or x).buf, y.buf]
    push = ExpertGemvPush(w.k, w.n_out, w.n_exp, k, w.row0, (w2 or w).row0, w.expert_rows, x.off, x.stride,
                          y.off, y.stride, ids.off, ids.stride, wts.off if wts else 0, wts.stride if wts else 0)
    desc = f"{w.type_name} {w.k}x{w.n_out} T={T} k={k}"
    nbytes, flops = nb * T * k * w.expert_bytes + 4 * (x.size + y.size), 2 * nb * w.k * w.n_out * T * k
    if plan is not None or use_teams(g, w.qtype, w.k):
        plan = plan or gemv_plan(g, w.qtype, w.k, w.n_out * T * k, nb, n_tok=T)
        args = (mode, plan.tpr, plan.m * nb, max(1, caps.subgroup_min), int(g.options.gemv_deq))
        spec = ExpertTeamQ8Spec(*args, kq=w.k) if plan.q8 else ExpertTeamSpec(*args)
        g.dispatch(f"gemv_id_{'q8_' if plan.q8 else ''}{w.type_name}", bufs,
                   [-(-w.n_out // plan.rows_per_group()), T * k], push=push, spec=spec, name=name,
                   desc=f"{desc} {plan}", nbytes=nbytes, flops=flops)
        return
    g.dispatch(f"mul_mat_id_vec_{w.type_name}", bufs, [-(-w.n_out // GEMV_ROWS), T * k], push=push,
               spec=ExpertGemvSpec(mode, GEMV_ROWS, max(1, caps.subgroup_min)), name=name, desc=desc,
               nbytes=nbytes, flops=flops)


@dataclass(frozen=True)
class RoutedExperts:
    """The routed expert stacks of one layer: gate and up {d, F, E}, down {F, d, E}."""

    gate: ExpertStack
    up: ExpertStack
    down: ExpertStack

    def __post_init__(self) -> None:
        g, u, d = self.gate, self.up, self.down
        if (g.k, g.n_out, g.n_exp) != (u.k, u.n_out, u.n_exp) or (d.k, d.n_out, d.n_exp) != (g.n_out, g.k, g.n_exp):
            raise ValueError(f"experts: gate {g.k}x{g.n_out}, up {u.k}x{u.n_out}, down {d.k}x{d.n_out} "
                             "do not form d→F→d over one expert count")

    @property
    def fused(self) -> bool:
        """Gate and up in one buffer and layout: computed in one pass (Mode.GATE_UP)."""
        g, u = self.gate, self.up
        return g.buf is u.buf and g.qtype == u.qtype and g.expert_rows == u.expert_rows


def moe_routed(g: "Graph", x: Rows, ids: Rows, wts: Rows, w: RoutedExperts, ys: Rows, h: Rows | None = None,
               plan: MoEPlan | None = None, compact: bool | None = None, name: str = "moe",
               coopmat: bool | None = None, fast: bool | None = None, half: bool | None = None) -> None:
    """ys[t·k + j] = w[t, j]·W_d^{(e)}(silu(W_g^{(e)} x_t) ⊙ W_u^{(e)} x_t), e = ids[t, j] (M4, routed part).

    Up to DECODE_MAX_T tokens (decode) the expert GEMV reads the ids directly; more tokens go
    through the prepass `plan` (default: an intermediate) and the tiled expert GEMM. h (T·k × F,
    default: an intermediate) holds the expert hidden rows. coopmat (prefill GEMMs; default:
    use_coopmat per weight type) applies to the passes whose weight type has a coopmat GEMM, and so
    do fast and half (their wide-load group decode, in halves; default VKFLASH_MMID_FAST_FETCH, _HALF).
    """
    T, k = ids.n_rows, ids.n_cols
    if h is None:
        h = g.tensor(T * k, w.gate.n_out, f"{name}.h")
    if plan is None and T > DECODE_MAX_T:
        E = w.gate.n_exp
        bn = tile_width(T, k, E)
        plan = MoEPlan(g.temp(4 * plan_words(T, k, E, bn), f"{name}.plan"), T, k, E, bn)
    if plan is None:
        if w.fused:
            expert_gemv(g, ids, Mode.GATE_UP, w.gate, x, h, w2=w.up, name=f"{name}.gate_up")
        else:
            expert_gemv(g, ids, Mode.GATE, w.gate, x, h, name=f"{name}.gate")
            expert_gemv(g, ids, Mode.UP, w.up, x, h, name=f"{name}.up")
        expert_gemv(g, ids, Mode.DOWN, w.down, h, ys, wts=wts, name=f"{name}.down")
        return
    if (plan.T, plan.k) != (T, k):
        raise ValueError(f"{name}: plan is for {plan.T}x{plan.k}, ids are {T}x{k}")
    moe_prepass(g, ids, plan, name=f"{name}.prepass")

    def cm(s: ExpertStack) -> bool | None:
        return None if coopmat is None else coopmat and Q(s.qtype) in COOPMAT_TYPES

    if w.fused:
        expert_gemm(g, plan, Mode.GATE_UP, w.gate, x, h, w2=w.up, compact=compact, name=f"{name}.gate_up",
                    coopmat=cm(w.gate), fast=fast, half=half)
    else:
        expert_gemm(g, plan, Mode.GATE, w.gate, x, h, compact=compact, name=f"{name}.gate", coopmat=cm(w.gate),
                    fast=fast, half=half)
        expert_gemm(g, plan, Mode.UP, w.up, x, h, compact=compact, name=f"{name}.up", coopmat=cm(w.up), fast=fast,
                    half=half)
    expert_gemm(g, plan, Mode.DOWN, w.down, h, ys, wts=wts, compact=compact, name=f"{name}.down",
                coopmat=cm(w.down), fast=fast, half=half)


@dataclass(frozen=True)
class MoeCombine(Node):
    """f[t] = Σ_j ys[t·k + j] (slot order) + σ(gate[t])·shared[t] (shared part optional)."""

    ys: Rows
    f: Rows
    k: int
    shared: Rows | None
    gate: Rows | None
    name: str

    def __post_init__(self) -> None:
        ys, f, k, shared, gate, name = self.ys, self.f, self.k, self.shared, self.gate, self.name
        T, d = f.n_rows, f.n_cols
        if (ys.n_rows, ys.n_cols) != (T * k, d):
            raise ValueError(f"{name}: ys is {ys.n_rows}x{ys.n_cols}, expected {T * k}x{d}")
        if (shared is None) != (gate is None):
            raise ValueError(f"{name}: the shared output and its gate come together")
        if shared is not None and gate is not None:
            if (shared.n_rows, shared.n_cols) != (T, d) or (gate.n_rows, gate.n_cols) != (T, 1):
                raise ValueError(f"{name}: shared must be {T}x{d} and gate {T}x1")
        for v in (ys, shared, gate):
            if v is not None and v.overlaps(f):
                raise ValueError(f"{name}: f overlaps an input")

    def inputs(self) -> tuple[Rows, ...]:
        return (self.ys,) + tuple(v for v in (self.shared, self.gate) if v is not None)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.f,)

    def lower(self, g: "Graph") -> None:
        ys, f, k = self.ys, self.f, self.k
        T, d = f.n_rows, f.n_cols
        s, gl = self.shared or ys, self.gate or ys
        wg = kernel("moe_combine").workgroup(g.gpu.caps)
        g.dispatch("moe_combine", [ys.buf, s.buf, gl.buf, f.buf], [grid(T * d, wg, MAX_GROUPS)],
                   push=MoeCombinePush(T, d, k, ys.off, ys.stride, s.off, s.stride, gl.off, gl.stride, f.off, f.stride),
                   spec=MoeCombineSpec(self.shared is not None), name=self.name, desc=f"T={T} d={d} k={k}",
                   nbytes=4 * (T * d * (k + 2 if self.shared is not None else k + 1)))


def moe_combine(g: "Graph", ys: Rows, f: Rows, k: int, shared: Rows | None = None, gate: Rows | None = None,
                name: str = "moe_combine") -> None:
    """(M4) f[t] = Σ_j ys[t·k + j] (slot order) + σ(gate[t])·shared[t] (shared part optional, both or neither)."""
    g.add(MoeCombine(ys, f, k, shared, gate, name))


@dataclass(frozen=True)
class MoeOutGemv(Node):
    """f[t] = Σ_j ys[t·k + j] + σ(gate[t])·(W_d^s h[t]): the shared expert's down projection with the
    MoE combine as its store, one GEMV for ≤ GEMV_MAX_COLS tokens (Fusion.MOE_OUT; rounds like the
    matmul + moe_combine it replaces)."""

    w_down: QWeight
    h: Rows
    ys: Rows
    gate: Rows
    f: Rows
    k: int
    name: str

    def __post_init__(self) -> None:
        T, d, name = self.h.n_rows, self.f.n_cols, self.name
        ys, gate, f, k = self.ys, self.gate, self.f, self.k
        if (ys.n_rows, ys.n_cols) != (T * k, d) or (gate.n_rows, gate.n_cols) != (T, 1) or f.n_rows != T:
            raise ValueError(f"{name}: ys {ys.n_rows}x{ys.n_cols}, gate {gate.n_rows}x{gate.n_cols}, f {f.n_rows}x{d} "
                             f"do not fit T={T}, k={k}")
        if (self.w_down.k, self.w_down.n_out) != (self.h.n_cols, d):
            raise ValueError(f"{name}: W_d^s is {self.w_down.n_out}x{self.w_down.k}, expected {d}x{self.h.n_cols}")
        if T > GEMV_MAX_COLS or ys.stride != f.stride:
            raise ValueError(f"{name}: the fused GEMV takes ≤ {GEMV_MAX_COLS} tokens and ys rows strided like f's")
        for v in (ys, gate, self.h):
            if v.overlaps(f):
                raise ValueError(f"{name}: f overlaps an input")

    def inputs(self) -> tuple[Rows | Buffer, ...]:
        return (self.w_down.buf, self.h, self.ys, self.gate)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.f,)

    def lower(self, g: "Graph") -> None:
        T = self.h.n_rows
        stacked_gemv(g, self.w_down, self.h, self.f, GEMV_MOE, self.name,
                     self.w_down.nbytes + 4 * (self.h.size + self.ys.size + self.f.size + T),
                     moe=(self.ys, self.gate, self.k))
