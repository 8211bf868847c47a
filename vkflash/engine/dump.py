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


def written_buffer(op: "Dispatch") -> Buffer:
    """The buffer a dispatch writes (its output; ops that write several are not tappable)."""
    out = [b for b in op.buffers if b.id in op.writes]
    if len({b.id for b in out}) != 1:
        raise ValueError(f"{op.name}: writes {len(out)} buffers, cannot tap one output")
    return out[0]


def op_of(dispatch_name: str, wanted: frozenset[str]) -> str | None:
    """The wanted name a dispatch belongs to: its own, or X for a part `X.<suffix>` (e.g. the
    `blk.3.kqv_out.combine` pass of flash-decode finishes `blk.3.kqv_out`)."""
    parts = dispatch_name.split(".")
    for k in range(len(parts), 0, -1):
        if (name := ".".join(parts[:k])) in wanted:
            return name
    return None


def tapped(g: "Graph", names: Iterable[str]) -> tuple["Graph", dict[str, Buffer]]:
    """A new graph with g's dispatches and, after the last dispatch of each wanted op, a copy of
    the buffer it wrote; the copies by name (names g does not have are left out)."""
    wanted = frozenset(names)
    last = {name: j for j, op in enumerate(g.ops) if (name := op_of(op.name, wanted)) is not None}
    out = g.gpu.graph(f"{g.name}.dump", g.max_ops)
    taps: dict[str, Buffer] = {}
    for j, op in enumerate(g.ops):
        out.ops.append(op)
        name = op_of(op.name, wanted)
        if name is None or last[name] != j:
            continue
        src = written_buffer(op)
        dst = g.gpu.buffer(src.nbytes, f"dump.{name}")
        copy_words(out, src, 0, dst, 0, src.words, name=f"dump.{name}")
        taps[name] = dst
    return out, taps


def read_taps(taps: dict[str, Buffer]) -> dict[str, np.ndarray]:
    """Every tap's buffer as flat float32 (the caller takes the leading elements it compares)."""
    return {name: buf.read(np.float32) for name, buf in taps.items()}
