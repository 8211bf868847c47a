"""Submissions bounded by a GPU-time budget: the greedy cut, a graph cut exactly where its (set)
op costs say, results equal to the unsplit graph across the cuts, split=False kept whole, and the
in-flight bound (VKFLASH_MAX_INFLIGHT, VKFLASH_SERIALIZE_SUBMISSIONS) seen through trace's hooks."""

from __future__ import annotations


import numpy as np
import pytest

from chain import chain, chain_ref
from vkflash.gpu import cost, trace
from vkflash.gpu.graph import Graph
from vkflash.gpu.options import GpuOptions
from vkflash.gpu.ops.views import Rows

ALPHAS = np.array([-1.0, -0.5, 0.5, 1.0, -2.0], np.float32)
PER_US = cost.Rates(B=1e6, F=1e6, t0=0.0)
"""Rates under which an op of nbytes = c costs exactly c µs (costs set directly in the tests)."""


def _check_runs(runs: list[range], costs: np.ndarray, budget: float, max_ops: int) -> None:
    """Runs cover 0..n in order; each fits (or is one op); none could have taken the next op."""
    assert [i for r in runs for i in r] == list(range(len(costs)))
    for j, r in enumerate(runs):
        assert len(r) >= 1
        assert len(r) == 1 or costs[r.start:r.stop].sum() <= budget
        assert not max_ops or len(r) <= max_ops
        if j + 1 < len(runs):
            nxt = runs[j + 1].start
            assert (max_ops and len(r) == max_ops) or costs[r.start:nxt + 1].sum() > budget


@pytest.mark.parametrize("max_ops", [0, 3])
def test_cut_is_greedy_and_in_order(rng, max_ops):
    """Random costs around the budget (some alone above it): every run is valid and maximal."""
    for _ in range(50):
        budget = float(rng.uniform(1, 10))
        costs = rng.exponential(budget / float(rng.uniform(1, 8)), int(rng.integers(1, 60)))
        runs = cost.cut(costs.tolist(), budget, max_ops)
        _check_runs(runs, costs, budget, max_ops)
        assert any(len(r) == 1 and c > budget for r in runs for c in costs[r]) == bool((costs > budget).any())
    assert cost.cut([], 1.0) == [range(0, 0)]
    with pytest.raises(ValueError):
        cost.cut([1.0], 0.0)


def test_rates_roofline(rng):
    """t = t₀ + max(bytes/B, flops/F) for random sizes."""
    r = cost.Rates(B=2e9, F=8e12, t0=3e-6)
    for nbytes, flops in rng.integers(0, 1 << 40, (20, 2)):
        assert r.seconds(int(nbytes), int(flops)) == pytest.approx(3e-6 + max(nbytes / 2e9, flops / 8e12))


def _planned_groups(rng: np.random.Generator, budget_us: int) -> list[list[int]]:
    """Op costs (integer µs) grouped so that the greedy cut must fall exactly between groups: each
    group sums to ≤ budget − 1, the next group's first op overflows it by ≥ 1, and some groups are
    one op above the budget."""
    groups: list[list[int]] = []
    room = 0  # budget − 1 − the previous group's sum: the next first op must exceed it by ≥ 1
    for _ in range(int(rng.integers(6, 12))):
        if rng.random() < 0.2:
            groups.append([int(budget_us * rng.uniform(1.05, 3))])
            room = 0
            continue
        first = room + 2 + int((budget_us - 3 - room) * rng.uniform(0.1, 1))
        group, room = [first], budget_us - 1 - first
        for _ in range(int(rng.integers(0, 4))):
            c = int(room * rng.uniform(0.1, 0.6))
            if c < 1:
                break
            group.append(c)
            room -= c
        groups.append(group)
    return groups


def _chain_graph(gpu, name: str, n: int, alphas: np.ndarray, split: bool = True, **knobs: str):
    pb, qb = gpu.buffer(4 * n, f"{name}.P"), gpu.buffer(4 * n, f"{name}.Q")
    g = Graph(gpu, name, split=split, options=GpuOptions.from_knobs(**knobs))
    chain(g, Rows.flat(pb, n), Rows.flat(qb, n), alphas)
    return g, pb, qb


@pytest.mark.gpu
def test_graph_cut_where_the_budget_says(gpu, rng):
    """A dependent chain whose op costs put the cuts at known places: submissions hold exactly the
    planned groups in op order, and P, Q equal the unsplit graph's and NumPy's after replays."""
    budget_us = int(rng.integers(2000, 50000))
    groups = _planned_groups(rng, budget_us)
    costs = [c for grp in groups for c in grp]
    n = int(rng.integers(100, 2000))
    alphas = rng.choice(ALPHAS, len(costs))
    g, pb, qb = _chain_graph(gpu, "budget", n, alphas, VKFLASH_SUBMIT_BUDGET_MS=str(budget_us / 1000))
    g.rates = PER_US
    for op, c in zip(g.ops, costs):
        op.nbytes = c
    whole, pw, qw = _chain_graph(gpu, "whole", n, alphas, split=False)
    g.record()
    whole.record()
    assert [len(s.ops) for s in g.submissions] == [len(grp) for grp in groups], (budget_us, groups)
    assert [op for s in g.submissions for op in s.ops] == g.ops
    assert len(whole.submissions) == 1
    for replay in range(3):
        x0, y0 = rng.standard_normal((2, n)).astype(np.float32)
        for b, v in ((pb, x0), (qb, y0), (pw, x0), (qw, y0)):
            b.write(v)
        g.run()
        whole.run()
        want_p, want_q = chain_ref(x0, y0, alphas)
        np.testing.assert_array_equal(pb.read(np.float32), pw.read(np.float32), err_msg=f"replay {replay}")
        np.testing.assert_array_equal(qb.read(np.float32), qw.read(np.float32), err_msg=f"replay {replay}")
        np.testing.assert_array_equal(pb.read(np.float32), want_p, err_msg=f"replay {replay}")
        np.testing.assert_array_equal(qb.read(np.float32), want_q, err_msg=f"replay {replay}")


@pytest.mark.gpu
def test_unsplit_graph_stays_one_submission(gpu, rng):
    """split=False ignores the budget even when every op alone exceeds it; it refuses an op limit."""
    n, steps = int(rng.integers(50, 500)), int(rng.integers(5, 20))
    alphas = rng.choice(ALPHAS, steps)
    for split, want in ((True, steps), (False, 1)):
        g, pb, qb = _chain_graph(gpu, f"split{split}", n, alphas, split=split, VKFLASH_SUBMIT_BUDGET_MS="1")
        g.rates = PER_US
        for op in g.ops:
            op.nbytes = 1500  # 1.5 ms each against a 1 ms budget
        x0, y0 = rng.standard_normal((2, n)).astype(np.float32)
        pb.write(x0)
        qb.write(y0)
        g.run()
        assert len(g.submissions) == want
        want_p, _ = chain_ref(x0, y0, alphas)
        np.testing.assert_array_equal(pb.read(np.float32), want_p)
    with pytest.raises(ValueError):
        Graph(gpu, "bad", max_ops_per_submission=4, split=False)


@pytest.mark.gpu
@pytest.mark.parametrize("serialize", [False, True], ids=["max_inflight", "serialize"])
def test_in_flight_bound(gpu, rng, monkeypatch, serialize):
    """Counting sends and waits through trace's submit/finish hooks: never more than the limit in
    flight, the limit reached when there are enough submissions, and the results still exact."""
    inflight = int(rng.integers(1, 5))
    limit = 1 if serialize else inflight
    n, steps = int(rng.integers(50, 500)), int(rng.integers(8, 30))
    alphas = rng.choice(ALPHAS, steps)
    g, pb, qb = _chain_graph(gpu, "inflight", n, alphas, VKFLASH_MAX_INFLIGHT=str(inflight),
                             VKFLASH_SERIALIZE_SUBMISSIONS=str(int(serialize)))
    g.max_ops = int(rng.integers(1, 3))
    g.record()
    n_subs = len(g.submissions)
    assert n_subs == -(-steps // g.max_ops)
    seen: list[int] = []
    sent, done = trace.submitted, trace.finished

    def on_sent(graph, sub, t0):
        sent(graph, sub, t0)
        if graph is g:
            seen.append(graph.in_flight)

    def on_done(graph, sub):
        done(graph, sub)
        if graph is g:
            seen.append(-1)  # a wait: one fewer in flight

    monkeypatch.setattr(trace, "submitted", on_sent)
    monkeypatch.setattr(trace, "finished", on_done)
    x0, y0 = rng.standard_normal((2, n)).astype(np.float32)
    pb.write(x0)
    qb.write(y0)
    g.submit()
    assert g.in_flight == min(limit, n_subs)
    g.wait()
    assert g.in_flight == 0
    counted = 0  # in flight by the test's own count
    for ev in seen:
        counted = counted - 1 if ev < 0 else counted + 1
        if ev >= 0:
            assert ev == counted <= limit
    assert max(seen) == min(limit, n_subs) and seen.count(-1) == n_subs
    want_p, want_q = chain_ref(x0, y0, alphas)
    np.testing.assert_array_equal(pb.read(np.float32), want_p)
    np.testing.assert_array_equal(qb.read(np.float32), want_q)
