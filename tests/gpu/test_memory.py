"""The GPU layer's memory accounting: the ledger counts every live buffer's committed bytes, a
growable buffer keeps its contents when it grows or shrinks and graphs that bind it record again,
freed memory leaves the ledger, the budget refuses an allocation with DoesNotFit, and a planning
Gpu counts the same bytes as the real one without memory."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.errors import DoesNotFit
from vkflash.gpu.context import PlanningGpu
from vkflash.gpu.memory import PlannedBuffer
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.views import Rows

pytestmark = pytest.mark.gpu


def test_ledger_counts_commits_and_frees(gpu, rng):
    """Allocations, growth, shrinking and frees move the ledger by exactly the committed bytes."""
    fresh = gpu.with_options(gpu.options, own_arena=True)
    assert fresh.ledger.total == 0
    a = fresh.buffer(4000, "a")
    b = fresh.buffer(1 << 20, "b", commit=1000)
    assert b.nbytes == 1 << 20 and b.committed == 1000
    assert fresh.ledger.total == 4000 + 1000
    fresh.commit(b, 64000)
    assert fresh.ledger.total == 4000 + 64000
    fresh.free(a)
    assert fresh.ledger.total == 64000 and a.tensor is None


def test_growth_keeps_contents_and_graphs_record_again(gpu, rng):
    """y = 2x over a growable buffer: after growing (and shrinking) its memory the graph binds the
    new memory, the kept prefix is intact and the result stays exact."""
    fresh = gpu.with_options(gpu.options, own_arena=True)
    n = int(rng.integers(100, 2000))
    x = fresh.buffer(4 * 4 * n, "x", commit=4 * n)
    y = fresh.buffer(4 * n, "y")
    g = fresh.graph("double")
    E.scale(g, Rows.flat(x, n), 2.0, Rows.flat(y, n))
    v = rng.standard_normal(n).astype(np.float32)
    x.write(v)
    g.run()
    np.testing.assert_array_equal(y.read(np.float32), 2 * v)
    fresh.commit(x, 4 * 3 * n)
    np.testing.assert_array_equal(x.read(np.float32, n), v)
    x.write(v[::-1].copy())
    g.run()
    np.testing.assert_array_equal(y.read(np.float32), 2 * v[::-1])
    fresh.commit(x, 4 * n, keep=4 * (n // 2))
    np.testing.assert_array_equal(x.read(np.float32, n // 2), v[::-1][: n // 2])
    with pytest.raises(ValueError):
        x.write(np.zeros(n + 1, np.float32))


@pytest.mark.parametrize("how", ["free", "grow", "arena"])
def test_memory_goes_only_after_the_work_in_flight(gpu, rng, how):
    """A graph submitted without a wait (the MTP catch-up) may still read a buffer when the engine
    frees it, grows it or clears the arena (the deep-context guard halving UB): each of those waits
    for every submission in flight first. Without that, lavapipe crashed and a GPU faults."""
    fresh = gpu.with_options(gpu.options, own_arena=True)
    n = int(rng.integers(100, 2000))
    x, y = fresh.buffer(4 * 2 * n, "x", commit=4 * n), fresh.buffer(4 * n, "y")
    g = fresh.graph("double")
    t = g.tensor(1, n, "t")  # an arena intermediate
    E.scale(g, Rows.flat(x, n), 2.0, t)
    E.scale(g, t, 1.0, Rows.flat(y, n))
    v = rng.standard_normal(n).astype(np.float32)
    x.write(v)
    g.run()
    g.submit()
    assert g.in_flight and fresh.in_flight and gpu.in_flight  # one registry for every view of the device
    {"free": lambda: fresh.free(x), "grow": lambda: fresh.commit(x, 4 * 2 * n), "arena": fresh.arena.clear}[how]()
    assert not g.in_flight and not gpu.in_flight
    np.testing.assert_array_equal(y.read(np.float32), 2 * v)


def test_budget_refuses_with_does_not_fit(gpu):
    """With a limit, an allocation or a growth past it raises DoesNotFit and allocates nothing."""
    fresh = gpu.with_options(gpu.options, own_arena=True)
    fresh.ledger.limit = 10000
    b = fresh.buffer(40000, "cache", commit=4000)
    with pytest.raises(DoesNotFit, match="does not fit"):
        fresh.buffer(8000, "big")
    with pytest.raises(DoesNotFit):
        fresh.commit(b, 8000)  # old + new at once: 4000 + 8000 > 10000
    assert fresh.ledger.total == 4000 and b.committed == 4000


def test_planning_gpu_counts_without_memory(gpu):
    """A planning Gpu with the device's capabilities counts the same bytes for the same calls and
    holds no memory; writes are checked, reads are zeros."""
    plan = PlanningGpu(gpu.caps, gpu.options)
    real = gpu.with_options(gpu.options, own_arena=True)
    held = []
    for g in (plan, real):
        c = g.buffer(1 << 16, "c", commit=4096)
        g.commit(c, 8192)
        held += [g.buffer(1000, "a"), c]
    assert plan.ledger.total == real.ledger.total == 1000 + 8192
    p = held[0]
    assert isinstance(p, PlannedBuffer) and p.tensor is None and p in plan.ledger.buffers()
    p.write(np.ones(10, np.float32))
    assert not p.read(np.float32, 10).any()
    with pytest.raises(ValueError):
        p.write(np.ones(1000, np.float32))
