"""kv_requant (the deep-context guard's f16/f32 → q8_0 cache rewrite) vs the NumPy q8_0 codec on
fresh random rows: the first n positions become the bytes a q8_0 append of the same values writes,
every byte after them keeps its poison, over ragged lengths and head shapes."""

from __future__ import annotations

import numpy as np
import pytest

from attention_ref import check_q8, encode
from vkflash.gpu.ops.attention import Cache, CacheType
from vkflash.gpu.ops.requant import requant_q8_0

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("src_type", [CacheType.F16, CacheType.F32])
def test_requant_matches_the_codec(gpu, rng, src_type):
    """Positions [0, n) of a random cache (scales spread over decades, some zero blocks) re-quantized:
    byte-equal to q_q8_0 of the stored values (GPU-division near-ties aside); the rest untouched."""
    for _ in range(3):
        heads, dim = int(rng.integers(1, 4)), 32 * int(rng.integers(1, 9))
        n_ctx = int(rng.integers(5, 90))
        n = int(rng.integers(0, n_ctx + 1))
        x = rng.standard_normal((n_ctx, heads, dim)) * 10.0 ** rng.uniform(-3, 3, (n_ctx, heads, 1))
        x[rng.random((n_ctx, heads)) < 0.1] = 0.0
        stored = x.astype(np.float16 if src_type is CacheType.F16 else np.float32)
        src = Cache(gpu.upload(stored, "src"), n_ctx, heads, dim, src_type)
        dst = Cache(gpu.buffer(Cache.nbytes(n_ctx, heads, dim, CacheType.Q8_0), "dst"), n_ctx, heads, dim,
                    CacheType.Q8_0)
        dst.buf.fill(0x5A, np.uint8)
        g = gpu.graph("requant")
        requant_q8_0(g, src, dst, n)
        g.run()
        got = dst.buf.read(np.uint8, dst.buf.nbytes)
        done = Cache.nbytes(n, heads, dim, CacheType.Q8_0)
        values = stored[:n].astype(np.float32)
        check_q8(got[:done], encode(values, CacheType.Q8_0), values)
        assert (got[done:] == 0x5A).all(), "bytes past the re-quantized positions were written"


def test_requant_checks_its_caches(gpu):
    """Wrong types, geometries or lengths are refused before anything is dispatched."""
    f16 = Cache(gpu.buffer(Cache.nbytes(8, 1, 32, CacheType.F16), "a"), 8, 1, 32, CacheType.F16)
    q8 = Cache(gpu.buffer(Cache.nbytes(8, 1, 32, CacheType.Q8_0), "b"), 8, 1, 32, CacheType.Q8_0)
    q8_wide = Cache(gpu.buffer(Cache.nbytes(8, 2, 32, CacheType.Q8_0), "c"), 8, 2, 32, CacheType.Q8_0)
    g = gpu.graph("requant")
    for src, dst, n in ((q8, q8, 4), (f16, f16, 4), (f16, q8_wide, 4), (f16, q8, 9)):
        with pytest.raises(ValueError):
            requant_q8_0(g, src, dst, n)
    assert not g.nodes
