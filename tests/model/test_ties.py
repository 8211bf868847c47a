"""vkflash.model.ties: the reference takes another engine's side of a near-tie and nowhere else."""

from __future__ import annotations

import numpy as np

from tiny_models import tiny_meta
from vkflash.model.hparams import hparams_from_metadata
from vkflash.model.layers.common import softmax
from vkflash.model.ties import QSA_TIE, ROUTE_TIE, Follow, Seen


def _hp():
    return hparams_from_metadata(tiny_meta("qwen4exp"))


def test_route_follows_only_near_ties(rng):
    """Row 0: the engine swaps the k-th expert for one within ROUTE_TIE (followed). Row 1: for one
    far below it (kept, so a comparison reports it). Rows are consumed in feeding order per layer."""
    hp = _hp()
    E, k = hp.E, hp.k
    z = rng.standard_normal((2, E)) * 3
    p = softmax(z)
    I = np.argsort(-p, axis=1, kind="stable")[:, :k]
    dev = z.copy()
    near = I[0, -1]
    nxt = np.argsort(-p[0], kind="stable")[k]
    p[0, nxt] = p[0, near] * (1 - ROUTE_TIE / 2)  # the (k+1)-th within the tie window
    dev[0, nxt], dev[0, near] = z[0, near] + 1e-3, z[0, near]  # the engine prefers it
    far = np.argsort(-p[1], kind="stable")[-1]
    dev[1, far] = dev[1].max() + 1  # the engine picks the least likely expert: a real difference
    seen = Seen()
    seen.add("router", 0, dev[:1])
    seen.add("router", 0, dev[1:])
    f = Follow(seen, hp)
    out = f.route(0, p, I)
    assert nxt in out[0] and near not in out[0]
    assert np.array_equal(out[1], I[1]) and f.followed == 1


def test_select_follows_only_near_ties(rng):
    """A query whose kb-th and (kb+1)-th visible block scores are within QSA_TIE uses the engine's
    scores; one with a clear gap keeps its own. Layers the engine did not report are left alone."""
    hp = _hp()
    i = next(j for j, r in enumerate(hp.r) if r)
    r, kb = hp.r[i], hp.B // hp.r[i]
    nb = kb + 5
    pos = np.array([nb * r - 1, nb * r - 1])
    s = np.stack([rng.uniform(1, 2, nb + 3), rng.permutation(np.linspace(1, 2, nb + 3))])  # row 1: clear gaps
    order = np.argsort(-s[0, :nb])  # the visible blocks
    s[0, order[kb]] = s[0, order[kb - 1]] * (1 - QSA_TIE / 2)
    dev = rng.uniform(1, 2, s.shape)
    seen = Seen()
    seen.add("scores", i, dev)
    f = Follow(seen, hp)
    out = f.select(i, pos, s)
    assert np.array_equal(out[0, :nb], dev[0, :nb]) and np.array_equal(out[1], s[1]) and f.followed == 1
    assert f.select(i + 1, pos, s) is s


def test_widen_scales_the_tie_bounds(rng):
    """A block-score gap of 5·QSA_TIE is no tie, and is one with widen 10 (the coopmat forward's
    reference, whose f16 inputs tip wider gaps)."""
    hp = _hp()
    i = next(j for j, r in enumerate(hp.r) if r)
    r, kb = hp.r[i], hp.B // hp.r[i]
    nb = kb + 5
    s = rng.uniform(1, 2, (1, nb))
    order = np.argsort(-s[0])
    s[0, order[kb]] = s[0, order[kb - 1]] * (1 - 5 * QSA_TIE)
    s[0, order[kb + 1:]] = np.minimum(s[0, order[kb + 1:]], s[0, order[kb]] * 0.9)  # the next gaps are clear
    for widen, followed in ((1.0, 0), (10.0, 1)):
        seen = Seen()
        seen.add("scores", i, rng.uniform(1, 2, s.shape))
        f = Follow(seen, hp, widen)
        f.select(i, np.array([nb * r - 1]), s)
        assert f.followed == followed, widen
