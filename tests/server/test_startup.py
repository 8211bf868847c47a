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
        lines = [ln for ln in s.output().splitlines() if ln.startswith("vkflash serve:")]
        steps = [ln.removeprefix("vkflash serve: ") for ln in lines]
        name = tiny_model.name
        assert steps[1] == f"loading {name} …" and re.fullmatch(rf"loading {name}: done in [\d.]+ s", steps[2])
        assert steps[3] == "compiling pipelines (recording the step graphs) …"
        assert re.fullmatch(r"compiling pipelines \(recording the step graphs\): done in [\d.]+ s", steps[4])
        assert len(steps) == 6, steps  # listening, 2 × 2 step lines, ready: no flood of progress
        assert re.fullmatch(rf"ready on {re.escape(s.base)} \(model {tiny_model.stem}, qwen4exp, vulkan, CTX 256, "
                            r"UB 16\) after [\d.]+ s", steps[5])
        assert call(s.base, "GET", "/health").status == 200
    finally:
        stop_server(s)
