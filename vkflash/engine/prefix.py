"""Prompt-prefix reuse: the longest common token prefix of the cached sequence and a new prompt, and
the book of recurrent-state checkpoints (which slot holds the state after how many tokens).

Attention caches are cut by position alone (cells past n are rewritten before they are read again);
a recurrent state cannot be cut, so a sequence that diverges from the cached one goes back to the
nearest checkpoint at or below the common prefix. The book is host bookkeeping only, shared by the
GPU forward (slots are device planes, engine/state.py) and the NumPy reference (slots are copies of
its state), so both keep and pick the same checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class CheckpointBook:
    """Which of `slots` checkpoint slots holds the state after how many tokens, and when a prefill
    is due for one (`every` tokens: each multiple of it a step crosses; 0: never).

    A full book gives up the checkpoint in its densest spot (the least distance to the one below
    it), never the newest, so the kept positions thin out evenly over a long conversation."""

    slots: int
    every: int
    held: dict[int, int] = field(default_factory=dict)  # position → slot

    def clear(self) -> None:
        """A new sequence: nothing held."""
        self.held.clear()

    def drop_after(self, n: int) -> None:
        """The sequence was cut to n tokens: checkpoints past it are gone."""
        for pos in [p for p in self.held if p > n]:
            del self.held[pos]

    def best(self, limit: int) -> tuple[int, int] | None:
        """(position, slot) of the checkpoint nearest at or below `limit`; None when there is none."""
        below = [p for p in self.held if 0 < p <= limit]
        return (max(below), self.held[max(below)]) if below else None

    def due(self, before: int, after: int) -> bool:
        """Whether a step from `before` to `after` tokens crossed a multiple of `every`."""
        return self.every > 0 and after // self.every > before // self.every

    def take(self, pos: int) -> int | None:
        """The slot to write the state after `pos` tokens into (evicting one when full); None when
        no slot is kept or `pos` is already held."""
        if self.slots == 0 or pos <= 0 or pos in self.held:
            return None
        free = set(range(self.slots)) - set(self.held.values())
        if free:
            slot = min(free)
        else:
            ps = sorted(self.held)
            gaps = [(ps[i] - (ps[i - 1] if i else 0), ps[i]) for i in range(len(ps) - 1)] or [(0, ps[0])]
            victim = min(gaps)[1]
            slot = self.held.pop(victim)
        self.held[pos] = slot
        return slot
