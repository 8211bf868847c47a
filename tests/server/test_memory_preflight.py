"""`vkflash serve` and the memory plan: the one-line summary at start; a configuration that cannot
boot is refused with a clear line before any weight is loaded; /metrics has the guard's gauges."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness import ROOT, call, free_port, start_server, stop_server

pytestmark = pytest.mark.gpu


def test_refuses_what_cannot_boot(tiny_model):
    """VKFLASH_MEM_BUDGET below the weights: exit 1 with `error: memory plan: … does NOT fit`, never
    listening."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "CTX", "PORT", "HOST")}
    env.update(MODEL=str(tiny_model), CTX="256", VKFLASH_BACKEND="gpu", VKFLASH_MEM_BUDGET="1M",
               PORT=str(free_port()), HOST="127.0.0.1")
    r = subprocess.run([sys.executable, "-m", "vkflash.server"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "memory plan:" in err[0] and "does NOT fit" in err[0] and "1.0 MiB" in err[0]
    assert "listening" not in r.stdout and "Traceback" not in r.stderr


def test_summary_and_guard_gauges(tiny_model, tmp_path):
    """A fitting configuration prints its plan's summary and serves; /metrics reports the guard
    tier, the bytes it freed, the bytes held and the budget."""
    s = start_server(tmp_path, {"MODEL": str(tiny_model), "CTX": "256", "VKFLASH_BACKEND": "gpu",
                                "VKFLASH_MEM_BUDGET": "2G"})
    try:
        summary = [ln for ln in s.output().splitlines() if ln.startswith("memory plan:")]
        assert len(summary) == 1 and "fits" in summary[0] and "2.00 GiB (VKFLASH_MEM_BUDGET)" in summary[0]
        m = call(s.base, "GET", "/metrics").body
        value = {ln.split()[0]: float(ln.split()[1]) for ln in m.splitlines() if ln and not ln.startswith("#")}
        assert value["vkflash_guard_tier"] == 0 and value["vkflash_guard_freed_bytes"] == 0
        assert value["vkflash_memory_budget_bytes"] == 2 << 30
        assert 0 < value["vkflash_memory_bytes"] < 2 << 30
    finally:
        stop_server(s)


def test_mtp_plan_is_what_the_server_loads(tmp_path, rng):
    """MTP=1 with MODEL_DRAFT_SMALL: the startup plan counts the draft head (its boot is the plan
    with that draft, above the plan without), and the speculator the server loads and reserves holds
    the planned boot memory, part for part."""
    from vkflash import settings
    from vkflash.engine.plan import DraftFiles, make_plan, usage
    from vkflash.gpu.memory import fmt_bytes
    from vkflash.model.make_model import make_model
    from vkflash.server import backend

    seed = int(rng.integers(1 << 31))
    path = make_model("qwen4exp", "tiny", "F32", seed, tmp_path / "m.gguf", mtp_block=True)[0]
    small = make_model("qwen4exp", "tiny", "Q8_0", seed, tmp_path / "q.gguf", mtp_separate=True)[1]
    s = settings.load(env={"MODEL": str(path), "CTX": "256", "UB": "32", "MTP": "1", "MODEL_DRAFT_SMALL": str(small),
                           "VKFLASH_BACKEND": "gpu", "VKFLASH_MEM_BUDGET": "1G"})
    old = settings.current()
    settings.install(s)
    try:
        summary = backend.preflight(s)
        plan = make_plan(path, ctx=256, draft=DraftFiles(None, small))
        assert f"boot {fmt_bytes(plan.boot.usage.total)} fits" in summary
        assert plan.boot.usage.total > make_plan(path, ctx=256).boot.usage.total
        loaded = backend.load(s)
        assert loaded.info.backend == "vulkan+mtp" and loaded.fwd.drafter.can_shrink  # type: ignore[attr-defined]
        assert usage(loaded.fwd.fwd) == plan.boot.usage  # type: ignore[attr-defined]
    finally:
        settings.install(old)
