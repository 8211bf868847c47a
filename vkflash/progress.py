"""Progress of the slow steps before a model answers (the default model's download, the weight
upload, pipeline compilation): a rich bar on a terminal; elsewhere (logs, systemd, pipes) a line
when a step starts, one every HEARTBEAT_S while it runs (from a timer: also while one piece of it
takes long), and one when it ends, so a log stays short and a silent minute never looks like a hang."""

from __future__ import annotations

import sys
import threading
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
        state = [0, 0]  # done, total: the latest update
        stop = threading.Event()

        def beat() -> None:  # a line every heartbeat_s, also while one update takes long (a big pipeline)
            while not stop.wait(self.heartbeat_s):
                done, total = state
                self.say(f"{what}: {_amount(done, total, unit)}, {time.monotonic() - t0:.0f} s")

        beater = threading.Thread(target=beat, name="vkflash-heartbeat", daemon=True)
        beater.start()
        try:
            yield lambda done, total: state.__setitem__(slice(None), (done, total))
        finally:
            stop.set()
            beater.join()
        self.say(f"{what}: done in {time.monotonic() - t0:.1f} s")


def _amount(done: int, total: int, unit: str) -> str:
    """How far, in words: 120/490 MiB (24%) or 3/7 (43%); `running` before any count."""
    if not total:
        return "running"
    pct = f"{100 * done / total:.0f}%"
    if unit == "bytes":
        return f"{done / 2**20:.0f}/{total / 2**20:.0f} MiB ({pct})"
    return f"{done}/{total} ({pct})"
