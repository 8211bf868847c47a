"""Pearson's chi-square goodness-of-fit test without SciPy: the statistic, and its p-value from the
regularized upper incomplete gamma function Q(df/2, x/2) (series / continued fraction, Numerical
Recipes §6.2)."""

from __future__ import annotations

import math

import numpy as np


def _gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Γ(a, x)/Γ(a)."""
    if x <= 0:
        return 1.0
    log_pre = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # series for P(a, x)
        term = total = 1.0 / a
        ap = a
        while abs(term) > abs(total) * 1e-15:
            ap += 1
            term *= x / ap
            total += term
        return 1.0 - total * math.exp(log_pre)
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)  # Lentz's continued fraction for Q(a, x)
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_pre) * h


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """(p-value, degrees of freedom) of observed `counts` against cell probabilities `probs` (summing
    to 1); cells expected below `min_expected` are pooled into one (with the next smallest ones until
    the pool reaches it). A count in a cell of probability 0 gives p = 0."""
    if counts[probs == 0].any():
        return 0.0, 0
    counts, probs = counts[probs > 0], probs[probs > 0]
    n = counts.sum()
    expected = probs * n
    order = np.argsort(expected)
    pool, k = 0.0, 0
    while k < len(order) and pool + expected[order[k]] < min_expected:
        pool += expected[order[k]]
        k += 1
    if 0 < pool < min_expected and k < len(order):
        k += 1
    small, big = order[:k], order[k:]
    obs = np.concatenate([counts[big], [counts[small].sum()] if k else []])
    exp = np.concatenate([expected[big], [expected[small].sum()] if k else []])
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return _gamma_q(df / 2, stat / 2), df
