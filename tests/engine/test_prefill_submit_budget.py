"""The submission budget on a tiny qwen2: under a budget far below one step's estimate, prefill
graphs split into several submissions and decode stays one, with logits bit-equal to the unsplit
forward and within MODEL.md's bound of the reference."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from qwen2_tiny import Geometry, write_qwen2
from vkflash.engine.gpu_forward import GpuForward, pieces
from vkflash.engine.graphs.common import Head
from vkflash.gpu import cost
from vkflash.gpu.options import GpuOptions
from vkflash.model import reference
from vkflash.model.weights import load_model

pytestmark = pytest.mark.gpu

GEO = Geometry(d=96, H=3, H_kv=1, Dh=32, F=160, V=301, L=2)  # as test_gpu_forward (warm shader cache)
EXACT = 1e-3  # MODEL.md §7.10, f32 caches
SLOW = cost.Rates(B=1e9, F=1e9, t0=0.4e-3)
"""Rates making every dispatch cost ≥ 0.4 ms, so a 1 ms budget holds at most two."""


def _run(fwd: GpuForward, toks: np.ndarray, m: int) -> np.ndarray:
    """Teacher-forced logits of toks[:m], then one decode per remaining token: (len(toks), V)."""
    return np.concatenate([fwd.prefill_logits(toks[:m]), np.stack([fwd.decode(int(t)) for t in toks[m:]])])


def test_prefill_splits_decode_stays_one(gpu, rng, tmp_path, monkeypatch):
    """Budget 1 ms under SLOW rates: every prefill graph used has several submissions, each within
    the budget or a single op; the decode graph has one; results equal the default-budget run."""
    path = tmp_path / "qwen2.gguf"
    write_qwen2(path, rng, GEO, Q.Q8_0)
    toks = rng.integers(0, GEO.V, int(rng.integers(30, 60)))
    m = len(toks) - int(rng.integers(3, 8))
    ub = int(rng.choice([16, 32]))

    f32 = {"VKFLASH_DISABLE_COOPMAT": "1"}  # f32 GEMMs: the reference bound is MODEL.md's f32 one
    monkeypatch.setattr(cost, "assumed_rates", lambda caps: SLOW)
    tiny = GpuForward(path, ctx=200, ub=ub, kv="f32",
                      gpu=gpu.with_options(GpuOptions.from_knobs(**f32, VKFLASH_SUBMIT_BUDGET_MS="1")))
    got = _run(tiny, toks, m)
    decode = tiny.graph(1, Head.LAST)
    assert sum(decode.estimates()) > 1e-3 and len(decode.submissions) == 1
    assert tiny.graph_stats(1, Head.LAST).submissions == 1
    prefills = {n for n in pieces(m, tiny.model.head.rows) if n > 1}
    assert prefills
    for g in (tiny.graph(n, Head.ALL) for n in prefills):
        assert len(g.submissions) > 1, g.name
        for sub in g.submissions:
            est = [SLOW.seconds(op.nbytes, op.flops) for op in sub.ops]
            assert len(est) == 1 or sum(est) <= 1e-3

    monkeypatch.undo()
    whole = GpuForward(path, ctx=200, ub=ub, kv="f32", gpu=gpu.with_options(GpuOptions.from_knobs(**f32)))  # same bits
    want = _run(whole, toks, m)
    assert all(whole.graph_stats(n, Head.ALL).submissions == 1 for n in prefills)
    np.testing.assert_array_equal(got, want)
    ref = reference.prefill(toks, reference.new_state(load_model(path, np.float64), cache_dtype=np.float32))
    assert float(np.abs(got - ref).max() / ref.std()) <= EXACT
