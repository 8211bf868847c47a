"""Progress of the slow steps before a model answers (the default model's download, the weight
upload, pipeline compilation): a rich bar on a terminal; elsewhere (logs, systemd, pipes) a line
when a step starts, one every HEARTBEAT_S while it runs, and one when it ends, so a log stays short
and a silent minute never looks like a hang."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, TextIO

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

HEARTBEAT_S = 10.0

Update = Callable[[int, int], None]  # (done, total): how far a step is


@dataclass
class Steps:
    """Reports steps under one prefix (e.g. `vkflash serve`) to `out`: live bars when it is a
    terminal, plain lines otherwise."""

    prefix: str
    out: TextIO = field(default_factory=lambda: sys.stdout)
    heartbeat_s: float = HEARTBEAT_S

    @property
    def live(self) -> bool:
        """Whether bars are drawn (a terminal) rather than lines printed."""
        return self.out.isatty()

    def say(self, text: str) -> None:
        """One plain line."""
        print(f"{self.prefix}: {text}", file=self.out, flush=True)

    @contextmanager
    def step(self, what: str, unit: Literal["bytes", "items"] = "items") -> Iterator[Update]:
        """Run one step under `with`: the body calls the yielded update(done, total) as it goes;
        the end says how long it took."""
        t0 = time.monotonic()
        if self.live:
            count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
            with Progress(TextColumn(f"{self.prefix}: {what}"), BarColumn(bar_width=24), count, TimeElapsedColumn(),
                          TimeRemainingColumn(), console=Console(file=self.out)) as bar:
                task = bar.add_task(what, total=None)
                yield lambda done, total: bar.update(task, completed=done, total=total)
            return
        self.say(f"{what} …")
        last = [t0]

        def update(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= self.heartbeat_s and done < total:
                last[0] = now
                self.say(f"{what}: {_amount(done, total, unit)} ({now - t0:.0f} s)")

        yield update
        self.say(f"{what}: done in {time.monotonic() - t0:.1f} s")


def _amount(done: int, total: int, unit: str) -> str:
    """How far, in words: 120/490 MiB (24%) or 3/7 (43%)."""
    pct = f"{100 * done / total:.0f}%" if total else "?"
    if unit == "bytes":
        return f"{done / 2**20:.0f}/{total / 2**20:.0f} MiB ({pct})"
    return f"{done}/{total} ({pct})"
