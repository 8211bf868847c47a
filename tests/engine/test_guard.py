"""The deep-context guard (engine/guard.py) on lavapipe with tiny models: under a small budget a
long prompt walks every step (KV q8_0, UB halved twice) at the depths the plan computed, completes
without an allocation failure and says so (lines, job log, metrics); with DEEPGUARD=0 the same
budget gives one clear DoesNotFit; after the KV re-quantization the logits stay within the q8_0
bound of the reference and the rows written after it are those of a q8_0 run from the start;
under MTP speculation the draft step switches the real draft head to MODEL_DRAFT_SMALL where the
plan says, greedy output staying plain decoding's; reset() restores the boot configuration."""

from __future__ import annotations

import io
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from fakes import ByteCodec
from hybrid_ref import rel
from qwen2_tiny import Geometry, write_qwen2
from vkflash.engine.api import SamplingParams, TokenEvent
from vkflash.engine.generate import generate
from vkflash.engine.gpu_forward import GpuForward
from vkflash.engine.guard import NO_LIMIT, GuardConfig, Kind
from vkflash.engine.plan import DraftFiles, Part, make_plan, usage
from vkflash.engine.speculate import Speculator
from vkflash.errors import DoesNotFit
from kv_q8 import kv_q8_0
from vkflash.formats.quants import dequantize
from vkflash.gpu import trace
from vkflash.gpu.budget import Budget
from vkflash.gpu.context import PlanningGpu
from vkflash.gpu.ops.attention import CacheType
from vkflash.model import reference
from vkflash.model.make_model import make_model
from vkflash.model.weights import load_model
from vkflash.engine.guard import memory_gauges

pytestmark = pytest.mark.gpu
# K/V (4 heads × 64, two layers) outweigh the compute buffers: the KV step is worth taking
GEO = Geometry(d=64, H=4, H_kv=4, Dh=64, F=96, V=200, L=2)
CTX, UB = 512, 64
NONE = Budget(0, "none")


@pytest.fixture
def model(tmp_path, rng) -> Path:
    """A tiny qwen2 (no MTP: the draft step does not apply)."""
    path = tmp_path / "q2.gguf"
    write_qwen2(path, rng, GEO)
    return path


def _plan(gpu, path: Path, nbytes: int, enabled: bool = True):
    """The plan under a budget, for the test Gpu's options (the forwards it is compared with)."""
    return make_plan(path, ctx=CTX, ub=UB, kv="f16", budget=Budget(nbytes, "test"), guard=GuardConfig(enabled=enabled),
                     suggest=False, options=gpu.options)


def _least_budget(gpu, path: Path) -> int:
    """The smallest budget (to 1 KiB) under which the plan fills the context: it needs every step."""
    free = make_plan(path, ctx=CTX, ub=UB, kv="f16", guard=GuardConfig(budget=NONE), suggest=False,
                     options=gpu.options)
    lo, hi = free.boot.usage.total, free.rows[-1].usage.total
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _plan(gpu, path, mid).fill_fits else (mid, hi)
    return hi


def _forward(gpu, path: Path, cfg: GuardConfig, kv: str = "f16", ub: int = UB, ctx: int = CTX) -> GpuForward:
    """The real forward as the server makes it (every graph reserved)."""
    fwd = GpuForward(path, ctx=ctx, ub=ub, kv=kv, gpu=gpu, guard=cfg)
    fwd.reserve()
    return fwd


def test_guard_walks_every_step_as_planned(gpu, rng, model, monkeypatch):
    """Under the least budget that fits, the plan takes all three steps; a 511-token prompt (two
    prefills) then a decode take them at the same depths, freeing the same bytes, stay within
    the budget, print a line each (and a job-log note), count in /metrics; reset() undoes them."""
    path = model
    budget = _least_budget(gpu, path)
    plan = _plan(gpu, path, budget)
    assert plan.fill_fits and [e.kind for e in plan.events] == [Kind.KV, Kind.UB, Kind.UB]
    job_log = io.StringIO()
    monkeypatch.setattr(trace, "OUT", job_log)
    logged = gpu.with_options(replace(gpu.options, tracing=replace(gpu.options.tracing, job_log=True)), own_arena=True)
    fwd = _forward(logged, path, GuardConfig(budget=Budget(budget, "test")))
    boot = usage(fwd)
    lines: list[str] = []
    fwd.guard.out = lines.append
    toks = rng.integers(0, GEO.V, CTX - 1)
    fwd.prefill(toks[:300])
    fwd.prefill(toks[300:])
    fwd.decode(int(toks[0]))
    assert [(e.depth, e.kind, e.freed) for e in fwd.guard.events] == [(e.depth, e.kind, e.freed) for e in plan.events]
    assert (fwd.model.kv.type, fwd.ub, fwd.n_past) == (CacheType.Q8_0, UB // 4, CTX)
    assert logged.ledger.total <= budget and usage(fwd).total == plan.rows[-1].usage.total
    assert len(lines) == 3 and all(ln.startswith("deep-context guard:") and "freed" in ln for ln in lines)
    assert job_log.getvalue().count("note deep-context guard:") == 3
    gauges = memory_gauges(fwd)
    assert fwd.guard_tier == 3 and gauges["guard_freed_bytes"][1] == sum(e.freed for e in plan.events) > 0
    assert gauges["memory_budget_bytes"][1] == budget
    fwd.reset()
    assert (fwd.guard_tier, fwd.model.kv.type, fwd.ub) == (0, CacheType.F16, UB)
    assert usage(fwd).total == boot.total


def test_deepguard_off_does_not_fit_clearly(gpu, rng, model):
    """DEEPGUARD=0 under the same budget: one DoesNotFit line naming the budget and DEEPGUARD=1,
    at the depth the plan without the guard stops; no allocation failed and the forward still
    serves a prompt that fits."""
    path = model
    budget = _least_budget(gpu, path)
    plan = _plan(gpu, path, budget, enabled=False)
    assert plan.fails_at is not None and not plan.events
    fwd = _forward(gpu.with_options(gpu.options, own_arena=True), path,
                   GuardConfig(enabled=False, budget=Budget(budget, "test")))
    toks = rng.integers(0, GEO.V, CTX - 1)
    with pytest.raises(DoesNotFit) as e:
        fwd.prefill(toks)
    msg = str(e.value)
    assert msg.startswith("does not fit") and "\n" not in msg and "DEEPGUARD=1" in msg and "test" in msg
    assert fwd.guard.held == plan.fails_at - 1 and not fwd.guard.events
    fwd.reset()
    fwd.prefill(toks[: plan.fails_at - 1 - UB])


def test_boot_over_budget_does_not_fit(gpu, model):
    """A budget below what the model holds at boot: DoesNotFit when the forward is made."""
    with pytest.raises(DoesNotFit, match="does not fit: the model needs"):
        GpuForward(model, ctx=CTX, ub=UB, gpu=gpu.with_options(gpu.options, own_arena=True),
                   guard=GuardConfig(budget=Budget(1 << 16, "test")))


def test_kv_step_always_has_room(gpu, rng, model):
    """Under budgets drawn between boot and the full context, every growth leaves room for the KV
    step's own transition (its largest q8_0 buffer at the positions then held) while that step is
    pending and a UB step could make room first; a walk that stops does so with the guard's own
    line, never an allocation's; and the depth reached never falls as the budget rises."""
    free = make_plan(model, ctx=CTX, ub=UB, kv="f16", guard=GuardConfig(budget=NONE), suggest=False,
                     options=gpu.options)
    lo, hi = free.boot.usage.total, free.rows[-1].usage.total
    reached = []
    for budget in sorted(int(b) for b in rng.integers(lo, hi, 40)):
        fwd = _forward(PlanningGpu(gpu.caps, gpu.options), model, GuardConfig(budget=NO_LIMIT))
        fwd.guard.out = lambda line: None
        fwd.guard.set_budget(fwd, Budget(budget, "test"))
        ledger, guard = fwd.gpu.ledger, fwd.guard
        try:
            while guard.held < CTX:
                guard.before_step(fwd, guard.held + 1)
                kv_left = Kind.KV in guard._own(fwd)
                ub_left = Kind.UB in guard._own(fwd)
                room = ledger.total + guard._transition_peak(fwd, Kind.KV, guard.held) <= budget
                assert room or not kv_left or not ub_left, (budget, guard.held, guard.events)
        except DoesNotFit as e:
            assert re.match(rf"does not fit: holding \d+ of {CTX} positions", str(e)), (budget, str(e))
        reached.append(guard.held)
    assert reached == sorted(reached), reached


def test_requantized_kv_logits(gpu, rng, tmp_path):
    """GUARD_KV=40 on an f16 run: before the step that reaches 48 the 32 positions written are
    re-quantized (each row the q8_0 codec of its f16 values); the logits of all 96 positions stay
    within the q8_0 bound of the float64 reference (5e-2·std, as KV=q8_0 from the start: measured
    ~1.3e-2); the rows written after the switch are byte for byte those of a KV=q8_0 run where they
    do not depend on earlier rows (layer 0). From position 48 on the logits differ from that run's
    only through the 32 early rows (f16-rounded before q8_0, and from an f16 run's activations):
    within the same q8_0 bound (measured ~8e-3·std, as much as f16 vs q8_0 runs differ)."""
    geo = Geometry(d=96, H=3, H_kv=1, Dh=32, F=160, V=301, L=2)
    path = tmp_path / "q2.gguf"
    write_qwen2(path, rng, geo, Q.F32)
    toks = rng.integers(0, geo.V, 96)
    when = {Kind.DRAFT: "auto", Kind.KV: 40, Kind.UB: "off"}
    fresh = gpu.with_options(gpu.options, own_arena=True)
    fwd = GpuForward(path, ctx=256, ub=16, kv="f16", gpu=fresh, guard=GuardConfig(when=when, budget=NONE))
    first = fwd.prefill_logits(toks[:32])
    f16_rows = {(i, x): getattr(kv, x).read(32) for i, kv in fwd.model.kv.layers.items() for x in "kv"}
    got = np.concatenate([first, fwd.prefill_logits(toks[32:])])
    assert [(e.depth, e.kind) for e in fwd.guard.events] == [(48, Kind.KV)]
    assert fwd.model.kv.type is CacheType.Q8_0
    for (i, x), rows in f16_rows.items():
        raw = getattr(fwd.model.kv[i], x).buf.read(np.uint8, 34 * rows.size // 32).reshape(-1, 34)
        want = kv_q8_0(rows.reshape(-1, 32)).reshape(-1, 34)
        step = np.abs(rows.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
        got_v, want_v = (dequantize(b.reshape(-1), Q.Q8_0, rows.size).reshape(-1, 32) for b in (raw, want))
        assert (raw == want).mean() > 0.99 and np.all(np.abs(got_v - want_v) <= 1.01 * step)
    ref = reference.prefill(toks, reference.new_state(load_model(path, np.float64), cache_dtype=np.float32))
    assert rel(got, ref) <= 5e-2
    q8 = GpuForward(path, ctx=256, ub=16, kv="q8_0", gpu=fresh, guard=GuardConfig(budget=NONE))
    want = q8.prefill_logits(toks)
    assert rel(got[48:], want[48:]) <= 5e-2
    row = 34 * geo.H_kv * geo.Dh // 32
    for x in "kv":
        a, b = getattr(fwd.model.kv[0], x).buf, getattr(q8.model.kv[0], x).buf
        assert np.array_equal(a.read(np.uint8, 64 * row, 32 * row), b.read(np.uint8, 64 * row, 32 * row))


def test_knobs_force_and_skip_steps(gpu, rng, model):
    """GUARD_UB=100 halves UB once when the context reaches 100 (not twice), with no budget at all;
    GUARD_KV=off under the least budget makes the guard go straight to UB."""
    path = model
    when = {Kind.DRAFT: "auto", Kind.KV: "auto", Kind.UB: 100}
    fwd = _forward(gpu.with_options(gpu.options, own_arena=True), path, GuardConfig(when=when, budget=NONE))
    fwd.prefill(rng.integers(0, GEO.V, 200))
    assert [(e.depth, e.kind) for e in fwd.guard.events] == [(128, Kind.UB)] and fwd.ub == UB // 2
    budget = _least_budget(gpu, path)
    skip_kv = GuardConfig(when={Kind.DRAFT: "auto", Kind.KV: "off", Kind.UB: "auto"})
    plan = make_plan(path, ctx=CTX, ub=UB, kv="f16", budget=Budget(budget, "t"), guard=skip_kv, suggest=False,
                     options=gpu.options)
    assert plan.events and all(e.kind is Kind.UB for e in plan.events)


V = 512  # the tiny qwen4exp's vocabulary


def _mtp_model(tmp_path: Path, rng: np.random.Generator, layout: str) -> tuple[Path, DraftFiles]:
    """A tiny qwen4exp (F32) with its MTP head in the model file (`in-file`) or in an MTP-only F32
    file (`separate`), and that head in Q8_0 as MODEL_DRAFT_SMALL (the same seed: the same weights
    before quantization)."""
    seed = int(rng.integers(1 << 31))
    small = make_model("qwen4exp", "tiny", "Q8_0", seed, tmp_path / "q.gguf", mtp_separate=True)[1]
    if layout == "in-file":
        return make_model("qwen4exp", "tiny", "F32", seed, tmp_path / "m.gguf", mtp_block=True)[0], DraftFiles(None, small)
    path, draft = make_model("qwen4exp", "tiny", "F32", seed, tmp_path / "t.gguf", mtp_separate=True)
    return path, DraftFiles(draft, small)


def _tokens(fwd, prompt: list[int], params: SamplingParams) -> list[int]:
    return [e.token for e in generate(fwd, ByteCodec(eog=-1), prompt, params, ubatch=16) if isinstance(e, TokenEvent)]


def test_ub_stays_a_verify_step(gpu, rng, tmp_path):
    """A forced UB step never halves UB below an MTP verify step (DRAFT 6: 7 tokens, one step):
    at UB 8 it is not taken, and a verify of 7 tokens runs; without MTP it halves UB 8 to 4."""
    path, _ = _mtp_model(tmp_path, rng, "in-file")
    cfg = GuardConfig(when={Kind.DRAFT: "auto", Kind.KV: "auto", Kind.UB: 1}, budget=NONE)
    sp = Speculator.open(path, ctx=64, ub=8, kv="f16", gpu=gpu, guard=cfg)
    sp.fwd.prefill(rng.integers(0, V, 3))
    assert sp.drafter.k_max == 6 and sp.fwd.ub == 8 and not sp.fwd.guard.events
    assert len(sp.fwd.verify(rng.integers(0, V, 7))) == 7
    plain = GpuForward(path, ctx=64, ub=8, kv="f16", gpu=gpu, guard=cfg)
    plain.prefill(rng.integers(0, V, 3))
    assert plain.ub == 4 and [e.kind for e in plain.guard.events] == [Kind.UB]


@pytest.mark.parametrize("layout", ["in-file", "separate"])
def test_guard_switches_the_mtp_draft_as_planned(gpu, rng, tmp_path, layout, monkeypatch):
    """MTP speculation (context 256, UB 32: the caches grow 64 positions at a time) under a budget one
    byte short of what the plan without the guard holds at 192 positions: the plan switches the
    draft head to MODEL_DRAFT_SMALL when the caches outgrow 128 positions, and takes no other step.
    Greedy generation after a 100-token prompt takes that step at the same depth and frees the same
    bytes, as the ledger shows around it (the weights the head held alone, the model's own blk.L
    included, less the small ones, and what its graphs' arena share changed by); it prints its line; the output is plain decoding's token for
    token; every part equals the plan's at 192. reset() brings the original draft back, byte for
    byte, and the boot memory with it."""
    path, draft = _mtp_model(tmp_path, rng, layout)
    ctx, ub = 256, 32
    free = make_plan(path, ctx=ctx, ub=ub, kv="f16", draft=draft, guard=GuardConfig(budget=NONE), suggest=False,
                     depths=(192,), options=gpu.options)
    budget = Budget(next(r for r in free.rows if r.depth == 192).usage.total - 1, "test")
    plan = make_plan(path, ctx=ctx, ub=ub, kv="f16", budget=budget, draft=draft, guard=GuardConfig(), suggest=False,
                     depths=(192,), options=gpu.options)
    assert plan.fill_fits and [(e.depth, e.kind) for e in plan.events] == [(128, Kind.DRAFT)]
    fresh = gpu.with_options(gpu.options, own_arena=True)
    sp = Speculator.open(path, draft.path, draft.small, ctx=ctx, ub=ub, kv="f16", gpu=fresh,
                         guard=GuardConfig(budget=budget))
    sp.fwd.reserve()
    d = sp.drafter
    boot, source = usage(sp.fwd), d.source
    assert boot == plan.boot.usage and d.can_shrink
    original = {n: t.buf.read(np.uint8) for n, t in d.d.model.weights.tensors.items()}
    lines: list[str] = []
    sp.fwd.guard.out = lines.append
    ledger: list[int] = []
    shrink = d.shrink

    def measured() -> None:
        ledger.append(fresh.ledger.total)
        shrink()
        ledger.append(fresh.ledger.total)

    monkeypatch.setattr(d, "shrink", measured)
    prompt = [int(t) for t in rng.integers(0, V, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    got = _tokens(sp, prompt, params)
    assert got == _tokens(GpuForward(path, ctx=ctx, ub=ub, kv="f16", gpu=gpu), prompt, params) and sp.drafted > 0
    (ev,) = sp.fwd.guard.events
    assert (ev.depth, ev.kind, ev.freed) == (plan.events[0].depth, Kind.DRAFT, plan.events[0].freed)
    assert ledger[0] - ledger[1] == ev.freed > 0 and fresh.ledger.total <= budget.nbytes
    assert lines == [ev.line()] and "MTP draft → its smaller quant" in lines[0]
    assert d.shrunk and not d.can_shrink and d.source == draft.small.name
    held = usage(sp.fwd)
    assert sp.fwd.guard.held == 192 and held == next(r for r in plan.rows if r.depth == 192).usage
    delta = {p: boot.parts[p] - held.parts[p] for p in (Part.DRAFT, Part.COMPUTE, Part.IO)}
    assert ev.freed == delta[Part.DRAFT] + delta[Part.COMPUTE] and delta[Part.IO] == 0  # the graphs built anew
    sp.reset()
    assert not d.shrunk and d.can_shrink and d.source == source and usage(sp.fwd) == boot
    for name, t in d.d.model.weights.tensors.items():
        assert np.array_equal(t.buf.read(np.uint8), original[name]), name
