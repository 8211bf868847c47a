"""The liveness allocator: a step graph's intermediates placed in reused buffers by lifetime.

A graph's intermediates are virtual buffers (memory.Buffer.virtual). When the graph is recorded,
each one's lifetime is the span of dispatches from its first to its last use; intermediates whose
lifetimes do not overlap share one physical buffer. The physical buffers form the `Arena` of a
Gpu, shared by all its graphs: graphs run one at a time (a submission starts with a barrier
against everything before it), so decode, prefill and verify graphs reuse the same memory. An
arena buffer grows when a graph needs more of it (the old one is freed); graphs recorded against
it are then recorded again (`generation`). A graph is placed once per arena (slots only grow, so
its placement stays valid); `clear()` frees every slot and invalidates all placements (`epoch`),
which is how a smaller ubatch returns its compute memory. `Arena.nbytes` is what the memory planner
counts as compute buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from vkflash.gpu.memory import Buffer

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.graph import Dispatch


@dataclass(frozen=True)
class Lifetime:
    """A virtual buffer and the first and last dispatch (indices) that use it."""

    buf: Buffer
    first: int
    last: int


def lifetimes(ops: Sequence["Dispatch"]) -> list[Lifetime]:
    """Every virtual buffer the dispatches use, with its span, in order of first use."""
    span: dict[int, list] = {}
    for j, op in enumerate(ops):
        for b in op.buffers:
            if b.is_virtual:
                s = span.setdefault(b.id, [b, j, j])
                s[2] = j
    return [Lifetime(b, first, last) for b, first, last in span.values()]


def assign(spans: Sequence[Lifetime], sizes: Sequence[int]) -> tuple[dict[int, int], list[int]]:
    """Slot of every virtual buffer (by id) and the slot sizes it needs, greedily by first use: a
    buffer takes the best-fitting free slot of at least its size (`sizes`: the arena's current
    ones), else the largest free slot (which grows), else a new slot."""
    need = list(sizes)
    busy_until = [-1] * len(need)
    out: dict[int, int] = {}
    for s in sorted(spans, key=lambda s: (s.first, -s.buf.nbytes)):
        free = [i for i in range(len(need)) if busy_until[i] < s.first]
        fits = [i for i in free if need[i] >= s.buf.nbytes]
        if fits:
            slot = min(fits, key=lambda i: need[i])
        elif free:
            slot = max(free, key=lambda i: need[i])
        else:
            slot = len(need)
            need.append(0)
            busy_until.append(-1)
        need[slot] = max(need[slot], s.buf.nbytes)
        busy_until[slot] = s.last
        out[s.buf.id] = slot
    return out, need


class Arena:
    """The physical buffers a Gpu's graphs place their intermediates in."""

    def __init__(self, gpu: "Gpu") -> None:
        self.gpu = gpu
        self.slots: list[Buffer] = []
        self.generation = 0  # bumped whenever a buffer a recorded graph may use is replaced
        self.epoch = 0  # bumped by clear(): every placement is void

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.slots)

    def place(self, ops: Sequence["Dispatch"]) -> tuple[dict[int, int], int]:
        """The arena slot of each virtual buffer of `ops` (by id), growing the arena where needed
        (the replaced buffer is freed first), and the bytes this graph alone needs (its own slots' sizes)."""
        spans = lifetimes(ops)
        slot_of, need = assign(spans, [b.nbytes for b in self.slots])
        for i, n in enumerate(need):
            if i == len(self.slots):
                self.slots.append(self.gpu.buffer(n, f"arena.{i}"))
            elif n > self.slots[i].nbytes:
                self.gpu.free(self.slots[i])
                self.slots[i] = self.gpu.buffer(n, f"arena.{i}")
                self.generation += 1
        own: dict[int, int] = {}
        for s in spans:
            slot = slot_of[s.buf.id]
            own[slot] = max(own.get(slot, 0), s.buf.nbytes)
        return slot_of, sum(own.values())

    def clear(self) -> None:
        """Free every slot; graphs placed before must be placed (and recorded) again."""
        for b in self.slots:
            self.gpu.free(b)
        self.slots = []
        self.epoch += 1
        self.generation += 1
