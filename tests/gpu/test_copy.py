"""The compute-shader copy: any word offsets and lengths, vector and scalar paths, nothing outside."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.ops.copy import copy_words

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("src_off,dst_off,n", [(0, 0, 1), (0, 0, 4096), (4, 8, 1027), (1, 4, 515), (3, 2, 7),
                                               (0, 4, 3), (8, 0, 1 << 16)])
def test_copy_ranges(gpu, rng, src_off, dst_off, n):
    src_words = src_off + n + int(rng.integers(0, 9))
    dst_words = dst_off + n + int(rng.integers(0, 9))
    data = rng.integers(0, 1 << 32, src_words, dtype=np.uint32)
    src = gpu.upload(data, "src")
    dst = gpu.buffer(dst_words * 4, "dst")
    poison = np.uint32(0xDEADBEEF)
    dst.fill(poison, np.uint32)
    g = gpu.graph("copy")
    copy_words(g, src, src_off, dst, dst_off, n)
    g.run()
    out = dst.read(np.uint32)
    assert (out[dst_off:dst_off + n] == data[src_off:src_off + n]).all()
    assert (out[:dst_off] == poison).all() and (out[dst_off + n:] == poison).all()


def test_copy_out_of_range_rejected(gpu):
    a, b = gpu.buffer(64, "a"), gpu.buffer(64, "b")
    with pytest.raises(ValueError):
        copy_words(gpu.graph("bad"), a, 10, b, 0, 7)
