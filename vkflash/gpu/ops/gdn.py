"""Gated DeltaNet ops (MODEL.md §5.4 G2–G9): causal conv + silu with state, gates, the gated delta
rule (a step-by-step decode/verify variant; chunked prefill in matrix form — in one kernel, or
with VKFLASH_GDN_SPLIT=1 split into a per-chunk pass and a scan — or scalar with
VKFLASH_GDN_MATRIX=0) and the gated RMSNorm. Every op covers a whole ubatch in one dispatch; states
are f32, kept as `Planes` whose live plane a step updates in place, or, in a verify step (`ring`),
leaves behind for one plane per token. The fusion pass computes the gates inside the delta-rule
kernel (Fusion.GDN_GATES).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from typing import TYPE_CHECKING

from vkflash.gpu.graph import Node
from vkflash.gpu.interface import PushConstants, SpecConstants, boolean, f32, u32
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.views import F32, Rows, check_alias, check_same_shape, grid
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class ConvPush(PushConstants):
    """gdn_conv.comp's push constants: channels, tokens, the m, w, state and c views, the planes."""

    C: u32
    T: u32
    m_off: u32
    m_stride: u32
    w_off: u32
    st_off: u32
    c_off: u32
    c_stride: u32
    n_planes: u32
    idx_off: u32
    ring: u32


@dataclass(frozen=True)
class ConvSpec(SpecConstants):
    """gdn_conv.comp's conv taps and tokens per invocation."""

    k: u32
    tc: u32


@dataclass(frozen=True)
class GatesPush(PushConstants):
    """gdn_gates.comp's push constants: heads, tokens, then each view's offset (and row stride)."""

    n_v: u32
    T: u32
    b_off: u32
    b_stride: u32
    a_off: u32
    a_stride: u32
    dt_off: u32
    sa_off: u32
    beta_off: u32
    beta_stride: u32
    g_off: u32
    g_stride: u32


@dataclass(frozen=True)
class DeltaPush(PushConstants):
    """gdn_delta.comp's push constants (see its header)."""

    n_k: u32
    n_v: u32
    T: u32
    c_off: u32
    c_stride: u32
    beta_off: u32
    beta_stride: u32
    g_off: u32
    g_stride: u32
    st_off: u32
    o_off: u32
    o_stride: u32
    n_planes: u32
    idx_off: u32
    ring: u32
    eps: f32
    dt_off: u32
    sa_off: u32
    b_off: u32
    b_stride: u32
    a_off: u32
    a_stride: u32


@dataclass(frozen=True)
class DeltaSpec(SpecConstants):
    """gdn_delta.comp's variant, head dim, head map, DeltaPlan's layout and whether gates come raw."""

    mode: u32
    s: u32
    grouped: u32
    bw: u32
    ch: u32
    rows: u32
    sh: u32
    raw_gates: boolean


@dataclass(frozen=True)
class GatedNormPush(PushConstants):
    """gdn_norm.comp's push constants: head dim, heads, tokens, the o, z, w and y views, ε."""

    S: u32
    n_v: u32
    T: u32
    o_off: u32
    o_stride: u32
    z_off: u32
    z_stride: u32
    w_off: u32
    y_off: u32
    y_stride: u32
    eps: f32


@dataclass(frozen=True)
class GatedNormSpec(SpecConstants):
    """gdn_norm.comp's gate activation (Gate)."""

    act: u32


KERNELS = [
    Kernel("gdn_conv", "gdn_conv.comp", 5, local_size=256, push=ConvPush, spec=ConvSpec),
    Kernel("gdn_gates", "gdn_gates.comp", 6, local_size=256, push=GatesPush, spec=SpecConstants),
    Kernel("gdn_delta", "gdn_delta.comp", 11, local_size=256, push=DeltaPush, spec=DeltaSpec),
    Kernel("gdn_norm", "gdn_norm.comp", 4, local_size=64, push=GatedNormPush, spec=GatedNormSpec),
]
CONV_TOKENS = 32  # tokens per conv invocation (≥ K_c − 1: only the first token block touches the state)
MAX_GROUPS = 65535  # grid-stride loops of gates and norm cover the rest
STEP_MAX_T = 8  # up to this many tokens (decode, MTP verify) the step variant beats the chunked one
CHUNKS = (64, 32, 16, 8)  # chunk sizes tried for the chunked variant, largest first
MATRIX_CHUNKS = (64, 32, 16)  # the matrix variant's, largest first (multiples of its 16-row solve blocks)
MATRIX_MAX_COLS = 64  # widest value-column slice of the matrix variant (its solve holds 16·cols/WG values)
MIN_COLS = 8  # narrowest value-column slice per workgroup


@dataclass(frozen=True)
class Planes:
    """A recurrent state of `rows` × `cols` f32 kept as n planes, one after the other from element
    `off` of buf; the live plane is word `index_word` of `index` (mod n; plane 0 when n = 1, the
    index unread). A step updates the live plane in place; a verify step (`ring`, T < n tokens)
    leaves it and writes the state after its token t into plane live + 1 + t (mod n), so a
    rollback is a move of the index (engine/state.py)."""

    buf: Buffer
    rows: int
    cols: int
    n: int
    index: Buffer
    index_word: int = 0
    off: int = 0

    @classmethod
    def single(cls, state: Rows) -> "Planes":
        """A plain state: one plane, updated in place."""
        _check_dense("state", state=state)
        return cls(state.buf, state.n_rows, state.n_cols, 1, state.buf, 0, state.off)

    def all(self) -> Rows:
        """Every plane as one view."""
        return Rows(self.buf, self.n * self.rows, self.cols, self.off)

    def push(self) -> list[int]:
        """The kernels' (n_planes, index word) push constants."""
        return [self.n, self.index_word]


def _planes(state: "Planes | Rows") -> Planes:
    return state if isinstance(state, Planes) else Planes.single(state)


def _check_ring(name: str, state: Planes, T: int, ring: bool) -> None:
    if ring and not 1 <= T < state.n:
        raise ValueError(f"{name}: a ring step of {T} tokens needs more than {T} state planes, has {state.n}")


class HeadMap(IntEnum):
    """(G7) key head of v-head j: TILED j mod n_k (qwen4exp), GROUPED ⌊j/ρ⌋ (qwen3next)."""

    TILED = 0
    GROUPED = 1


class Gate(IntEnum):
    """(G9) activation of z in the gated norm: σ (qwen4exp) or silu (qwen3next)."""

    SIGMOID = 0
    SILU = 1


class Variant(IntEnum):
    """gdn_delta.comp MODE: token-by-token recurrence (G8), chunked prefill (GC1–GC6) scalar or in
    matrix form (VKFLASH_GDN_MATRIX), in one kernel or (SPLIT, VKFLASH_GDN_SPLIT) as MODE 3's
    per-chunk pass then MODE 4's scan."""

    STEP = 0
    CHUNK = 1
    MATRIX = 2
    SPLIT = 3


PREP_MODE, SCAN_MODE = 3, 4  # the SPLIT variant's two dispatches


@dataclass(frozen=True)
class GDNShape:
    """GDN head geometry: n_k key heads, n_v value heads, head dim S, and the head map."""

    n_k: int
    n_v: int
    S: int
    head_map: HeadMap

    def __post_init__(self) -> None:
        if self.n_k < 1 or self.n_v < 1 or self.n_v % self.n_k:
            raise ValueError(f"GDN heads: n_v = {self.n_v} must be a positive multiple of n_k = {self.n_k}")
        if self.S < 16 or self.S & (self.S - 1):
            raise ValueError(f"GDN head dim S = {self.S} must be a power of two ≥ 16")

    @property
    def C(self) -> int:
        """Conv channels: q (n_k·S) | k (n_k·S) | v (n_v·S)."""
        return 2 * self.n_k * self.S + self.n_v * self.S


@dataclass(frozen=True)
class DeltaPlan:
    """How gdn_delta.comp runs: variant, value columns per workgroup, chunk, shared floats."""

    variant: Variant
    cols: int
    chunk: int
    rows: int  # state rows per invocation (step variant); key ranges of the scan's S₀ products (split)
    shared: int  # floats of the kernel's `sh` array (the split variant's scan)
    prep_shared: int = 0  # floats of `sh` in the split variant's per-chunk pass

    def prep_floats(self, shape: "GDNShape", T: int) -> int:
        """Floats the split variant passes from its per-chunk pass to its scan: per (head, chunk)
        Att [chunk, chunk] and 5 row vectors."""
        return shape.n_v * -(-T // self.chunk) * (self.chunk * self.chunk + 5 * self.chunk)


def _check_dense(op: str, **views: Rows) -> None:
    """Views the kernels index as packed arrays (weights, states) must have stride = n_cols."""
    for k, v in views.items():
        if v.stride != v.n_cols:
            raise ValueError(f"{op}: {k} must be dense (stride {v.stride} ≠ {v.n_cols})")


def conv(g: "Graph", m: Rows, w: Rows, state: Planes | Rows, c: Rows, ring: bool = False,
         name: str = "gdn_conv") -> None:
    """(G4) c = silu(causal depthwise conv of [state; m]) for T rows of C channels; the state
    [K−1, C] (raw m columns; `Planes`, or one plane as Rows) is updated in place, or with `ring`
    the state after each token t goes into plane live + 1 + t."""
    T, C, K = m.n_rows, m.n_cols, w.n_cols
    st = _planes(state)
    check_same_shape(name, m=m, c=c)
    if w.n_rows != C:
        raise ValueError(f"{name}: weights have {w.n_rows} rows, need one per channel ({C})")
    if not 2 <= K <= CONV_TOKENS + 1:
        raise ValueError(f"{name}: conv kernel K = {K} outside 2..{CONV_TOKENS + 1}")
    if (st.rows, st.cols) != (K - 1, C):
        raise ValueError(f"{name}: state is {st.rows}x{st.cols}, needs {K - 1}x{C}")
    _check_dense(name, w=w)
    _check_ring(name, st, T, ring)
    planes = st.all()
    check_alias(name, c, m, planes, w)
    check_alias(name, planes, m, w)
    wg = kernel("gdn_conv").workgroup(g.gpu.caps)
    written = T if ring else 1
    g.dispatch("gdn_conv", [m.buf, w.buf, st.buf, c.buf, st.index], [-(-C // wg), -(-T // CONV_TOKENS)],
               push=ConvPush(C, T, m.off, m.stride, w.off, st.off, c.off, c.stride, *st.push(), int(ring)),
               spec=ConvSpec(K, CONV_TOKENS), name=name, writes=[2, 3],
               desc=f"{T}x{C} K{K}" + " ring" * ring,
               nbytes=F32 * (2 * T * C + (K + (K - 1) * (1 + written)) * C), flops=2 * K * T * C)


@dataclass(frozen=True)
class Gates(Node):
    """(G2, G3) β = σ(b), g = softplus(a + dt_bias) ⊙ ssm_a."""

    b: Rows
    a: Rows
    dt_bias: Rows
    ssm_a: Rows
    beta: Rows
    gate: Rows
    name: str

    def inputs(self) -> tuple[Rows, ...]:
        return (self.b, self.a, self.dt_bias, self.ssm_a)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.beta, self.gate)

    def lower(self, g: "Graph") -> None:
        b, a, dt_bias, ssm_a, beta, gate = self.b, self.a, self.dt_bias, self.ssm_a, self.beta, self.gate
        T, n_v = b.n_rows, b.n_cols
        wg = kernel("gdn_gates").workgroup(g.gpu.caps)
        g.dispatch("gdn_gates", [b.buf, a.buf, dt_bias.buf, ssm_a.buf, beta.buf, gate.buf],
                   [grid(T * n_v, wg, MAX_GROUPS)],
                   push=GatesPush(n_v, T, b.off, b.stride, a.off, a.stride, dt_bias.off, ssm_a.off,
                                  beta.off, beta.stride, gate.off, gate.stride),
                   name=self.name, writes=[4, 5], desc=f"{T}x{n_v}", nbytes=F32 * (4 * T * n_v + 2 * n_v))


def gates(g: "Graph", b: Rows, a: Rows, dt_bias: Rows, ssm_a: Rows, beta: Rows, gate: Rows,
          name: str = "gdn_gates") -> None:
    """(G2, G3) β = σ(b), g = softplus(a + dt_bias) ⊙ ssm_a for T rows of n_v heads (ssm_a < 0 as stored)."""
    check_same_shape(name, b=b, a=a, beta=beta, g=gate)
    n_v = b.n_cols
    for k, v in (("dt_bias", dt_bias), ("ssm_a", ssm_a)):
        if (v.n_rows, v.n_cols) != (1, n_v):
            raise ValueError(f"{name}: {k} is {v.n_rows}x{v.n_cols}, needs 1x{n_v}")
    check_alias(name, beta, b, a, dt_bias, ssm_a)
    check_alias(name, gate, b, a, dt_bias, ssm_a)
    if beta.overlaps(gate):
        raise ValueError(f"{name}: β and g outputs overlap")
    g.add(Gates(b, a, dt_bias, ssm_a, beta, gate, name))


def _divisors_down(S: int, top: int, least: int = MIN_COLS) -> list[int]:
    """Powers of two from min(S, top) down to `least` (all divide S, itself a power of two)."""
    out, x = [], min(S, top)
    while x >= least:
        out.append(x)
        x //= 2
    return out


def _matrix_shared(S: int, chunk: int, cols: int) -> int:
    """Shared floats of the matrix variant: K and Q rows (padded), S₀ slice, Att, V, 5 row vectors."""
    return 2 * chunk * (S + 1) + S * cols + chunk * (chunk + 1) + chunk * cols + 5 * chunk


def _plan_matrix(shape: GDNShape, wg: int, budget: int, chunk: int | None, cols: int | None) -> DeltaPlan | None:
    """The matrix variant's largest chunk, then widest slice, that fits (None: none does); every
    invocation holds at most one 4×4 tile of O and one solve column of a chunk."""
    S = shape.S
    for ch in MATRIX_CHUNKS if chunk is None else (chunk,):
        if ch % 16 or not 16 <= ch <= wg:
            raise ValueError(f"gdn_delta: matrix chunk {ch} must be a multiple of 16 in 16..{wg}")
        for bw in _divisors_down(S, MATRIX_MAX_COLS, 4) if cols is None else [cols]:
            if bw % 4 or S % bw:
                raise ValueError(f"gdn_delta: a matrix slice of {bw} columns must be a multiple of 4 dividing S = {S}")
            sh = _matrix_shared(S, ch, bw)
            if ch * bw // 16 <= wg and sh <= budget:
                return DeltaPlan(Variant.MATRIX, bw, ch, 1, sh)
    return None


def _plan_split(shape: GDNShape, wg: int, budget: int, chunk: int | None, cols: int | None) -> DeltaPlan | None:
    """The split variant's largest chunk, then widest slice, whose scan (the matrix layout, every
    S₀-product tile an invocation: chunk·cols/8 ≤ wg) and per-chunk pass (the layout at 4 columns
    plus T) both fit; the scan's key ranges: the most (a power of two) whose partial tiles fit
    where the Q rows were."""
    S = shape.S
    for ch in MATRIX_CHUNKS if chunk is None else (chunk,):
        if ch % 16 or not 16 <= ch <= wg:
            raise ValueError(f"gdn_delta: split chunk {ch} must be a multiple of 16 in 16..{wg}")
        prep = _matrix_shared(S, ch, 4) + ch * ch
        for bw in _divisors_down(S, MATRIX_MAX_COLS, 4) if cols is None else [cols]:
            if bw % 4 or S % bw:
                raise ValueError(f"gdn_delta: a split slice of {bw} columns must be a multiple of 4 dividing S = {S}")
            items, sh = ch * bw // 8, _matrix_shared(S, ch, bw)
            if items <= wg and max(sh, prep) <= budget:
                parts = 1
                while 2 * parts * items <= wg and (2 * parts - 1) * 2 * bw <= S + 1:
                    parts *= 2
                return DeltaPlan(Variant.SPLIT, bw, ch, parts, sh, prep)
    return None


def plan_delta(g: "Graph", shape: GDNShape, T: int, variant: Variant | None = None, chunk: int | None = None,
               cols: int | None = None) -> DeltaPlan:
    """Pick the variant (unless told: step for T ≤ STEP_MAX_T, else the matrix form where the
    options' gdn_matrix (VKFLASH_GDN_MATRIX) is on and a layout fits — split in two passes where
    gdn_split (VKFLASH_GDN_SPLIT) is on and its layout fits —, else the scalar chunked one, else,
    for an S whose chunks do not fit, step), the value-column slice and the chunk so the
    workgroup's shared memory fits the device."""
    wg = kernel("gdn_delta").workgroup(g.gpu.caps)
    budget = g.gpu.caps.shared_memory // F32
    S = shape.S
    v = variant
    if v is None:
        v = Variant.STEP if T <= STEP_MAX_T else Variant.MATRIX if g.options.gdn_matrix else Variant.CHUNK
        if v == Variant.MATRIX and g.options.gdn_split:
            v = Variant.SPLIT
    for form, planner, fallback in ((Variant.SPLIT, _plan_split, Variant.MATRIX),
                                    (Variant.MATRIX, _plan_matrix, Variant.CHUNK)):
        if v == form:
            plan = planner(shape, wg, budget, chunk, cols)
            if plan is not None:
                return plan
            if variant == form:
                raise ValueError(f"gdn_delta: no {form.name.lower()} layout for S = {S} fits "
                                 f"{g.gpu.caps.shared_memory} B of shared memory with {wg} invocations")
            v = fallback
    if v == Variant.CHUNK:
        chunks = CHUNKS if chunk is None else (chunk,)
        for ch in chunks:
            if not 1 <= ch <= wg // 2:
                raise ValueError(f"gdn_delta: chunk {ch} outside 1..{wg // 2} (two row norms per invocation pair)")
            for bw in _divisors_down(S, 64) if cols is None else [cols]:
                sh = 2 * ch * S + ch * ch + S * bw + ch * bw + 2 * ch
                if sh <= budget:
                    return DeltaPlan(v, bw, ch, 1, sh)
        if variant is not None:
            raise ValueError(f"gdn_delta: S = {S} with chunks {chunks} does not fit {g.gpu.caps.shared_memory} B "
                             f"of shared memory")
        v = Variant.STEP  # a large S: token by token, as decode (slower, the same recurrence)
    for bw in _divisors_down(S, 32):
        n_par = wg // bw
        if wg % bw == 0 and S % n_par == 0 and n_par <= S and 2 * S + 5 * wg <= budget:
            return DeltaPlan(v, bw, 1, S // n_par, 2 * S + 5 * wg)
    raise ValueError(f"gdn_delta: no step layout for S = {S} with {wg} invocations")


@dataclass(frozen=True)
class Delta(Node):
    """The gated delta rule (see `delta`); raw_gates = (dt_bias, ssm_a) makes beta/gate the raw b, a
    projections, the gates computed in the kernel (Fusion.GDN_GATES)."""

    c: Rows
    beta: Rows
    gate: Rows
    state: Planes
    o: Rows
    shape: GDNShape
    eps: float
    plan: DeltaPlan
    ring: bool
    raw_gates: tuple[Rows, Rows] | None
    name: str
    prep: Buffer | None = None  # the split variant's per-chunk blocks (an intermediate)

    def __post_init__(self) -> None:
        if self.raw_gates is not None:
            for k, v in zip(("dt_bias", "ssm_a"), self.raw_gates):
                if (v.n_rows, v.n_cols) != (1, self.shape.n_v):
                    raise ValueError(f"{self.name}: {k} is {v.n_rows}x{v.n_cols}, needs 1x{self.shape.n_v}")

    def inputs(self) -> tuple[Rows | Buffer, ...]:
        return (self.c, self.beta, self.gate, self.state.all(), self.state.index) + (self.raw_gates or ())

    def outputs(self) -> tuple[Rows, ...]:
        return (self.o, self.state.all())

    def lower(self, g: "Graph") -> None:
        c, beta, gate, state, o, shape, plan = self.c, self.beta, self.gate, self.state, self.o, self.shape, self.plan
        T, S, n_v = c.n_rows, shape.S, shape.n_v
        raw = self.raw_gates is not None
        dt, sa = self.raw_gates if self.raw_gates is not None else (beta, beta)
        bt, gt = (c, c) if raw else (beta, gate)  # buffers 1, 2: β and g as stored
        rb, ra = (beta, gate) if raw else (c, c)  # buffers 8, 9: the raw projections b, a
        written = T if self.ring else 1
        pr = self.prep if self.prep is not None else o.buf  # buffer 10: another one, unread, unless split
        buffers = [c.buf, bt.buf, gt.buf, state.buf, o.buf, state.index, dt.buf, sa.buf, rb.buf, ra.buf, pr]
        push = DeltaPush(shape.n_k, n_v, T, c.off, c.stride, bt.off, bt.stride, gt.off, gt.stride, state.off, o.off,
                         o.stride, *state.push(), int(self.ring), self.eps, dt.off, sa.off, rb.off, rb.stride, ra.off,
                         ra.stride)
        spec = DeltaSpec(plan.variant, S, shape.head_map, plan.cols, plan.chunk, plan.rows, plan.shared, raw)
        desc = f"{plan.variant.name.lower()} {T}x{n_v}x{S} cols {plan.cols} chunk {plan.chunk}" + " ring" * self.ring
        state_bytes = F32 * (1 + written) * n_v * S * S
        if plan.variant == Variant.SPLIT:
            # what the scan's key ranges and the per-chunk solve rely on (_plan_split keeps it so)
            wg, items = kernel("gdn_delta").workgroup(g.gpu.caps), plan.chunk * plan.cols // 8
            assert plan.rows * items <= wg and (plan.rows - 1) * 2 * plan.cols <= S + 1 and plan.chunk <= wg, plan
            n_chunks, blk = -(-T // plan.chunk), plan.chunk * plan.chunk + 5 * plan.chunk
            g.dispatch("gdn_delta", buffers, [n_v, n_chunks], push=push,
                       spec=replace(spec, mode=PREP_MODE, bw=4, sh=plan.prep_shared), name=f"{self.name}.prep",
                       writes=[10], desc=f"{desc} prep",
                       nbytes=F32 * (T * (2 * shape.n_k * S + 2 * n_v) + n_v * n_chunks * blk),
                       flops=2 * T * plan.chunk * S * n_v)
            spec = replace(spec, mode=SCAN_MODE)
        g.dispatch("gdn_delta", buffers, [n_v * (S // plan.cols)], push=push, spec=spec, name=self.name, writes=[3, 4],
                   desc=desc, nbytes=F32 * (T * (shape.C + 2 * n_v + n_v * S)) + state_bytes, flops=6 * T * n_v * S * S)


def delta(g: "Graph", c: Rows, beta: Rows, gate: Rows, state: Planes | Rows, o: Rows, shape: GDNShape, eps: float,
          variant: Variant | None = None, ring: bool = False, chunk: int | None = None,
          name: str = "gdn_delta", cols: int | None = None) -> DeltaPlan:
    """(G6–G8, GC1–GC6) o = gated delta rule over the T rows of c (= conv output q | k | v) with
    β, g (T × n_v); the state [n_v, S·S] (row = key index; `Planes`, or one plane as Rows) is
    updated in place, or with `ring` (step variant only) the state after each token t goes into
    plane live + 1 + t. chunk and cols override the plan's chunk and value-column slice (tests,
    benchmarks)."""
    T, S, n_v = c.n_rows, shape.S, shape.n_v
    st = _planes(state)
    if c.n_cols != shape.C:
        raise ValueError(f"{name}: conv rows have {c.n_cols} values, need 2·n_k·S + n_v·S = {shape.C}")
    check_same_shape(name, beta=beta, g=gate)
    if (beta.n_rows, beta.n_cols) != (T, n_v):
        raise ValueError(f"{name}: β is {beta.n_rows}x{beta.n_cols}, needs {T}x{n_v}")
    if (o.n_rows, o.n_cols) != (T, n_v * S):
        raise ValueError(f"{name}: output is {o.n_rows}x{o.n_cols}, needs {T}x{n_v * S}")
    if (st.rows, st.cols) != (n_v, S * S):
        raise ValueError(f"{name}: state is {st.rows}x{st.cols}, needs {n_v}x{S * S}")
    if not eps >= 0:
        raise ValueError(f"{name}: eps must be ≥ 0, got {eps}")
    plan = plan_delta(g, shape, T, variant, chunk, cols)
    if ring and plan.variant != Variant.STEP:
        raise ValueError(f"{name}: a ring step needs the step variant")
    _check_ring(name, st, T, ring)
    planes = st.all()
    check_alias(name, o, c, beta, gate, planes)
    check_alias(name, planes, c, beta, gate)
    prep = g.temp(F32 * plan.prep_floats(shape, T), f"{name}.prep") if plan.variant == Variant.SPLIT else None
    g.add(Delta(c, beta, gate, st, o, shape, eps, plan, ring, None, name, prep))
    return plan


def gated_norm(g: "Graph", o: Rows, z: Rows, w: Rows, y: Rows, S: int, eps: float, act: Gate,
               name: str = "gdn_norm") -> None:
    """(G9) y_j = rms(o_j) ⊙ ssm_norm ⊙ act(z_j) per v-head j of S values; w = ssm_norm (S, shared
    by all heads, used as stored); y may be o's exact view (in place)."""
    check_same_shape(name, o=o, z=z, y=y)
    T, n = o.n_rows, o.n_cols
    if S < 1 or n % S:
        raise ValueError(f"{name}: rows of {n} values do not split into heads of {S}")
    if (w.n_rows, w.n_cols) != (1, S):
        raise ValueError(f"{name}: ssm_norm is {w.n_rows}x{w.n_cols}, needs 1x{S}")
    if not eps >= 0:
        raise ValueError(f"{name}: eps must be ≥ 0, got {eps}")
    check_alias(name, y, o, z, w)
    n_v = n // S
    g.dispatch("gdn_norm", [o.buf, z.buf, w.buf, y.buf], [grid(T * n_v, 1, MAX_GROUPS)],
               push=GatedNormPush(S, n_v, T, o.off, o.stride, z.off, z.stride, w.off, y.off, y.stride, eps),
               spec=GatedNormSpec(act), name=name, writes=[3], desc=f"{T}x{n_v}x{S} {act.name.lower()}",
               nbytes=F32 * (3 * T * n + S))
