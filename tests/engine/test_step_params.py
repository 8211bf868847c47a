"""The step-params buffer: the decode fast path (a few words into the mapping) writes what the
general path writes, with and without a cell shift."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.engine.step_params import StepParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shift", [0, 1])
def test_decode_words_equal_general_path(gpu, rng, shift):
    ub = 8
    fast = StepParams.allocate(gpu, ub, cell_shift=shift)
    slow = StepParams.allocate(gpu, ub, cell_shift=shift)
    slow._words = lambda: None  # the general path: array writes, no mapped words
    for p in (fast, slow):
        p.buf.write(np.full(p.buf.nbytes // 4, -7, np.int32))  # poisoned alike
    for p0 in (shift, shift + 1, int(rng.integers(2, 1 << 20))):
        tok = np.array([rng.integers(0, 1 << 17)], np.int32)
        fast.set(p0, tok)
        slow.set(p0, tok)
        got, want = fast.buf.read(np.int32), slow.buf.read(np.int32)
        assert np.array_equal(got, want), np.flatnonzero(got != want)
        assert got[:3].tolist() == [p0 - shift, p0 - shift + 1, p0 - shift] and got[fast.ids] == tok[0]
    fast.set(5, np.array([3, 4, 9], np.int32))  # a 3-token step after decode steps
    got = fast.buf.read(np.int32)
    c = 5 - shift
    assert got[:5].tolist() == [c, c + 3, c, c + 1, c + 2] and got[fast.ids:fast.ids + 3].tolist() == [3, 4, 9]
