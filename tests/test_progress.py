"""Startup progress (vkflash/progress.py) where the output is not a terminal: a line when a step
starts, heartbeats no more often than asked, a line when it ends."""

from __future__ import annotations

import io
import re
import time

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


def test_heartbeat_speaks_while_a_piece_takes_long(rng):
    """One slow piece of a step still gets heartbeat lines (a timer, not the updates), with the
    latest amount and the elapsed time."""
    out = io.StringIO()
    total = int(rng.integers(4, 20))
    with Steps("p", out, heartbeat_s=0.1).step("compiling", "items") as update:
        update(1, total)
        time.sleep(0.55)
    lines = out.getvalue().splitlines()
    beats = lines[1:-1]
    assert 2 <= len(beats) <= 6, lines
    assert all(re.fullmatch(rf"p: compiling: 1/{total} \({100 / total:.0f}%\), [01] s", ln) for ln in beats), beats
    assert lines[0] == "p: compiling …" and lines[-1].startswith("p: compiling: done in ")
