"""The QSA revert paths of the qwen4exp GPU forward on `make-model` tiny files (MODEL.md §5.6):
BLKTOPK=0 (`cell` selection, index ties) vs the reference in cell/index mode, GP=1 gathered sparse
prefill (each query through its own cell list: the default, VKFLASH_QSA_ROWS=1, on the decode kernel or
as one-token query tiles of the coopmat flash kernel; or every query tile through its union in one
flash dispatch) vs GP=0 masked dense prefill on the scalar and the cooperative-matrix flash kernel, and
POOLED=0 re-pooling vs the lazy summary cache."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import flash_cm
from test_gpu_qwen4exp import _model, _prompt
from hybrid_ref import device_logits, knobs, reference_logits, rel
from vkflash.engine.gpu_forward import GpuForward
from vkflash.engine.graphs.common import Head
from vkflash.engine.graphs import hybrid
from vkflash.engine.qsa_config import QSAConfig
from vkflash.gpu.ops import attention
from vkflash.gpu.ops.attention import Flash, coopmat_flash_possible
from vkflash.model import reference
from vkflash.model.ties import Seen
from vkflash.model.weights import load_model

pytestmark = pytest.mark.gpu


def _run(fwd: GpuForward, toks: np.ndarray, n_prefill: int, seen: Seen) -> np.ndarray:
    """Teacher-forced logits: n_prefill tokens in the forward's ubatch steps, then one-token
    steps; what the device routed and scored goes to `seen` (the reference follows its near-ties)."""
    return np.vstack([device_logits(fwd, toks[:n_prefill], seen)]
                     + [device_logits(fwd, toks[t:t + 1], seen) for t in range(n_prefill, len(toks))])


def _last_qsa(fwd: GpuForward) -> int:
    """The last QSA layer (the one whose scratch holds the step's final QSA values)."""
    return max(fwd.model.state.idx)


def test_cell_mode_matches_reference(gpu, rng, tmp_path: Path):
    """BLKTOPK=0: the logits at every position of a 600-token prompt (prefill ubatches across the
    dense → sparse boundary at t+1 = 35) and of gathered decodes equal the reference with the
    options QSAConfig gives it (`cell` mode, tie rule `index`); `block` differs (the knob took effect)."""
    path = _model(tmp_path, rng)
    toks = _prompt(rng, 604)
    with knobs(BLKTOPK="0"):
        fwd = GpuForward(path, ctx=640, ub=128, kv="f32", gpu=gpu, logits_rows=128)
        opts = QSAConfig.from_settings().reference_options()
    assert opts == {"qsa_mode": "cell", "tie_rule": "index"}
    seen = Seen()
    got = _run(fwd, toks, 600, seen)
    ref = reference_logits(path, toks, seen, **opts)
    ref.check(got)
    block = reference.prefill(toks, reference.new_state(load_model(path, np.float64), cache_dtype=np.float32))
    assert rel(block, ref.logits) > 10 * ref.tol(), "cell and block mode agree on this model: the test checks nothing"


COOPMAT_LOGITS = 1e-2
"""Bound (in std of the logits) of a forward whose prefill attention runs on the coopmat kernel: f16
q·scale, K, V and P move each attention output by ≲ 2^-10·max|v| (test_attention); through the tiny
model's two QSA attention layers that stayed at 0.4–1.1e-3·std in every draw seen on lavapipe
(emulated matrices), while a lost slot mask or a wrong tile list is off by ≫ 1e-2."""
COOPMAT_TIES = 20.0
"""How much wider than f32's the near-ties are that the coopmat forward's reference follows: f16 moves
each attention output by up to ~1e-3 of its scale, and the router and the indexer see that through the
residual, so a route within 2e-2 or a QSA block score within 2e-3 (relative) may tip the other way (one
CI draw did: 5.5e-2·std with f32's ties)."""


PATHS = {"rows": {"GP": "1", "VKFLASH_QSA_ROWS": "1"}, "rows, no dense head": {"GP": "1", "VKFLASH_QSA_ROWS": "1"},
         "union": {"GP": "1", "VKFLASH_QSA_ROWS": "0"}, "masked": {"GP": "0"}}
"""Knobs of each path; "rows, no dense head" also runs with VKFLASH_QSA_DENSE_HEAD=0 (a GpuOptions field)."""


@pytest.mark.parametrize("kernel", ["scalar", "coopmat"])
def test_gathered_prefill_equals_masked(gpu, rng, tmp_path: Path, monkeypatch, kernel):
    """GP=1 through per-query lists (the default, VKFLASH_QSA_ROWS=1; on the coopmat kernel with the
    queries before W on the dense causal kernel, and without that, VKFLASH_QSA_DENSE_HEAD=0), GP=1
    through per-tile unions + slot masks (all tiles in one dispatch) and GP=0 (masked dense) each give
    the reference's
    logits; union tiles of 3 queries so the tiny model's tiles really gather (a 64-query tile's union
    covers most of a short cache and falls back to dense). Scalar kernel: the union and masked paths
    also select the same cells. Coopmat kernel (the device's, else emulated: tests/flash_cm.py) for every flash prefill
    step: the logits within COOPMAT_LOGITS of the reference; f16 rounding may move the paths apart
    across a router or QSA near-tie, so each follows its own."""
    if kernel == "coopmat":
        flash_cm.select("device" if coopmat_flash_possible(gpu.caps, 64) else "emulated", gpu, monkeypatch)
        monkeypatch.setattr(attention, "flash_kind", lambda g, T, dim, cache, gathered=False: (
            Flash.COOPMAT if T >= attention.COOPMAT_MIN_TOKENS else Flash.SCALAR))  # f32 caches too
    monkeypatch.setattr(hybrid, "GATHER_TILE", 3)
    path = _model(tmp_path, rng)
    toks = _prompt(rng, 236)
    out, sel, scores, seen = {}, {}, {}, {}
    for name, env in PATHS.items():
        dev = gpu.with_options(replace(gpu.options, qsa_dense_head=name != "rows, no dense head"))
        with knobs(**env):
            fwd = GpuForward(path, ctx=256, ub=58, kv="f32", gpu=dev, logits_rows=58)
        seen[name] = Seen()
        out[name] = _run(fwd, toks, 232, seen[name])
        b = f"blk.{_last_qsa(fwd)}."
        lists = [op.desc for op in fwd.graph(58, Head.LAST).ops if op.name == b + "attn_gated"]
        assert name.startswith("rows") == any("row lists" in d for d in lists), lists
        if name.startswith("rows"):  # the coopmat run's lists take one-token tiles of the coopmat kernel,
            assert all(("coopmat" in d) == (kernel == "coopmat") for d in lists), lists
            heads = [op.desc for op in fwd.graph(58, Head.LAST).ops if op.name == b + "attn_gated.dense"]
            one_split = all("split=1 " in d for d in lists)  # a GPU with many cores splits the keys instead
            assert len(heads) == (kernel == "coopmat" and name == "rows" and one_split), heads  # queries before W
            continue
        # one more 10-token step (positions 236..245; steps of ≤ 8 attend row by row instead) to
        # compare the last QSA layer's bit rows
        taps = fwd.dump_step(toks[:10], [b + "qsa_mask", b + "idx_scores"] + [b + "qsa_union.gp"] * (name == "union"))
        sel[name] = taps[b + "qsa_mask"].view(np.uint32)
        scores[name] = taps[b + "idx_scores"].reshape(10, -1)
        if name == "union":  # tiles of 3, 3, 3, 1 queries select ≤ 3·W = 105 cells of ~240: all gather
            counts = taps[b + "qsa_union.gp"].view(np.int32).reshape(-1)[1::2]
            dense = 236 + np.array([3, 6, 9, 10])
            assert (counts < dense).all(), f"a tile fell back to dense: |U| = {counts}"
    for name in PATHS:
        ref = reference_logits(path, toks, seen[name], widen=1.0 if kernel == "scalar" else COOPMAT_TIES)
        if kernel == "scalar":
            ref.check(out[name])
        else:
            err = rel(out[name], ref.logits)
            assert err <= max(COOPMAT_LOGITS, ref.tol()), f"{name} coopmat: max|Δ| = {err:.2e}·std"
    if kernel == "scalar":
        _same_selections(sel, scores, fwd.hp, _last_qsa(fwd), np.arange(236, 246))


def _same_selections(sel: dict, scores: dict, hp, layer: int, pos: np.ndarray) -> None:
    """The union and masked paths keep the same cells for every query, except where their block
    scores (which earlier layers' rounding moves apart by up to δ) put the kb-th and (kb+1)-th
    visible blocks within 2δ of each other: a near-tie either side may take."""
    r, kb = hp.r[layer], hp.kb(layer)
    for t in np.nonzero((sel["union"] != sel["masked"]).any(axis=1))[0]:
        nb = (int(pos[t]) + 1) // r
        a, m = scores["union"][t, :nb], scores["masked"][t, :nb]
        q = np.sort(a)[::-1]
        gap, delta = q[kb - 1] - q[kb], np.abs(a - m).max()
        assert gap <= 2 * delta, f"query {pos[t]}: selections differ across a gap {gap:.3g} > 2·{delta:.3g}"


def test_repooled_summary_equals_cache(gpu, rng, tmp_path: Path):
    """POOLED=0 re-pools every complete block each step: the re-pooled rows of the last QSA layer are
    bit-identical to its lazily written summary cache, and so are the logits of prefill + decodes."""
    path = _model(tmp_path, rng)
    toks = _prompt(rng, 60)
    out, rows = {}, {}
    for pooled in ("1", "0"):
        with knobs(POOLED=pooled):
            fwd = GpuForward(path, ctx=64, ub=24, kv="f32", gpu=gpu, logits_rows=24)
        layer = _last_qsa(fwd)
        steps = [fwd.prefill_logits(toks[:24]), fwd.prefill_logits(toks[24:48])]
        steps += [fwd.decode(int(t))[None] for t in toks[48:-1]]
        taps = fwd.dump_step(toks[-1:], ["result_output", f"blk.{layer}.qsa_pool"])  # the last step, tapped
        out[pooled] = np.vstack(steps + [taps["result_output"].reshape(-1)[None, :fwd.n_vocab]])
        idx = fwd.model.state.idx[layer]
        n_words = (len(toks) // idx.r) * idx.keys.dim
        repooled = taps.get(f"blk.{layer}.qsa_pool")
        rows[pooled] = idx.summary.read(np.uint32, n_words) if pooled == "1" else \
            repooled.view(np.uint32).reshape(-1)[:n_words]
    assert np.array_equal(rows["1"], rows["0"]), "re-pooled rows differ from the summary cache"
    assert np.array_equal(out["1"], out["0"]), f"logits differ by {rel(out['0'], out['1']):.2e}·std"
