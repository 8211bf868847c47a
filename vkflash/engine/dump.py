"""Named intermediates of a GPU step (`vkflash verify`): a copy of a step graph with a tap after
every dispatch whose name is asked for, copying the buffer it wrote into a buffer of its own.

A step graph's intermediates share arena buffers by lifetime, so a value can only be read right
after the dispatch that wrote it; the tap is a word copy recorded in the same submission. Values
named like the reference's dump names (`blk.N.l_out`, `result_output`) thus become comparable.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from vkflash.gpu.graph import Graph
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.copy import copy_words

if TYPE_CHECKING:
    from vkflash.gpu.graph import Dispatch, View


def written_buffer(op: "Dispatch") -> Buffer | None:
    """The buffer a dispatch writes; None when it writes several (e.g. an output and a state),
    since then which one holds the named value is not known."""
    out = {b.id: b for b in op.outputs()}
    return next(iter(out.values())) if len(out) == 1 else None


def op_of(dispatch_name: str, wanted: frozenset[str]) -> str | None:
    """The wanted name a dispatch belongs to: its own, or X for a part `X.<suffix>` (e.g. the
    `blk.3.kqv_out.combine` pass of flash-decode finishes `blk.3.kqv_out`)."""
    parts = dispatch_name.split(".")
    for k in range(len(parts), 0, -1):
        if (name := ".".join(parts[:k])) in wanted:
            return name
    return None


Tap = tuple[Buffer, "View | None"]


def _tap_points(g: "Graph", wanted: frozenset[str]) -> dict[int, list[str]]:
    """Dispatch index → the wanted names final after it: the last dispatch of the name's own op
    (or of the op its exposed view names)."""
    ops = g.ops  # lowered first: fused ops expose the views of the values they name
    by_target: dict[str, list[str]] = {}
    for name in wanted:
        view = g.views.get(name)
        by_target.setdefault(view.after if view is not None else name, []).append(name)
    targets = frozenset(by_target)
    last = {target: j for j, op in enumerate(ops) if (target := op_of(op.name, targets)) is not None}
    at: dict[int, list[str]] = {}
    for target, j in last.items():
        at.setdefault(j, []).extend(by_target[target])
    return at


def tapped(g: "Graph", names: Iterable[str]) -> tuple["Graph", dict[str, Tap]]:
    """A new graph with g's dispatches and, after the dispatch where each wanted value is final,
    a copy of the buffer holding it; the copies by name (names g does not have, or whose last
    dispatch writes several buffers and exposes none, are left out)."""
    at = _tap_points(g, frozenset(names))
    out = Graph(g.gpu, f"{g.name}.dump", g.max_ops, g.split, g.options)
    taps: dict[str, Tap] = {}
    for j, op in enumerate(g.ops):
        out.nodes.append(op)
        for name in sorted(at.get(j, ())):
            view = g.views.get(name)
            src = view.buf if view is not None else written_buffer(op)
            if src is None:
                continue
            dst = g.gpu.buffer(src.nbytes, f"dump.{name}")
            copy_words(out, src, 0, dst, 0, src.words, name=f"dump.{name}")
            taps[name] = (dst, view)
    return out, taps


def read_taps(taps: dict[str, Tap]) -> dict[str, np.ndarray]:
    """Every tap as float32: the exposed view as (rows, columns) when the graph declared one, else
    the whole buffer flat (the caller takes the leading elements it compares)."""
    out = {}
    for name, (buf, view) in taps.items():
        a = buf.read(np.float32)
        if view is not None:
            a = np.stack([a[view.off + r * view.stride:view.off + r * view.stride + view.n_cols]
                          for r in range(view.n_rows)])
        out[name] = a
    return out
