"""`vkflash serve`'s startup on the GPU forward, its output not a terminal: a few plain progress
lines (weight upload, pipeline compilation at load) and one ready line with the URL and the model."""

from __future__ import annotations

import re

import pytest

from harness import call, start_server, stop_server

pytestmark = pytest.mark.gpu


def test_progress_then_one_ready_line(tiny_model, tmp_path):
    s = start_server(tmp_path, {"MODEL": str(tiny_model), "CTX": "256", "UB": "16", "VKFLASH_BACKEND": "gpu"})
    try:
        lines = [ln.removeprefix("vkflash serve: ") for ln in s.output().splitlines() if ln.startswith("vkflash serve:")]
        beats = [ln for ln in lines if re.search(r", \d+ s$", ln)]  # every 10 s of a step (a slow machine)
        steps = [ln for ln in lines if ln not in beats]
        assert len(beats) <= 6, beats
        assert steps[1] == "loading weights …" and re.fullmatch(r"loading weights: done in [\d.]+ s", steps[2])
        assert steps[3] == "compiling pipelines …"
        assert re.fullmatch(r"compiling pipelines: done in [\d.]+ s", steps[4])
        assert len(steps) == 6, steps  # listening, 2 × (start, end), ready: no line per tensor or graph
        assert re.fullmatch(rf"ready on {re.escape(s.base)} \(model {tiny_model.stem}, qwen4exp, vulkan, CTX 256\) "
                            r"after [\d.]+ s", steps[5])
        assert call(s.base, "GET", "/health").status == 200
    finally:
        stop_server(s)


def test_the_first_request_compiles_nothing(tiny_model, rng):
    """After backend.load, a first generation of any prompt length creates no pipeline and records
    no graph: load compiled them all (on lavapipe a first request used to spend minutes there)."""
    from vkflash import settings
    from vkflash.engine.api import SamplingParams
    from vkflash.engine.generate import generate
    from vkflash.server import backend

    s = settings.load(env={"MODEL": str(tiny_model), "CTX": "256", "UB": "16", "VKFLASH_BACKEND": "gpu"})
    old = settings.current()
    settings.install(s)
    try:
        loaded = backend.load(s)
    finally:
        settings.install(old)
    fwd = loaded.fwd
    pipelines, graphs = fwd.gpu.mgr.shared_pipeline_count(), len(fwd.graphs())
    assert all(g.submissions for g in fwd.graphs())
    ids = [int(t) for t in rng.integers(0, loaded.tokenizer.vocab_size, size=int(rng.integers(2, 60)))]
    events = list(generate(fwd, loaded.tokenizer, ids, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                           ubatch=loaded.info.ubatch))
    assert events[-1].reason == "length", events[-1]
    assert fwd.gpu.mgr.shared_pipeline_count() == pipelines and len(fwd.graphs()) == graphs
    assert all(g.submissions for g in fwd.graphs())
