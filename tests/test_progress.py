"""Startup progress (vkflash/progress.py) where the output is not a terminal: a line when a step
starts, heartbeats no more often than asked, a line when it ends."""

from __future__ import annotations

import io

from vkflash.progress import Steps


def test_plain_lines_stay_few(rng):
    """Hundreds of updates within the heartbeat make two lines: the start and the end."""
    out = io.StringIO()
    n = int(rng.integers(100, 1000))
    with Steps("vkflash serve", out).step("loading m.gguf", "bytes") as update:
        for i in range(n):
            update(i << 20, n << 20)
    lines = out.getvalue().splitlines()
    assert lines[0] == "vkflash serve: loading m.gguf …" and len(lines) == 2
    assert lines[1].startswith("vkflash serve: loading m.gguf: done in ") and lines[1].endswith(" s")


def test_heartbeat_says_how_far(rng):
    """With a zero heartbeat every unfinished update is a line with the amount and elapsed time."""
    out = io.StringIO()
    total = int(rng.integers(4, 20))
    with Steps("p", out, heartbeat_s=0).step("compiling", "items") as update:
        for i in range(1, total + 1):
            update(i, total)
    lines = out.getvalue().splitlines()
    assert len(lines) == total + 1  # start, total - 1 heartbeats, end
    assert lines[1] == f"p: compiling: 1/{total} ({100 / total:.0f}%) (0 s)"
