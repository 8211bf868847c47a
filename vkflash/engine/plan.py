"""The memory plan: what a model needs at each depth of its context, by part, against the budget.

Nothing here estimates. The plan builds the real GpuForward on a PlanningGpu (gpu/context.py),
whose buffers are sizes only: the same code allocates the weights (sizes from the GGUF header,
stacks and re-layouts as uploaded, no tensor data read), the caches, the recurrent states and
the step params, and `reserve()` builds and places every step graph a run uses, so the compute
buffers are the liveness allocator's arena. Then it walks the context chunk by chunk through the
deep-context guard (engine/guard.py), the same code the run executes: the caches grow, and where
the budget would not hold them the guard's steps engage, at the depths the plan reports.

Parts: weights (uploaded, also by GGML type; host-gathered tables are mmapped file pages, shown
apart and not counted: the page cache can evict them), kv (attention K/V), indexer (QSA keys and
summary rows), states (recurrent rows, in the planes a verify step rolls back to), checkpoints (copies
of the recurrent rows kept for prompt reuse, CACHE_CKPT of them: engine/prefix.py), compute (arena and
graph-owned buffers), io (step params, logits, argmax ids, staging ring), draft and draft kv (the
MTP draft's weights and its K/V cache). With a draft the forward is the speculator's (mtp=True)
and the draft head is the real one (engine/draft.py) on the planning Gpu: its weights as uploaded,
its cache, its step params and head buffers and the target's h_nextn rows (io), its graphs and the
verify steps placed by `reserve()` (compute); the guard's draft step switches it to
MODEL_DRAFT_SMALL here as in a run.
Budgeted bytes are everything on UMA (weights host-visible, no staging); device-local memory on a
discrete GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

from vkflash import settings
from vkflash.engine.caches import IndexerCache, cache_type
from vkflash.engine.gpu_forward import GpuForward
from vkflash.engine.guard import NO_LIMIT, Event, GuardConfig, indexer_caches
from vkflash.engine.speculate import Speculator
from vkflash.engine.state import RecurrentState, recurrent_of
from vkflash.errors import DoesNotFit
from vkflash.gpu.budget import Budget, detect
from vkflash.gpu.context import PlanningGpu
from vkflash.gpu.device import Capabilities, probe
from vkflash.gpu.memory import Buffer, fmt_bytes
from vkflash.gpu.ops.attention import CacheType
from vkflash.gpu.options import GpuOptions

DEPTHS = (0, 32768, 65536, 98304, 131072, 196608)
"""The depths the plan reports (and the full context)."""


class Part(str, Enum):
    """What the bytes are for."""

    WEIGHTS = "weights"
    KV = "kv"
    INDEXER = "indexer"
    STATES = "states"
    CHECKPOINTS = "checkpoints"
    COMPUTE = "compute"
    IO = "io"
    DRAFT = "draft"
    DRAFT_KV = "draft kv"


def _recurrent(st: RecurrentState | None) -> list[Buffer]:
    """The recurrent rows' buffers: every state's planes and the live-plane index."""
    if st is None:
        return []
    bufs = [layer.conv.buf for layer in st.gdn.values()] + [layer.ssm.buf for layer in st.gdn.values()]
    if st.ple_conv is not None:
        bufs.append(st.ple_conv.buf)
    return bufs + [st.index]


def buffers_by_part(fwd: GpuForward) -> dict[Part, list[Buffer]]:
    """Every buffer the forward holds, by part (each once)."""
    m = fwd.model
    st = m.state
    rec = recurrent_of(st)
    idx: dict[int, IndexerCache] = indexer_caches(st)
    parts = {
        Part.WEIGHTS: [t.buf for t in m.weights.tensors.values()],
        Part.KV: [c.buf for kv in m.kv.layers.values() for c in (kv.k, kv.v)],
        Part.INDEXER: [b for ic in idx.values() for b in (ic.keys.buf, ic.summary)],
        Part.STATES: _recurrent(rec),
        Part.CHECKPOINTS: list(rec.saved) if rec is not None else [],
        Part.COMPUTE: list(fwd.gpu.arena.slots) + [b for g in fwd.graphs() for b in g.owned],
        Part.IO: [m.params.buf, m.head.logits, m.head.ids] + ([m.hidden] if m.hidden is not None else [])
        + fwd.gpu.staged(),
        Part.DRAFT: [],
        Part.DRAFT_KV: [],
    }
    if fwd.draft is not None:
        parts[Part.COMPUTE] += [b for g in fwd.draft.graphs() for b in g.owned]
        parts[Part.IO] += fwd.draft.io()
        parts[Part.DRAFT] = fwd.draft.weights()
        parts[Part.DRAFT_KV] = [f.buf for f in fwd.draft.fills()]
    return {p: list({b.id: b for b in bufs}.values()) for p, bufs in parts.items()}


@dataclass(frozen=True)
class Usage:
    """Committed bytes by part; `total` is what counts against the budget, `host` the rest."""

    parts: dict[Part, int]
    total: int
    host: int
    unaccounted: int  # live buffers of the Gpu in no part (0 when the parts are complete)


def usage(fwd: GpuForward) -> Usage:
    """What the forward holds now, by part, checked against the GPU layer's ledger."""
    ledger = fwd.gpu.ledger
    by_part = buffers_by_part(fwd)
    parts = {p: sum(b.committed for b in bufs) for p, bufs in by_part.items()}
    seen = {b.id for bufs in by_part.values() for b in bufs}
    rest = sum(b.committed for b in ledger.buffers() if b.id not in seen)
    return Usage(parts, ledger.total, ledger.host, rest)


@dataclass(frozen=True)
class Row:
    """The plan at one depth: the configuration in force, bytes by part, the budgeted total."""

    depth: int
    held: int  # positions the caches hold memory for
    kv: str
    ub: int
    tier: int
    usage: Usage
    event: str = ""  # the guard step taken on the way to this depth, if any

    def headroom(self, budget: int) -> int:
        """Budget left at this depth (0 without a budget)."""
        return budget - self.usage.total if budget else 0


@dataclass
class Plan:
    """A model's memory plan under one configuration and budget."""

    model: str
    arch: str
    n_ctx: int
    ub: int
    kv: str
    budget: Budget
    uma: bool
    guard: bool
    weight_types: dict[str, int]  # uploaded weight bytes by GGML type
    mmap_types: dict[str, int]  # bytes of host-gathered tables (mmapped file pages, not counted), by type
    rows: list[Row] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    fails_at: int | None = None  # the depth the guard could not make fit (None: the full context fits)
    error: str = ""
    makes_it_fit: str = ""  # the first knob change that fits, when this does not

    @property
    def mmapped(self) -> int:
        """Bytes of host-gathered tables (not counted)."""
        return sum(self.mmap_types.values())

    @property
    def boot(self) -> Row:
        """The row at depth 0: what is held at start."""
        return self.rows[0]

    @property
    def boot_fits(self) -> bool:
        """What is held at start fits the budget."""
        return not self.budget.nbytes or self.boot.usage.total <= self.budget.nbytes

    @property
    def fill_fits(self) -> bool:
        """It boots and, with the guard's steps, holds the full context."""
        return self.boot_fits and self.fails_at is None

    def thresholds(self) -> str:
        """`KV q8_0 at 131072, UB 1024 at 196608` style list of the guard's steps."""
        return ", ".join(f"{e.what} at {e.depth}" for e in self.events)

    def summary(self) -> str:
        """One line: the configuration, boot-fit, fill-fit with the guard's steps, what fits if not."""
        head = (f"memory plan: {self.arch} {self.n_ctx} positions, UB {self.ub}, KV {self.kv}, budget {self.budget}: "
                f"boot {fmt_bytes(self.boot.usage.total)}")
        if not self.boot_fits:
            return head + " does NOT fit" + (f"; {self.makes_it_fit} would fit" if self.makes_it_fit else "")
        full = self.rows[-1]
        if self.fails_at is not None:
            tail = f"; fills to {self.fails_at - 1} positions only" + (
                f" ({self.thresholds()})" if self.events else "") + (
                f"; {self.makes_it_fit} would fit" if self.makes_it_fit else "")
            return head + " fits" + tail
        steps = f" with the guard: {self.thresholds()}" if self.events else ""
        mm = f"; {fmt_bytes(self.mmapped)} mmapped" if self.mmapped else ""
        return head + f" fits; full depth {fmt_bytes(full.usage.total)} fits{steps}{mm}"

    def to_json(self) -> dict:
        """Everything above as plain JSON values (`vkflash plan --json`)."""
        return {
            "model": self.model, "arch": self.arch, "n_ctx": self.n_ctx, "ub": self.ub, "kv": self.kv,
            "budget": self.budget.nbytes, "budget_source": self.budget.source, "uma": self.uma, "guard": self.guard,
            "weight_types": self.weight_types, "mmap_types": self.mmap_types, "boot_fits": self.boot_fits,
            "fill_fits": self.fill_fits,
            "fails_at": self.fails_at, "error": self.error, "makes_it_fit": self.makes_it_fit,
            "events": [{"depth": e.depth, "step": e.kind.value, "what": e.what, "why": e.why, "freed": e.freed}
                       for e in self.events],
            "rows": [{"depth": r.depth, "held": r.held, "kv": r.kv, "ub": r.ub, "tier": r.tier, "event": r.event,
                      "parts": {p.value: n for p, n in r.usage.parts.items()}, "total": r.usage.total,
                      "host": r.usage.host, "headroom": r.headroom(self.budget.nbytes)} for r in self.rows],
        }


@dataclass(frozen=True)
class DraftFiles:
    """The MTP draft to plan with (`--mtp`): an MTP-only GGUF (None: the model's own block) and an
    optional smaller quant for the guard's draft step."""

    path: Path | None = None
    small: Path | None = None

    @classmethod
    def from_settings(cls, s: settings.Settings | None = None) -> "DraftFiles":
        """MODEL_DRAFT and MODEL_DRAFT_SMALL."""
        s = s or settings.current()
        return cls(Path(s["MODEL_DRAFT"]) if s["MODEL_DRAFT"] else None,
                   Path(s["MODEL_DRAFT_SMALL"]) if s["MODEL_DRAFT_SMALL"] else None)


def _row(fwd: GpuForward, depth: int, event: str = "") -> Row:
    return Row(depth, fwd.guard.held, fwd.model.kv.type.value, fwd.ub, fwd.guard.tier, usage(fwd), event)


def _walk(fwd: GpuForward, plan: Plan, depths: Sequence[int]) -> None:
    """Grow the caches chunk by chunk to the full context through the guard, a row at each of
    `depths` passed (and the full context) and at each step the guard takes."""
    guard = fwd.guard
    wanted = sorted({d for d in depths if 0 < d < fwd.n_ctx} | {fwd.n_ctx})
    while guard.held < fwd.n_ctx:
        need = guard.held + 1
        taken = len(guard.events)
        try:
            guard.before_step(fwd, need)
        except DoesNotFit as e:
            plan.fails_at, plan.error = need, str(e)
            break
        finally:
            plan.events = list(guard.events)
        new = guard.events[taken:]
        passed = [d for d in wanted if d <= guard.held]
        for d in passed:
            wanted.remove(d)
        if new:
            plan.rows.append(_row(fwd, new[0].depth, "; ".join(e.what for e in new)))
        plan.rows += [_row(fwd, d) for d in passed]


def make_plan(model: str | os.PathLike[str], ctx: int | None = None, ub: int | None = None, kv: str | None = None,
              budget: Budget | None = None, draft: DraftFiles | None = None, uma: bool | None = None,
              guard: GuardConfig | None = None, caps: Capabilities | None = None, suggest: bool = True,
              depths: Sequence[int] = DEPTHS, options: GpuOptions | None = None) -> Plan:
    """The plan of `model` at `depths` (ctx/ub/kv/guard and the Gpu `options` default to the knobs;
    the budget to the device's or VKFLASH_MEM_BUDGET; uma overrides the device's kind: plan a Strix
    Halo from another machine); with `draft`, of MTP speculation with that draft. With `suggest`, a
    plan that does not fit also says which knob change first makes it fit."""
    s = settings.current()
    caps = caps or probe(s["VKFLASH_DEVICE"])
    if uma is not None:
        caps = replace(caps, uma=uma)
    cfg = guard or GuardConfig.from_settings(s)
    budget = budget or detect(caps, cfg.override)
    gpu = PlanningGpu(caps, options or GpuOptions.from_settings(s))
    forward: dict = dict(ctx=ctx, ub=ub, kv=kv, gpu=gpu, guard=replace(cfg, budget=NO_LIMIT))
    if draft is not None:  # the speculator the run opens, its draft head on the planning Gpu
        fwd = Speculator.open(model, draft.path, draft.small, **forward).fwd
    else:
        fwd = GpuForward(model, **forward)
    fwd.guard.out = lambda line: None
    fwd.reserve()
    w = fwd.model.weights
    uploaded: dict[str, int] = {}
    for t in w.tensors.values():
        uploaded[t.qtype.name] = uploaded.get(t.qtype.name, 0) + t.nbytes
    mapped: dict[str, int] = {}
    for name in set(w.file.tensors) - set(w.tensors):
        info = w.file.tensors[name]
        mapped[info.ggml_type.name] = mapped.get(info.ggml_type.name, 0) + info.nbytes
    plan = Plan(str(model), fwd.hp.arch, fwd.n_ctx, fwd.ub, fwd.model.kv.type.value, budget, caps.uma,
                cfg.enabled, uploaded, mapped, [_row(fwd, 0)])
    if plan.boot_fits:
        fwd.guard.set_budget(fwd, budget)
        _walk(fwd, plan, depths)
    if suggest and not plan.fill_fits:
        plan.makes_it_fit = _what_fits(plan, model, ctx, kv, budget, draft, uma, cfg, caps)
    return plan


def _what_fits(plan: Plan, model: str | os.PathLike[str], ctx: int | None, kv: str | None, budget: Budget,
               draft: DraftFiles | None, uma: bool | None, cfg: GuardConfig, caps: Capabilities) -> str:
    """The first of DEEPGUARD=1, KV=q8_0, UB halved once or twice, both, then a smaller CTX, whose
    plan fits; empty when none does."""
    tries: list[tuple[str, Callable[[], Plan]]] = []

    def again(**kw: object) -> Callable[[], Plan]:
        args: dict = dict(ctx=ctx, ub=plan.ub, kv=kv, budget=budget, draft=draft, uma=uma, guard=cfg, caps=caps,
                          suggest=False, depths=())
        args.update(kw)
        return lambda: make_plan(model, **args)

    if not cfg.enabled:
        tries.append(("DEEPGUARD=1", again(guard=replace(cfg, enabled=True))))
    q8 = cache_type(plan.kv) is not CacheType.Q8_0
    if q8:
        tries.append(("KV=q8_0", again(kv="q8_0")))
    for k in (1, 2):
        if plan.ub >> k:
            tries.append((f"UB={plan.ub >> k}", again(ub=plan.ub >> k)))
    if q8 and plan.ub >> 2:
        tries.append((f"KV=q8_0 UB={plan.ub >> 2}", again(kv="q8_0", ub=plan.ub >> 2)))
    for label, attempt in tries:
        if attempt().fill_fits:
            return label
    if plan.boot_fits and plan.fails_at is not None:
        return f"CTX={plan.fails_at - 1}"
    return ""
