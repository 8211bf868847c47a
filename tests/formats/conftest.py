"""Fixtures for the formats tests: a fresh random generator whose seed is printed on failure."""

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """An unseeded generator; its entropy is printed so a failure can be replayed."""
    seq = np.random.SeedSequence()
    print(f"rng seed entropy: {seq.entropy}")
    return np.random.default_rng(seq)
