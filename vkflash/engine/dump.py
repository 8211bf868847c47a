"""Named intermediates of a GPU step (`vkflash verify`): a copy of a step graph with a tap after
every dispatch whose name is asked for, copying the buffer it wrote into a buffer of its own.

Step graphs reuse activation buffers from layer to layer, so a value can only be read right after
the dispatch that wrote it; the tap is a word copy recorded in the same submission. Dispatches
named like the reference's dump names (`blk.N.l_out`, `result_output`) thus become comparable.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.copy import copy_words

if TYPE_CHECKING:
    from vkflash.gpu.graph import Dispatch, Graph


def written_buffer(op: "Dispatch") -> Buffer | None:
    """The buffer a dispatch writes; None when it writes several (e.g. an output and a state),
    since then which one holds the named value is not known."""
    out = {b.id: b for b in op.buffers if b.id in op.writes}
    return next(iter(out.values())) if len(out) == 1 else None


def op_of(dispatch_name: str, wanted: frozenset[str]) -> str | None:
    """The wanted name a dispatch belongs to: its own, or X for a part `X.<suffix>` (e.g. the
    `blk.3.kqv_out.combine` pass of flash-decode finishes `blk.3.kqv_out`)."""
    parts = dispatch_name.split(".")
    for k in range(len(parts), 0, -1):
        if (name := ".".join(parts[:k])) in wanted:
            return name
    return None


Tap = tuple[Buffer, "tuple[int, int, int, int] | None"]


def tapped(g: "Graph", names: Iterable[str]) -> tuple["Graph", dict[str, Tap]]:
    """A new graph with g's dispatches and, after the last dispatch of each wanted op, a copy of
    the buffer it wrote; the copies by name (names g does not have, or whose last dispatch writes
    several buffers, are left out)."""
    wanted = frozenset(names)
    last = {name: j for j, op in enumerate(g.ops) if (name := op_of(op.name, wanted)) is not None}
    out = g.gpu.graph(f"{g.name}.dump", g.max_ops)
    taps: dict[str, Tap] = {}
    for j, op in enumerate(g.ops):
        out.ops.append(op)
        name = op_of(op.name, wanted)
        if name is None or last[name] != j:
            continue
        src = written_buffer(op)
        if src is None:
            continue
        dst = g.gpu.buffer(src.nbytes, f"dump.{name}")
        copy_words(out, src, 0, dst, 0, src.words, name=f"dump.{name}")
        taps[name] = (dst, g.views.get(name))
    return out, taps


def read_taps(taps: dict[str, Tap]) -> dict[str, np.ndarray]:
    """Every tap as flat float32: the declared view's rows when the graph exposed one, else the
    whole buffer (the caller takes the leading elements it compares)."""
    out = {}
    for name, (buf, view) in taps.items():
        a = buf.read(np.float32)
        if view is not None:
            off, rows, cols, stride = view
            a = np.concatenate([a[off + r * stride:off + r * stride + cols] for r in range(rows)])
        out[name] = a
    return out
