"""Tracing knobs: job log, submit trace (before the submit), perf logger, timeline file.

Each run is a fresh process so the knobs are read from its environment, as a user sets them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = r"""
import numpy as np
from vkflash.gpu.context import Gpu
from vkflash.gpu.ops.copy import copy_words
from vkflash.gpu import trace
gpu = Gpu()
a, b = gpu.upload(np.arange(64, dtype=np.uint32), "a"), gpu.buffer(256, "b")
g = gpu.graph("tracegraph", max_ops_per_submission=2)
copy_words(g, a, 0, b, 0, 64, name="blk.0.first")
copy_words(g, b, 0, a, 0, 32, name="blk.0.second")
copy_words(g, a, 0, b, 0, 16, name="blk.1.third")
g.run()
g.run()
print("RAN", flush=True)
trace.report()
"""


def run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VKFLASH_", "GGML_VK_"))}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)


def test_quiet_by_default():
    r = run({})
    assert r.returncode == 0, r.stderr
    assert "job " not in r.stderr and "submit " not in r.stderr and "perf logger" not in r.stderr


def test_job_log_one_line_per_submission():
    r = run({"VKFLASH_JOB_LOG": "1"})
    assert r.returncode == 0, r.stderr
    # (on discrete GPUs the upload is a "staging" job of its own)
    jobs = [ln for ln in r.stderr.splitlines() if ln.startswith("job ") and "tracegraph" in ln]
    assert len(jobs) == 4  # 2 submissions (3 ops, 2 per submission) x 2 runs
    for ln in jobs:
        assert "tracegraph" in ln and "ops=" in ln and "gpu=" in ln and "ms host=" in ln
    assert [ln.split()[3] for ln in jobs] == ["ops=2", "ops=1", "ops=2", "ops=1"]


def test_submit_trace_names_ops_before_the_submit():
    r = run({"GGML_VK_SUBMIT_TRACE": "1"})  # the GGML_VK alias works too
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    subs = [i for i, ln in enumerate(lines) if ln.startswith("submit ") and "tracegraph" in ln]
    i = subs[0]
    assert "ops=2" in lines[i]
    assert lines[i + 1].strip().startswith("blk.0.first copy") and lines[i + 2].strip().startswith("blk.0.second copy")
    assert len(subs) == 4 and "RAN" in r.stdout


def test_perf_logger_aggregates_by_name():
    r = run({"VKFLASH_PERF_LOGGER": "1"})
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stderr.splitlines() if ln.startswith("blk.")]
    assert len(rows) == 3
    for ln in rows:
        name, rest = ln.split(": ", 1)
        count, _, avg, _, _, total, unit = rest.split()[:7]
        assert count == "2" and unit == "us" and float(total) >= float(avg) > 0


def test_trace_file_is_a_chrome_timeline(tmp_path):
    path = tmp_path / "t.json"
    r = run({"VKFLASH_TRACE_FILE": str(path)})
    assert r.returncode == 0, r.stderr
    ev = json.loads(path.read_text())["traceEvents"]
    names = {e["name"] for e in ev}
    assert {"blk.0.first", "blk.0.second", "blk.1.third"} <= names
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in ev)
