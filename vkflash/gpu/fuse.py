"""The fusion pass: a step graph's plain ops rewritten into fused kernels before they are lowered.

A step graph states the model one plain op at a time (engine/graphs/); this pass decides how it
runs. Each rule below matches a short pattern of typed nodes (gpu/ops) and replaces it with one
node whose kernel does the same arithmetic in fewer dispatches, when the Gpu's `GpuOptions` allow
that fusion (`Fusion`, one revert switch each) and only when the rewrite cannot change a value any
other op sees:

- a value the pattern consumes is not touched by any op outside the pattern after it (the fused
  kernel no longer writes it), and
- the operands the fused node reads later than the ops it replaces are not written in between.

Rules run in order, each over the whole list: STACK, EPILOGUE, GLU, NORM_ROPE, COMBINE_NORM,
NORM_INJECT, HC_MIX, KV_APPEND, MOE_OUT, GDN_GATES (a rule may build on the one before: GLU
matches two matmuls whose silu and ⊙ EPILOGUE already folded). Values of ops fused away are no
longer tappable by name, except where the fused node names them (`Node.named`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from vkflash.gpu.graph import Dispatch, Node
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.attention import KvAppend
from vkflash.gpu.ops.eltwise import Eltwise, Op
from vkflash.gpu.ops.gdn import Delta, Gates
from vkflash.gpu.ops.hc import HcCombine, HcMix, HcPre
from vkflash.gpu.ops.matmul import GEMV_MAX_COLS, Epilogue, GluGemv, HcMixGemv, MatMul, QWeight
from vkflash.gpu.ops.moe import MoeCombine, MoeOutGemv
from vkflash.gpu.ops.norm import MAX_HC, Mode, Norm, Rope
from vkflash.gpu.ops.rope import RopeNeox
from vkflash.gpu.ops.views import Rows
from vkflash.gpu.options import Fusion

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph

Item = Node | Dispatch
Ref = Rows | Buffer
T = TypeVar("T")


# ------------------------------------------------------------------ who touches what


def _overlap(a: Ref, b: Ref) -> bool:
    """Whether two views (or whole buffers) may share an element."""
    ba = a.buf if isinstance(a, Rows) else a
    bb = b.buf if isinstance(b, Rows) else b
    if ba is not bb:
        return False
    if isinstance(a, Rows) and isinstance(b, Rows):
        return a.overlaps(b)
    return True


def _reads(item: Item, v: Ref) -> bool:
    return any(_overlap(r, v) for r in item.inputs())


def _writes(item: Item, v: Ref) -> bool:
    return any(_overlap(w, v) for w in item.outputs())


def _touches(item: Item, v: Ref) -> bool:
    return _reads(item, v) or _writes(item, v)


def _next_user(nodes: Sequence[Item], i: int, v: Ref) -> int | None:
    """The first op after i that reads or writes v."""
    return next((j for j in range(i + 1, len(nodes)) if _touches(nodes[j], v)), None)


def _used_after(nodes: Sequence[Item], j: int, v: Ref) -> bool:
    return any(_touches(n, v) for n in nodes[j + 1:])


def _written_between(nodes: Sequence[Item], i: int, j: int, refs: Sequence[Ref | None]) -> bool:
    """Whether an op strictly between i and j writes one of refs."""
    return any(_writes(n, r) for n in nodes[i + 1:j] for r in refs if r is not None)


def _same(a: Rows | None, b: Rows | None) -> bool:
    """The identical view (same buffer, offset, shape and stride)."""
    return a is not None and b is not None and a.buf is b.buf and \
        (a.off, a.n_rows, a.n_cols, a.stride) == (b.off, b.n_rows, b.n_cols, b.stride)


def _one_row(v: Rows) -> bool:
    """A view that reads the same row for every token (broadcast, or a step of one token)."""
    return v.stride == 0 or v.n_rows == 1


def _made(build: Callable[[], T]) -> T | None:
    """A fused node, or None where its own checks refuse the operands."""
    try:
        return build()
    except ValueError:
        return None


def _rewrite(nodes: list[Item], i: int, j: int, node: Item) -> None:
    """Ops i and j replaced by `node` at j's place (i's removed)."""
    nodes[j] = node
    del nodes[i]


# ------------------------------------------------------------------ the rules


def _stack(nodes: list[Item], g: "Graph") -> None:
    """Consecutive plain matmuls of one input whose weights are consecutive rows of one buffer and
    whose outputs are consecutive columns of one row → one matmul named `first+second…`; each
    part stays tappable under its own name."""
    i = 0
    while i < len(nodes):
        run = [nodes[i]]
        while isinstance(run[0], MatMul) and i + len(run) < len(nodes) and _extends(run, nodes[i + len(run)]):
            run.append(nodes[i + len(run)])
        if len(run) > 1:
            first = run[0]
            assert isinstance(first, MatMul)
            w, y = first.w, first.y
            n_out = sum(m.w.n_out for m in run)  # type: ignore[union-attr]
            name = "+".join([first.name] + [m.name.rsplit(".", 1)[-1] for m in run[1:]])
            merged = replace(first, w=QWeight(w.buf, w.qtype, w.k, n_out, w.row0),
                             y=Rows(y.buf, y.n_rows, n_out, y.off, y.stride), name=name)
            for m in run:
                g.expose(m.name, m.y.buf, m.y.off, m.y.n_rows, m.y.n_cols, m.y.stride, after=name)  # type: ignore[union-attr]
            nodes[i:i + len(run)] = [merged]
            _stack_biases(nodes, i, [m.y for m in run])  # type: ignore[union-attr]
        i += 1


def _stack_biases(nodes: list[Item], i: int, parts: list[Rows]) -> None:
    """After a stacked matmul at i: when every part's next op adds a bias row in place and the
    biases are consecutive in one buffer, one add of the stacked bias (named after the matmul)."""
    merged = nodes[i]
    assert isinstance(merged, MatMul)
    adds = []
    for y in parts:
        j = _next_user(nodes, i, y)
        e = nodes[j] if j is not None else None
        if not (isinstance(e, Eltwise) and e.op is Op.ADD and _same(e.a, y) and _same(e.y, y)
                and e.b is not None and _one_row(e.b)):
            return
        adds.append((j, e.b))
    first = adds[0][1]
    col = 0
    for (_, bias), y in zip(adds, parts):
        if bias.buf is not first.buf or bias.off != first.off + col:
            return
        col += y.n_cols
    y = merged.y
    at = min(j for j, _ in adds)
    nodes[at] = Eltwise(Op.ADD, y, Rows(first.buf, y.n_rows, y.n_cols, first.off, 0), y, 1.0, merged.name)
    for j in sorted((j for j, _ in adds if j != at), reverse=True):
        del nodes[j]


def _extends(run: list[Item], m: Item) -> bool:
    last, first = run[-1], run[0]
    assert isinstance(last, MatMul) and isinstance(first, MatMul)
    return (isinstance(m, MatMul) and m.epilogue.flags == 0 and first.epilogue.flags == 0
            and _same(m.x, first.x) and (m.coopmat, m.tile) == (first.coopmat, first.tile)
            and m.w.buf is last.w.buf and (m.w.qtype, m.w.k) == (last.w.qtype, last.w.k)
            and m.w.row0 == last.w.row0 + last.w.n_out
            and m.y.buf is last.y.buf and (m.y.n_rows, m.y.stride) == (last.y.n_rows, last.y.stride)
            and m.y.off == last.y.off + last.y.n_cols)


STAGES = ("scale", "bias", "act", "mul", "res")
"""The epilogue's order: y = ((act(scale·acc + bias)) ⊙ mul) + res."""


def _epilogue_step(e: Item, mm: MatMul) -> tuple[str, Epilogue, Rows] | None:
    """How eltwise op e, the next op on mm's output, folds into mm's epilogue: (stage, epilogue,
    the view the matmul then stores), or None."""
    if not isinstance(e, Eltwise):
        return None
    y, ep = mm.y, mm.epilogue
    if e.op in (Op.SCALE, Op.SILU, Op.SIGMOID) and _same(e.a, y) and _same(e.y, y):
        if e.op is Op.SCALE:
            return "scale", replace(ep, scale=e.alpha), y
        return "act", replace(ep, act="silu" if e.op is Op.SILU else "sigmoid"), y
    if e.op not in (Op.ADD, Op.MUL) or e.b is None:
        return None
    other = e.b if _same(e.a, y) else e.a if _same(e.b, y) else None
    if other is None:
        return None
    if e.op is Op.ADD and _one_row(other) and _same(e.y, y):  # one row for every token: the bias
        return "bias", replace(ep, bias=Rows(other.buf, 1, other.n_cols, other.off)), y
    out = e.y
    if other.stride != out.stride or (out.n_rows, out.n_cols) != (y.n_rows, y.n_cols):
        return None
    if e.op is Op.MUL:
        return "mul", replace(ep, mul=other), out
    return "res", replace(ep, res=other), out


def _epilogue(nodes: list[Item], g: "Graph") -> None:
    """A matmul's following eltwise ops on its output (scale, bias, σ/silu, ⊙, + residual, in the
    epilogue's order) → its store; the matmul then writes the last op's output."""
    i = 0
    while i < len(nodes):
        mm = nodes[i]
        if not isinstance(mm, MatMul):
            i += 1
            continue
        pos, done = i, STAGES.index(_last_stage(mm.epilogue)) if mm.epilogue.flags else -1
        while True:
            j = _next_user(nodes, pos, mm.y)
            step = _epilogue_step(nodes[j], mm) if j is not None else None
            if j is None or step is None:
                break
            stage, ep, out = step
            moved = not _same(out, mm.y)
            if (STAGES.index(stage) <= done or _written_between(nodes, pos, j, [mm.x, mm.w.buf, ep.bias, ep.mul, ep.res])
                    or (moved and _used_after(nodes, j, mm.y))):
                break
            fused = _made(lambda: replace(mm, y=out, epilogue=ep, name=nodes[j].name))
            if fused is None:
                break
            _rewrite(nodes, pos, j, fused)
            pos, mm, done = j - 1, fused, STAGES.index(stage)
        if pos == i:  # nothing folded: move on (else the op now at i is the next one)
            i += 1


def _last_stage(ep: Epilogue) -> str:
    """The latest stage an epilogue already has."""
    has = {"scale": ep.scale is not None, "bias": ep.bias is not None, "act": bool(ep.act),
           "mul": ep.mul is not None, "res": ep.res is not None}
    return [s for s in STAGES if has[s]][-1]


def _glu(nodes: list[Item], g: "Graph") -> None:
    """silu(W_g x) then (W_u x) ⊙ it, W_g and W_u consecutive rows of one buffer, ≤ GEMV_MAX_COLS
    tokens → one GLU GEMV."""
    for i in range(len(nodes) - 1, -1, -1):
        gate = nodes[i]
        if not (isinstance(gate, MatMul) and gate.epilogue == Epilogue(act="silu") and gate.x.n_rows <= GEMV_MAX_COLS):
            continue
        j = _next_user(nodes, i, gate.y)
        up = nodes[j] if j is not None else None
        if not (isinstance(up, MatMul) and up.epilogue == Epilogue(mul=gate.y) and _same(up.x, gate.x)):
            continue
        wg, wu = gate.w, up.w
        if not (wu.buf is wg.buf and (wu.qtype, wu.k, wu.n_out) == (wg.qtype, wg.k, wg.n_out)
                and wu.row0 == wg.row0 + wg.n_out):
            continue
        if _used_after(nodes, j, gate.y) or _written_between(nodes, i, j, [gate.x, wg.buf]):
            continue
        fused = _made(lambda: GluGemv(QWeight(wg.buf, wg.qtype, wg.k, 2 * wg.n_out, wg.row0), gate.x, up.y, up.name))
        if fused is not None:
            _rewrite(nodes, i, j, fused)


def _norm_rope(nodes: list[Item], g: "Graph") -> None:
    """RMSNorm of head rows, then NeoX RoPE of the same rows in place → one norm.comp dispatch
    named after the RoPE."""
    for i in range(len(nodes) - 1, -1, -1):
        n = nodes[i]
        if not (isinstance(n, Norm) and n.mode is Mode.RMS and n.groups == 1 and n.rope is None
                and n.combine is None and n.inject is None):
            continue
        j = _next_user(nodes, i, n.y)
        r = nodes[j] if j is not None else None
        if not (isinstance(r, RopeNeox) and _same(r.x, n.y) and _same(r.y, n.y)):
            continue
        if _written_between(nodes, i, j, [n.x, r.pos]):
            continue
        fused = _made(lambda: replace(n, rope=Rope(r.n_heads, r.n_rot, r.theta, r.pos, r.pos_off), name=r.name))
        if fused is not None:
            _rewrite(nodes, i, j, fused)


def _combine_norm(nodes: list[Item], g: "Graph") -> None:
    """An HC Combine of R, then the grouped norm of R → one dispatch, named after the Combine (whose
    R stays tappable)."""
    for i in range(len(nodes) - 1, -1, -1):
        c = nodes[i]
        if not isinstance(c, HcCombine):
            continue
        j = _next_user(nodes, i, c.R)
        n = nodes[j] if j is not None else None
        if not (isinstance(n, Norm) and _same(n.x, c.R) and n.combine is None and n.rope is None
                and n.groups == c.iota.n_cols):
            continue
        if _written_between(nodes, i, j, [c.b, c.iota]):
            continue
        fused = _made(lambda: replace(n, combine=(c.iota, c.b), name=c.name, taps=((c.name, c.R),) + n.taps))
        if fused is not None:
            _rewrite(nodes, i, j, fused)


def _norm_inject(nodes: list[Item], g: "Graph") -> None:
    """The grouped norm X of R, and later ι = X W_injᵀ with W_inj f32, hc ≤ MAX_HC rows, ≤
    GEMV_MAX_COLS tokens → ι summed by the norm's workgroups (no matmul dispatch)."""
    for i, n in enumerate(nodes):
        if not (isinstance(n, Norm) and n.mode is Mode.RMS and 1 <= n.groups <= MAX_HC and n.rope is None
                and n.inject is None and n.y.n_rows <= GEMV_MAX_COLS):
            continue
        j = next((j for j in range(i + 1, len(nodes)) if _writes(nodes[j], n.y) or _is_inject(nodes[j], n)), None)
        mm = nodes[j] if j is not None else None
        if not isinstance(mm, MatMul) or not _is_inject(mm, n) or any(_touches(m, mm.y) for m in nodes[i + 1:j]):
            continue
        w, iota = mm.w, mm.y
        fused = _made(lambda: replace(n, inject=(Rows(w.buf, w.n_out, w.k, w.row0 * w.k), iota),
                                      taps=n.named() + ((mm.name, iota),)))
        if fused is not None:
            nodes[i] = fused
            del nodes[j]


def _is_inject(m: Item, n: Norm) -> bool:
    """Whether m is an f32 projection of n's output to n.groups values (the HC inject W_inj X)."""
    return (isinstance(m, MatMul) and _same(m.x, n.y) and m.epilogue.flags == 0
            and m.w.n_out == n.groups and int(m.w.qtype) == 0)  # GGML type 0: F32


def _hc_mix(nodes: list[Item], g: "Graph") -> None:
    """ℓ = silu(ℓ_pre/hc), g_pre = W_up ℓ, u = mix(g_pre, X), ≤ GEMV_MAX_COLS tokens → one GEMV."""
    for i in range(len(nodes) - 1, -1, -1):
        pre = nodes[i]
        if not isinstance(pre, HcPre):
            continue
        j = _next_user(nodes, i, pre.ell)
        up = nodes[j] if j is not None else None
        if not (isinstance(up, MatMul) and _same(up.x, pre.ell) and up.epilogue.flags == 0):
            continue
        k = _next_user(nodes, j, up.y)
        mix = nodes[k] if k is not None else None
        if not (isinstance(mix, HcMix) and _same(mix.g_pre, up.y) and mix.hc == pre.hc):
            continue
        if (_used_after(nodes, j, pre.ell) or _used_after(nodes, k, up.y)
                or _written_between(nodes, i, k, [pre.ell_pre, up.w.buf, mix.X])):
            continue
        fused = _made(lambda: HcMixGemv(up.w, pre.ell_pre, mix.X, mix.u, mix.hc, mix.name))
        if fused is not None:
            nodes[k] = fused
            del nodes[j]
            del nodes[i]


def _kv_append(nodes: list[Item], g: "Graph") -> None:
    """A layer's K append then its V append → one dispatch named `k+v`."""
    i = 0
    while i < len(nodes) - 1:
        a, b = nodes[i], nodes[i + 1]
        if (isinstance(a, KvAppend) and isinstance(b, KvAppend) and a.second is None and b.second is None
                and a.params is b.params and a.pos_off == b.pos_off and a.cache.buf is not b.cache.buf):
            name = a.name + "+" + b.name.rsplit(".", 1)[-1]
            fused = _made(lambda: replace(a, second=(b.src, b.cache), name=name))
            if fused is not None:
                nodes[i:i + 2] = [fused]
        i += 1


def _moe_out(nodes: list[Item], g: "Graph") -> None:
    """The shared expert's down projection, then the MoE combine that adds it → one GEMV."""
    for i in range(len(nodes) - 1, -1, -1):
        mm = nodes[i]
        if not (isinstance(mm, MatMul) and mm.epilogue.flags == 0):
            continue
        j = _next_user(nodes, i, mm.y)
        c = nodes[j] if j is not None else None
        if not (isinstance(c, MoeCombine) and _same(c.shared, mm.y) and c.gate is not None):
            continue
        if _used_after(nodes, j, mm.y) or _written_between(nodes, i, j, [mm.x, mm.w.buf]):
            continue
        fused = _made(lambda: MoeOutGemv(mm.w, mm.x, c.ys, c.gate, c.f, c.k, c.name))
        if fused is not None:
            _rewrite(nodes, i, j, fused)


def _gdn_gates(nodes: list[Item], g: "Graph") -> None:
    """The GDN gates, then the delta rule reading them → the gates computed in the delta kernel."""
    for i in range(len(nodes) - 1, -1, -1):
        gt = nodes[i]
        if not isinstance(gt, Gates):
            continue
        j = _next_user(nodes, i, gt.beta)
        d = nodes[j] if j is not None else None
        if not (isinstance(d, Delta) and d.raw_gates is None and _same(d.beta, gt.beta) and _same(d.gate, gt.gate)):
            continue
        if (_used_after(nodes, j, gt.beta) or _used_after(nodes, j, gt.gate)
                or any(_touches(m, gt.gate) for m in nodes[i + 1:j])
                or _written_between(nodes, i, j, [gt.b, gt.a, gt.dt_bias, gt.ssm_a])):
            continue
        fused = _made(lambda: replace(d, beta=gt.b, gate=gt.a, raw_gates=(gt.dt_bias, gt.ssm_a)))
        if fused is not None:
            _rewrite(nodes, i, j, fused)


RULES: tuple[tuple[Fusion, Callable[[list[Item], "Graph"], None]], ...] = (
    (Fusion.STACK, _stack),
    (Fusion.EPILOGUE, _epilogue),
    (Fusion.GLU, _glu),
    (Fusion.NORM_ROPE, _norm_rope),
    (Fusion.COMBINE_NORM, _combine_norm),
    (Fusion.NORM_INJECT, _norm_inject),
    (Fusion.HC_MIX, _hc_mix),
    (Fusion.KV_APPEND, _kv_append),
    (Fusion.MOE_OUT, _moe_out),
    (Fusion.GDN_GATES, _gdn_gates),
)


def fuse(g: "Graph") -> list[Item]:
    """g's ops with every rule its options allow applied (g itself is not changed; views of fused
    values are exposed on g)."""
    nodes = list(g.nodes)
    for fusion, rule in RULES:
        if g.options.fuses(fusion):
            rule(nodes, g)
    return nodes
