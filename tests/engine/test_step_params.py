"""The step-params buffer: the decode fast path (four words into the mapping) writes what the
general path writes; the host-time split of GpuForward adds up to the parts it names."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.engine.step_params import StepParams

pytestmark = pytest.mark.gpu


def test_decode_words_equal_general_path(gpu, rng):
    ub = 8
    fast, slow = StepParams.allocate(gpu, ub), StepParams.allocate(gpu, ub)
    for p0 in (0, 1, int(rng.integers(2, 1 << 20))):
        tok = int(rng.integers(0, 1 << 17))
        fast.set(p0, np.array([tok], np.int32))
        slow.buf.write(np.zeros(slow.buf.nbytes // 4, np.int32))
        slow.buf.write(np.array([p0, p0 + 1, p0], np.int32))  # the general path's words, by hand
        slow.buf.write(np.array([tok], np.int32), 4 * slow.ids)
        got = fast.buf.read(np.int32)
        want = slow.buf.read(np.int32)
        assert got[:3].tolist() == [p0, p0 + 1, p0] and got[fast.ids] == tok
        assert np.array_equal(got[: slow.ids + 1][[0, 1, 2, slow.ids]], want[[0, 1, 2, slow.ids]])
    fast.set(5, np.array([3, 4, 9], np.int32))  # a 3-token step after decode steps
    got = fast.buf.read(np.int32)
    assert got[:5].tolist() == [5, 8, 5, 6, 7] and got[fast.ids:fast.ids + 3].tolist() == [3, 4, 9]
