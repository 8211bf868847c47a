"""The deep-context guard (engine/guard.py) on lavapipe with tiny models: under a small budget a
long prompt walks every step (smaller draft, KV q8_0, UB halved twice) at the depths the plan
computed, completes without an allocation failure and says so (lines, job log, metrics); with
DEEPGUARD=0 the same budget gives one clear DoesNotFit; after the KV re-quantization the logits
stay within the q8_0 bound of the reference and the rows written after it are those of a q8_0
run from the start; reset() restores the boot configuration."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from qwen2_tiny import Geometry, write_qwen2
from vkflash.engine.gpu_forward import GpuForward
from vkflash.engine.guard import GuardConfig, Kind
from vkflash.engine.plan import DraftFiles, DraftMemory, make_plan, usage
from vkflash.errors import DoesNotFit
from vkflash.formats.gguf_write import write_gguf
from kv_q8 import kv_q8_0
from vkflash.formats.quants import dequantize
from vkflash.gpu import trace
from vkflash.gpu.budget import Budget
from vkflash.gpu.ops.attention import CacheType
from vkflash.model import reference
from vkflash.model.weights import load_model
from vkflash.server.app import _memory_gauges

pytestmark = pytest.mark.gpu
# K/V (4 heads × 64, two layers) outweigh the compute buffers: the KV step is worth taking
GEO = Geometry(d=64, H=4, H_kv=4, Dh=64, F=96, V=200, L=2)
CTX, UB = 512, 64
NONE = Budget(0, "none")


@pytest.fixture
def model(tmp_path, rng) -> tuple[Path, DraftFiles]:
    """A tiny qwen2 and a draft of 160 KiB with a 16 KiB smaller quant (their headers are all the
    guard's stand-in draft reads)."""
    path = tmp_path / "q2.gguf"
    write_qwen2(path, rng, GEO)
    files = []
    for name, rows in (("big", 640), ("small", 64)):
        files.append(tmp_path / f"draft-{name}.gguf")
        write_gguf(files[-1], "qwen2", {}, {"blk.2.nextn.eh_proj.weight": np.zeros((rows, 64), np.float32)})
    return path, DraftFiles(*files)


def _plan(path: Path, draft: DraftFiles | None, nbytes: int, enabled: bool = True):
    return make_plan(path, ctx=CTX, ub=UB, kv="f16", budget=Budget(nbytes, "test"), draft=draft,
                     guard=GuardConfig(enabled=enabled), suggest=False)


def _least_budget(path: Path, draft: DraftFiles) -> int:
    """The smallest budget (to 1 KiB) under which the plan fills the context: it needs every step."""
    free = make_plan(path, ctx=CTX, ub=UB, kv="f16", draft=draft, guard=GuardConfig(budget=NONE), suggest=False)
    lo, hi = free.boot.usage.total, free.rows[-1].usage.total
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _plan(path, draft, mid).fill_fits else (mid, hi)
    return hi


def _forward(gpu, path: Path, draft: DraftFiles | None, cfg: GuardConfig, kv: str = "f16", ub: int = UB,
             ctx: int = CTX) -> GpuForward:
    """The real forward as the server makes it (draft memory added, every graph reserved)."""
    fwd = GpuForward(path, ctx=ctx, ub=ub, kv=kv, gpu=gpu, guard=cfg)
    if draft is not None:
        fwd.draft = DraftMemory(gpu, draft.big, draft.small, fwd)
    fwd.reserve()
    return fwd


def test_guard_walks_every_step_as_planned(gpu, rng, model, monkeypatch):
    """Under the least budget that fits, the plan takes all four steps; a 511-token prompt (two
    prefills) then a decode take them at the same depths, freeing the same bytes, stay within
    the budget, print a line each (and a job-log note), count in /metrics; reset() undoes them."""
    path, draft = model
    budget = _least_budget(path, draft)
    plan = _plan(path, draft, budget)
    assert plan.fill_fits and [e.kind for e in plan.events] == [Kind.DRAFT, Kind.KV, Kind.UB, Kind.UB]
    job_log = io.StringIO()
    monkeypatch.setattr(trace, "OUT", job_log)
    logged = gpu.with_options(replace(gpu.options, tracing=replace(gpu.options.tracing, job_log=True)), own_arena=True)
    fwd = _forward(logged, path, draft, GuardConfig(budget=Budget(budget, "test")))
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
    assert len(lines) == 4 and all(ln.startswith("deep-context guard:") and "freed" in ln for ln in lines)
    assert job_log.getvalue().count("note deep-context guard:") == 4
    gauges = _memory_gauges(fwd)
    assert fwd.guard_tier == 4 and gauges["guard_freed_bytes"][1] == sum(e.freed for e in plan.events) > 0
    assert gauges["memory_budget_bytes"][1] == budget
    fwd.reset()
    assert (fwd.guard_tier, fwd.model.kv.type, fwd.ub) == (0, CacheType.F16, UB)
    assert usage(fwd).total == boot.total


def test_deepguard_off_does_not_fit_clearly(gpu, rng, model):
    """DEEPGUARD=0 under the same budget: one DoesNotFit line naming the budget and DEEPGUARD=1,
    at the depth the plan without the guard stops; no allocation failed and the forward still
    serves a prompt that fits."""
    path, draft = model
    budget = _least_budget(path, draft)
    plan = _plan(path, draft, budget, enabled=False)
    assert plan.fails_at is not None and not plan.events
    fwd = _forward(gpu.with_options(gpu.options, own_arena=True), path, draft,
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
    path, _ = model
    with pytest.raises(DoesNotFit, match="does not fit: the model needs"):
        GpuForward(path, ctx=CTX, ub=UB, gpu=gpu.with_options(gpu.options, own_arena=True),
                   guard=GuardConfig(budget=Budget(1 << 16, "test")))


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / ref.std())


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
    assert _rel(got, ref) <= 5e-2
    q8 = GpuForward(path, ctx=256, ub=16, kv="q8_0", gpu=fresh, guard=GuardConfig(budget=NONE))
    want = q8.prefill_logits(toks)
    assert _rel(got[48:], want[48:]) <= 5e-2
    row = 34 * geo.H_kv * geo.Dh // 32
    for x in "kv":
        a, b = getattr(fwd.model.kv[0], x).buf, getattr(q8.model.kv[0], x).buf
        assert np.array_equal(a.read(np.uint8, 64 * row, 32 * row), b.read(np.uint8, 64 * row, 32 * row))


def test_knobs_force_and_skip_steps(gpu, rng, model):
    """GUARD_UB=100 halves UB once when the context reaches 100 (not twice), with no budget at all;
    GUARD_KV=off under the least budget makes the guard go from the draft straight to UB."""
    path, draft = model
    when = {Kind.DRAFT: "auto", Kind.KV: "auto", Kind.UB: 100}
    fwd = _forward(gpu.with_options(gpu.options, own_arena=True), path, None, GuardConfig(when=when, budget=NONE))
    fwd.prefill(rng.integers(0, GEO.V, 200))
    assert [(e.depth, e.kind) for e in fwd.guard.events] == [(128, Kind.UB)] and fwd.ub == UB // 2
    budget = _least_budget(path, draft)
    skip_kv = GuardConfig(when={Kind.DRAFT: "auto", Kind.KV: "off", Kind.UB: "auto"})
    plan = make_plan(path, ctx=CTX, ub=UB, kv="f16", budget=Budget(budget, "t"), draft=draft, guard=skip_kv,
                     suggest=False)
    assert Kind.KV not in [e.kind for e in plan.events] and plan.events[0].kind is Kind.DRAFT
