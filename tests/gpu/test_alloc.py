"""The liveness allocator (gpu/alloc.py): intermediates with disjoint lifetimes share arena buffers,
graphs share the arena, and a graph recorded against a buffer the arena replaced records again."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.alloc import Lifetime, assign
from vkflash.gpu.graph import ROW_ALIGN
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.views import Rows


def test_assign_never_shares_a_slot_between_live_buffers(rng):
    """Random lifetimes: every slot is at least as large as what it holds, two buffers share a slot
    only when their spans are disjoint, and the slots add up to no more than the buffers."""
    for _ in range(50):
        n = int(rng.integers(1, 40))
        spans = []
        for i in range(n):
            first = int(rng.integers(0, 60))
            spans.append(Lifetime(Buffer.virtual(4 * int(rng.integers(1, 1000)), f"t{i}"), first,
                                  first + int(rng.integers(0, 15))))
        start = [4 * int(x) for x in rng.integers(1, 500, int(rng.integers(0, 4)))]
        slot_of, sizes = assign(spans, start)
        assert len(sizes) >= len(start) and all(s >= s0 for s, s0 in zip(sizes, start))
        for s in spans:
            assert sizes[slot_of[s.buf.id]] >= s.buf.nbytes
        for a in spans:
            for b in spans:
                if a is not b and slot_of[a.buf.id] == slot_of[b.buf.id]:
                    assert a.last < b.first or b.last < a.first, "live buffers share a slot"
        assert sum(sizes[len(start):]) <= sum(s.buf.nbytes for s in spans)


@pytest.mark.gpu
def test_chain_of_intermediates_ping_pongs(gpu, rng):
    """y_{i+1} = y_i + x through 12 intermediates: two arena buffers hold them all, and the result is
    exact after replays with fresh inputs."""
    n = int(rng.integers(100, 3000))
    fresh = gpu.with_options(gpu.options, own_arena=True)  # an arena of its own, to count its buffers
    xb, out = fresh.buffer(4 * n, "x"), fresh.buffer(4 * n, "out")
    g = fresh.graph("chain")
    y = Rows.flat(xb, n)
    for i in range(12):
        z = g.tensor(1, n, f"y{i}")
        E.add(g, y, Rows.flat(xb, n), z, name=f"y{i}")
        y = z
    E.scale(g, y, 1.0, Rows.flat(out, n), name="out")
    for _ in range(2):
        x = rng.choice(np.array([-2.0, -1.0, 0.5, 1.0, 3.0], np.float32), n)
        xb.write(x)
        g.run()
        np.testing.assert_array_equal(out.read(np.float32), 13 * x)
    assert len(fresh.arena.slots) == 2
    assert g.temp_bytes == fresh.arena.nbytes == 2 * 4 * (-(-n // ROW_ALIGN) * ROW_ALIGN)  # rows padded to ROW_ALIGN


@pytest.mark.gpu
def test_growing_the_arena_records_older_graphs_again(gpu, rng):
    """A second graph needing bigger intermediates replaces an arena buffer; the first graph, recorded
    against the old one, records again on its next run and stays exact."""
    fresh = gpu.with_options(gpu.options, own_arena=True)

    def graph(n: int, name: str):
        xb, out = fresh.buffer(4 * n, f"{name}.x"), fresh.buffer(4 * n, f"{name}.out")
        g = fresh.graph(name)
        t = g.tensor(1, n, f"{name}.t")
        E.scale(g, Rows.flat(xb, n), 2.0, t)
        E.add(g, t, Rows.flat(xb, n), Rows.flat(out, n))
        return g, xb, out

    small, xs, os_ = graph(64, "small")
    x = rng.standard_normal(64).astype(np.float32)
    xs.write(x)
    small.run()
    gen = fresh.arena.generation
    big, xb, ob = graph(5000, "big")
    xb.write(rng.standard_normal(5000).astype(np.float32))
    big.run()
    assert fresh.arena.generation > gen and fresh.arena.nbytes >= 4 * 5000
    x = rng.standard_normal(64).astype(np.float32)
    xs.write(x)
    small.run()
    np.testing.assert_array_equal(os_.read(np.float32), 2 * x + x)
