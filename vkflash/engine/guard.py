"""The deep-context guard: caches that grow with the context, and the steps that keep a deep
sequence inside the memory budget (boot-fit is not fill-fit).

The K/V, indexer-key and summary caches hold memory for the positions written so far, grown in
chunks (engine/caches.py). Before a step that needs more, the guard computes what the growth
costs, from the live ledger (gpu/memory.py): the bytes held after it and its peak (a buffer's old
and new memory exist together while it is copied). When that would not fit the budget, or would
leave too little for the KV step's own transition at the new depth, it takes the next step, each
once, in order (a KV step that cannot make its transition now waits behind a UB step):

    draft  switch the MTP draft to its smaller quant (when a draft and MODEL_DRAFT_SMALL exist)
    kv     re-quantize the live K/V and indexer caches to q8_0 on the GPU, one buffer at a time
    ub     halve the prefill ubatch, twice (2048 → 1024 → 512), never below an MTP verify step
           (k_max + 1 tokens): a fresh arena, the graphs rebuilt

With DEEPGUARD=0 (or no step left) a growth that does not fit raises DoesNotFit: one clear line,
never an allocation failure. GUARD_<STEP>=<depth> forces a step once the context reaches that
depth, `off` skips it. The memory planner (engine/plan.py) runs this same code on a planning Gpu,
so the depths at which the steps engage are the plan's thresholds. Each step prints one line
(what, why, bytes freed) on stderr, goes to the job log and counts in /metrics (guard_tier, bytes freed).
reset() of a forward puts back the boot configuration once any step was taken.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from vkflash import settings
from vkflash.engine.caches import IndexerCache, KVCaches, LayerKV, growable_cache, held_positions, summary_bytes
from vkflash.errors import DoesNotFit
from vkflash.gpu import trace
from vkflash.gpu.budget import Budget, detect
from vkflash.gpu.device import Capabilities
from vkflash.gpu.memory import Buffer, fmt_bytes
from vkflash.gpu.ops.attention import Cache, CacheType
from vkflash.gpu.ops.requant import requant_q8_0

if TYPE_CHECKING:
    from vkflash.engine.gpu_forward import GpuForward
    from vkflash.gpu.graph import Graph

NO_LIMIT = Budget(0, "none")


class Kind(str, Enum):
    """The guard's steps, in the order it takes them."""

    DRAFT = "draft"
    KV = "kv"
    UB = "ub"


KNOB = {Kind.DRAFT: "GUARD_DRAFT", Kind.KV: "GUARD_KV", Kind.UB: "GUARD_UB"}
UB_HALVINGS = 2


class Draft(Protocol):
    """What the guard, the forward and the memory plan need of an MTP draft (engine/draft.py
    MtpDrafter, as `GpuForward.draft`)."""

    k_max: int  # most tokens a round drafts: its verify is one step of k_max + 1 tokens

    @property
    def can_shrink(self) -> bool:
        """A smaller quant is given and not in use."""

    def weights(self) -> list[Buffer]:
        """The buffers of the weights it holds alone."""

    def io(self) -> list[Buffer]:
        """Its step params and head buffers."""

    def fills(self) -> list["Fill"]:
        """Its caches, which grow with the context."""

    def graphs(self) -> list["Graph"]:
        """Its graphs built so far."""

    def reserve(self) -> None:
        """Build and place every graph a run can use at the forward's ubatch (GpuForward.reserve)."""

    def shrink(self) -> None:
        """Free the weights and load the smaller quant."""

    def restore(self) -> None:
        """Back to the quant it started with."""


@dataclass(frozen=True)
class Fill:
    """A growable buffer and the bytes it must hold for positions [0, t)."""

    buf: Buffer
    bytes_at: Callable[[int], int]


@dataclass(frozen=True)
class Event:
    """One step the guard took: at which depth (the positions the caches held when the context
    outgrew them; a forcing knob's: the context reached), what, why, and the bytes it returned."""

    depth: int
    kind: Kind
    what: str
    why: str
    freed: int

    def line(self) -> str:
        return f"deep-context guard: {self.what} at depth {self.depth} ({self.why}); freed {fmt_bytes(self.freed)}"


@dataclass(frozen=True)
class GuardConfig:
    """DEEPGUARD, GUARD_<STEP> ("auto" | "off" | a depth) and the budget (None: detect at start)."""

    enabled: bool = True
    when: dict[Kind, str | int] = field(default_factory=lambda: {k: "auto" for k in Kind})
    budget: Budget | None = None
    override: int = 0  # VKFLASH_MEM_BUDGET (0: the device's)

    @classmethod
    def from_settings(cls, s: settings.Settings | None = None) -> "GuardConfig":
        s = s or settings.current()
        return cls(bool(s["DEEPGUARD"]), {k: s[KNOB[k]] for k in Kind}, None, int(s["VKFLASH_MEM_BUDGET"]))


def indexer_caches(state: object) -> dict[int, IndexerCache]:
    """The QSA indexer caches of an arch's sequence state (none for archs without QSA)."""
    return getattr(state, "idx", {})


def cache_fill(c: Cache) -> Fill:
    """A K/V or indexer-key cache as a Fill."""
    return Fill(c.buf, lambda t, c=c: Cache.nbytes(t, c.n_heads, c.dim, c.type))


class Guard:
    """The caches' growth and the guard's steps for one GpuForward (see the module docstring)."""

    def __init__(self, cfg: GuardConfig, n_ctx: int, kv: CacheType, ub: int, caps: Capabilities) -> None:
        """Before the forward allocates: the budget is what the device and system give now."""
        self.cfg = cfg
        self.n_ctx = n_ctx
        self.held = held_positions(1, n_ctx)  # positions the caches hold memory for
        self.boot = (kv, ub, self.held)
        self.budget = cfg.budget or detect(caps, cfg.override)
        self.events: list[Event] = []
        self._forced = self._next_forced()  # the least depth a GUARD_<STEP> knob forces a step at
        self.out: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)

    # --- state ----------------------------------------------------------------------------
    @property
    def tier(self) -> int:
        """Steps taken since boot (or the last reset)."""
        return len(self.events)

    @property
    def freed(self) -> int:
        """Bytes the steps returned."""
        return sum(e.freed for e in self.events)

    def taken_beyond(self, n: int) -> bool:
        """Whether a step was taken at a depth a sequence of n tokens does not pass (a prefix that
        short, run alone, would not have taken it)."""
        return any(e.depth >= n for e in self.events)

    def start(self, fwd: "GpuForward") -> None:
        """After the boot allocations: the budget becomes the ledger's limit, and must hold them."""
        self.set_budget(fwd, self.budget)

    def set_budget(self, fwd: "GpuForward", budget: Budget) -> None:
        """Enforce `budget` from now on (DoesNotFit when what the forward holds already exceeds it)."""
        self.budget = budget
        ledger = fwd.gpu.ledger
        if budget.nbytes and ledger.total > budget.nbytes:
            raise DoesNotFit(f"does not fit: the model needs {fmt_bytes(ledger.total)} at boot, the budget is {budget}; "
                             f"`vkflash plan` says which knob helps")
        ledger.limit = budget.nbytes

    def fills(self, fwd: "GpuForward") -> list[Fill]:
        """Every buffer that grows with the context: K/V, indexer keys and summary rows, the draft's."""
        out = [cache_fill(c) for kv in fwd.model.kv.layers.values() for c in (kv.k, kv.v)]
        for ic in indexer_caches(fwd.model.state).values():
            out.append(cache_fill(ic.keys))
            out.append(Fill(ic.summary, lambda t, ic=ic: summary_bytes(t, ic.r, ic.keys.dim)))
        if fwd.draft is not None:
            out += fwd.draft.fills()
        return out

    # --- growth ---------------------------------------------------------------------------
    def _growth(self, fwd: "GpuForward", target: int) -> tuple[list[tuple[Buffer, int]], int, int]:
        """(buffer, new bytes) in the order they grow (largest first), the bytes held after and the peak."""
        ledger = fwd.gpu.ledger
        moves = sorted(((f.buf, f.bytes_at(target)) for f in self.fills(fwd)), key=lambda m: -m[0].committed)
        held, peak = ledger.total, ledger.total
        for buf, n in moves:
            if ledger.counts(buf) and n != buf.committed:
                peak = max(peak, held + n)
                held += n - buf.committed
        return moves, held, peak

    def before_step(self, fwd: "GpuForward", need: int) -> None:
        """Make the caches hold positions [0, need), a chunk at a time (the plan walks the same
        chunks), taking the guard's steps where a growth would not fit; DoesNotFit when nothing
        makes it fit."""
        if need >= self._forced:
            taken = {e.kind for e in self.events}
            for kind in dict.fromkeys(self._pending(fwd)):  # a knob forces a step once (UB: its first halving)
                when = self.cfg.when[kind]
                if kind not in taken and isinstance(when, int) and when <= need:
                    self._engage(fwd, kind, need, f"{KNOB[kind]}={when}")
            self._forced = self._next_forced()
        if need <= self.held:
            return
        while self.held < need:
            self._grow(fwd, held_positions(self.held + 1, self.n_ctx))

    def _grow(self, fwd: "GpuForward", target: int) -> None:
        """Grow every cache to hold `target` positions, after the steps that make it fit."""
        limit = fwd.gpu.ledger.limit
        while True:
            moves, held, peak = self._growth(fwd, target)
            nxt = self._next(fwd)
            reserve = max((self._transition_peak(fwd, k, target) for k in self._own(fwd)), default=0)
            if not limit or (peak <= limit and held + reserve <= limit):
                break
            if nxt is None:
                if peak <= limit:
                    break  # no step is left to keep room for
                raise DoesNotFit(self._no_fit(fwd, target, held, peak))
            why = (f"holding {target} positions peaks at {fmt_bytes(peak)}, over the {fmt_bytes(limit)} budget"
                   if peak > limit else f"after holding {target} positions ({fmt_bytes(held)} of {fmt_bytes(limit)}) "
                   f"no room would be left for re-quantizing the KV ({fmt_bytes(reserve)} more for a moment)")
            self._engage(fwd, nxt, self.held, why)
        for buf, n in moves:
            fwd.gpu.commit(buf, n)
        self.held = target

    def _no_fit(self, fwd: "GpuForward", target: int, held: int, peak: int) -> str:
        hint = ("DEEPGUARD=1 would re-quantize the KV to q8_0 and halve UB as the context fills"
                if not self.cfg.enabled and self._pending(fwd) else "the guard has no step left")
        return (f"does not fit: holding {target} of {self.n_ctx} positions needs {fmt_bytes(held)} "
                f"({fmt_bytes(peak)} while growing), the budget is {self.budget}; {hint}; "
                f"or a smaller CTX, KV=q8_0, a smaller UB, more memory (`vkflash plan` shows what fits)")

    # --- steps ----------------------------------------------------------------------------
    def _pending(self, fwd: "GpuForward") -> list[Kind]:
        """Steps that apply and were not taken, in order."""
        taken = [e.kind for e in self.events]
        out = []
        if fwd.draft is not None and fwd.draft.can_shrink and Kind.DRAFT not in taken:
            out.append(Kind.DRAFT)
        caches = self._caches(fwd)
        if (Kind.KV not in taken and fwd.model.kv.type is not CacheType.Q8_0 and caches
                and all(c.dim % 32 == 0 for c in caches)):
            out.append(Kind.KV)
        verify = fwd.draft.k_max + 1 if fwd.draft is not None else 1  # an MTP verify is one step, never split
        halvings = max(0, (fwd.ub // verify).bit_length() - 1)
        out += [Kind.UB] * min(UB_HALVINGS - taken.count(Kind.UB), halvings)
        return out

    def _next_forced(self) -> float:
        """The least forcing depth of a step not taken yet (inf: none)."""
        taken = {e.kind for e in self.events}
        return min((w for k, w in self.cfg.when.items() if isinstance(w, int) and k not in taken
                    and self.cfg.enabled), default=float("inf"))

    def _own(self, fwd: "GpuForward") -> list[Kind]:
        """The steps the guard may still take on its own (DEEPGUARD=1, not `off`), in order."""
        return [k for k in self._pending(fwd) if self.cfg.when[k] != "off"] if self.cfg.enabled else []

    def _next(self, fwd: "GpuForward") -> Kind | None:
        """The first of them whose own transition fits now (the KV step waits while it does not;
        a UB step, freeing first, may make room for it)."""
        ledger = fwd.gpu.ledger

        def fits_now(k: Kind) -> bool:
            return not ledger.limit or ledger.total + self._transition_peak(fwd, k, self.held) <= ledger.limit
        return next((k for k in self._own(fwd) if fits_now(k)), None)

    def _transition_peak(self, fwd: "GpuForward", kind: Kind, positions: int) -> int:
        """Bytes a step taken while the caches hold `positions` holds for a moment beyond what it
        frees: re-quantization allocates each q8_0 buffer before freeing its source; the draft
        and UB steps free first."""
        if kind is not Kind.KV:
            return 0
        return max((Cache.nbytes(positions, c.n_heads, c.dim, CacheType.Q8_0) for c in self._caches(fwd)), default=0)

    def _caches(self, fwd: "GpuForward") -> list[Cache]:
        return ([c for kv in fwd.model.kv.layers.values() for c in (kv.k, kv.v)]
                + [ic.keys for ic in indexer_caches(fwd.model.state).values()])

    def _engage(self, fwd: "GpuForward", kind: Kind, depth: int, why: str) -> None:
        """Take one step and say so."""
        before = fwd.gpu.ledger.total
        if kind is Kind.DRAFT:
            assert fwd.draft is not None
            fwd.draft.shrink()
            what = "MTP draft → its smaller quant"
        elif kind is Kind.KV:
            what = f"KV and indexer caches {fwd.model.kv.type.value} → q8_0"
            self._retype(fwd, CacheType.Q8_0, fwd.n_past, self.held)
        else:
            what = f"UB {fwd.ub} → {fwd.ub // 2}"
            fwd.set_ubatch(fwd.ub // 2)
        ev = Event(depth, kind, what, why, before - fwd.gpu.ledger.total)
        self.events.append(ev)
        self.out(ev.line())
        trace.note(fwd.gpu.options.tracing, ev.line())

    def _retype(self, fwd: "GpuForward", to: CacheType, n_keep: int, held: int) -> None:
        """Every K/V and indexer-key cache as `to`, holding `held` positions; the first n_keep
        re-quantized on the GPU, one buffer at a time (each source freed once copied)."""
        gpu = fwd.gpu

        def convert(c: Cache) -> Cache:
            new = growable_cache(gpu, c.n_ctx, c.n_heads, c.dim, to, held, c.buf.name)
            if n_keep:
                g = gpu.graph(f"requant.{c.buf.name}")
                requant_q8_0(g, c, new, n_keep, name=f"requant.{c.buf.name}")
                g.run()
            gpu.free(c.buf)
            return new

        kv = fwd.model.kv
        fwd.model.kv = KVCaches(kv.n_ctx, to, {i: LayerKV(convert(l.k), convert(l.v)) for i, l in kv.layers.items()})
        idx = indexer_caches(fwd.model.state)
        for i, ic in idx.items():
            idx[i] = IndexerCache(convert(ic.keys), ic.summary, ic.r)
        fwd.drop_graphs()

    def reset(self, fwd: "GpuForward") -> None:
        """A new sequence: after any step, back to the boot cache type, ubatch, draft and held
        positions (the caches emptied first, so nothing peaks)."""
        if not self.events:
            return
        kv, ub, held = self.boot
        for f in self.fills(fwd):
            fwd.gpu.commit(f.buf, f.bytes_at(held), keep=0)
        self.held = held
        if fwd.model.kv.type is not kv:
            self._retype(fwd, kv, 0, held)
        if fwd.draft is not None:
            fwd.draft.restore()
        fwd.set_ubatch(ub)
        self.events = []
        self._forced = self._next_forced()


def memory_gauges(fwd: Any) -> dict[str, tuple[str, float]]:
    """Memory held against the budget and what the guard's steps returned (GPU forward only)."""
    guard = getattr(fwd, "guard", None)
    if guard is None:
        return {}
    return {"guard_freed_bytes": ("bytes the deep-context guard's steps returned", float(guard.freed)),
            "memory_bytes": ("bytes held against the memory budget", float(fwd.gpu.ledger.total)),
            "memory_budget_bytes": ("the memory budget", float(guard.budget.nbytes))}
