"""Sampler semantics on fresh random logits: penalties, top-k/top-p/min-p sets, seeded draws."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.engine.api import InvalidRequest, SamplingParams
from vkflash.engine.sampling import Sampler, apply_penalties, filtered_probs


def _logits(rng: np.random.Generator, V: int) -> np.ndarray:
    return (rng.standard_normal(V) * rng.uniform(0.5, 4.0)).astype(np.float32)


def test_penalties_match_their_formulas(rng):
    V = int(rng.integers(50, 300))
    z = _logits(rng, V)
    window = list(rng.integers(0, V, size=int(rng.integers(1, 80))))
    p = SamplingParams(repetition_penalty=float(rng.uniform(1.05, 2.0)), presence_penalty=float(rng.uniform(-1, 1)),
                       frequency_penalty=float(rng.uniform(-1, 1)))
    got = apply_penalties(z, window, p)
    want = z.astype(np.float64).copy()
    for t in set(window):
        c = window.count(t)
        v = want[t]
        v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        want[t] = v - p.presence_penalty - p.frequency_penalty * c
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    untouched = np.setdiff1d(np.arange(V), window)
    assert np.array_equal(got[untouched], z[untouched])


def test_filtered_probs_sets(rng):
    V = int(rng.integers(20, 400))
    z = _logits(rng, V)
    T = float(rng.uniform(0.3, 2.0))
    z64 = z.astype(np.float64)
    full = np.exp((z64 - z64.max()) / T)
    full /= full.sum()
    order = np.argsort(-full, kind="stable")

    k = int(rng.integers(1, V))
    pk = filtered_probs(z, SamplingParams(temperature=T, top_k=k))
    assert set(np.flatnonzero(pk)) == set(order[:k])
    np.testing.assert_allclose(pk[order[:k]], full[order[:k]] / full[order[:k]].sum(), rtol=1e-9)

    top_p = float(rng.uniform(0.05, 0.99))
    pp = filtered_probs(z, SamplingParams(temperature=T, top_p=top_p))
    kept = np.flatnonzero(pp)
    n = len(kept)
    assert set(kept) == set(order[:n])
    assert full[order[:n]].sum() >= top_p - 1e-12  # enough mass …
    assert full[order[:n - 1]].sum() < top_p  # … and the smallest such set

    min_p = float(rng.uniform(0.01, 0.9))
    pm = filtered_probs(z, SamplingParams(temperature=T, min_p=min_p))
    assert set(np.flatnonzero(pm)) == set(np.flatnonzero(full >= min_p * full.max()))
    assert pm.sum() == pytest.approx(1.0)


def test_greedy_is_argmax_after_penalties(rng):
    V = int(rng.integers(10, 200))
    z = _logits(rng, V)
    s = Sampler(SamplingParams(temperature=0.0))
    assert s.plain_greedy and s.sample(z, []) == int(np.argmax(z))
    top = int(np.argmax(z))
    pen = Sampler(SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0))
    assert not pen.plain_greedy
    want = int(np.argmax(apply_penalties(z, [top] * 5, pen.params)))
    assert pen.sample(z, [top] * 5) == want


def test_seeded_draws_repeat_and_follow_the_distribution(rng):
    V = int(rng.integers(5, 12))
    z = _logits(rng, V) / 2
    seed = int(rng.integers(0, 2**63))
    p = SamplingParams(temperature=float(rng.uniform(0.7, 1.5)), top_k=V - 1, seed=seed)
    a = [Sampler(p).sample(z, []) for _ in range(3)]
    assert len(set(a)) == 1  # a fresh sampler with the same seed draws the same first token
    s1, s2 = Sampler(p), Sampler(p)
    seq1 = [s1.sample(z, []) for _ in range(50)]
    assert seq1 == [s2.sample(z, []) for _ in range(50)]
    n = 20000
    s = Sampler(SamplingParams(temperature=p.temperature, top_k=p.top_k))
    counts = np.bincount([s.sample(z, []) for _ in range(n)], minlength=V)
    want = filtered_probs(z, p)
    # every bin within 5 standard deviations of its binomial expectation; excluded tokens never drawn
    sd = np.sqrt(n * want * (1 - want)) + 1e-9
    assert np.all(np.abs(counts - n * want) <= 5 * sd + 1), (counts, n * want)
    assert counts[want == 0].sum() == 0


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.5),
                                         ("max_tokens", 0), ("presence_penalty", 3.0), ("seed", -5)])
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and field in str(e.value)


def test_logit_bias_shifts_and_bans(rng):
    """logit_bias adds to the logits after the penalties; -inf never comes out; the argmax fast path is off."""
    V = int(rng.integers(50, 300))
    z = _logits(rng, V)
    ids = rng.choice(V, size=int(rng.integers(1, 10)), replace=False)
    bias = [float(rng.uniform(-5, 5)) for _ in ids]
    banned = int(np.argmax(z))
    pairs = tuple(zip((int(t) for t in ids if t != banned), bias)) + ((banned, float("-inf")),)
    greedy = Sampler(SamplingParams(temperature=0.0, logit_bias=pairs))
    want = z.astype(np.float32).copy()
    for t, b in pairs:
        want[t] += np.float32(b)
    assert not greedy.plain_greedy and Sampler(SamplingParams(temperature=0.0)).plain_greedy
    assert greedy.sample(z, []) == int(np.argmax(want)) != banned
    hot = Sampler(SamplingParams(temperature=float(rng.uniform(0.5, 2.0)), logit_bias=pairs))
    p = hot.probs(z, [])
    assert p[banned] == 0.0 and abs(p.sum() - 1) < 1e-9
    assert banned not in {hot.sample(z, []) for _ in range(200)}
    with pytest.raises(InvalidRequest):
        SamplingParams(logit_bias=((-1, 1.0),))
