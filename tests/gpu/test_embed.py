"""Embedding gather vs vkflash.formats.quants.dequantize: F32, F16, Q8_0, Q4_0, Q5_0, Q4_K, Q6_K
tables, ragged token counts, repeated ids, a table at a byte offset inside a larger buffer; rows
staged in order decoded without ids (decode_rows)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from vkflash.formats.quants import BLOCK, dequantize, random_blocks, row_bytes
from vkflash.gpu.ops import embed as M
from vkflash.gpu.ops.views import Rows

pytestmark = pytest.mark.gpu


def _table(rng: np.random.Generator, qt: Q, V: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw bytes of a random valid V×d table and its float32 decoding (V, d)."""
    raw = random_blocks(qt, V * d, rng, amax=float(rng.uniform(0.1, 4)))
    return raw, dequantize(raw, qt, V * d).reshape(V, d)


@pytest.mark.parametrize("qt", M.TABLE_TYPES, ids=lambda q: q.name)
def test_embed_types(gpu, rng, qt):
    """Rows of every type decode to exactly what the NumPy decoder gives (same float op order;
    a fused multiply-add in the affine Q4_K form may differ by one rounding: 2^-23 of |d·sc·q|)."""
    epb = BLOCK[qt][0]
    d = epb * int(rng.integers(1, 4)) if epb > 1 else int(rng.integers(1, 300))
    V, T = int(rng.integers(3, 40)), int(rng.integers(1, 12))
    raw, want_table = _table(rng, qt, V, d)
    pad = 4 * int(rng.integers(0, 5))
    tb = gpu.buffer(pad + raw.nbytes + 4, "token_embd")
    tb.write(raw, pad)
    ids = rng.integers(0, V, T).astype(np.int32)
    ids[-1] = ids[0]  # a repeated id
    ib, yb = gpu.upload(ids, "ids"), gpu.buffer(4 * (2 + T * (d + 3)), "x")
    yb.fill(np.nan)
    g = gpu.graph("embed")
    M.embed(g, tb, qt, V, ib, T, Rows(yb, T, d, 2, d + 3), table_off=pad)
    g.run()
    got = yb.read(np.float32)[2: 2 + T * (d + 3)].reshape(T, d + 3)[:, :d]
    want = want_table[ids]
    tol = 2.0**-22 * np.abs(want).max() if qt == Q.Q4_K else 0.0
    assert np.all(np.abs(got - want) <= tol), f"{qt.name}: max err {np.abs(got - want).max():.3g}"


def test_embed_replay_new_ids_and_bad_ids(gpu, rng):
    """A recorded gather replays with the ids now in the buffer; out-of-range ids give NaN rows."""
    V, d, T = 50, 64, 5
    raw, table = _table(rng, Q.Q8_0, V, d)
    tb, ib, yb = gpu.upload(raw, "table"), gpu.buffer(4 * T, "ids"), gpu.buffer(4 * T * d, "x")
    g = gpu.graph("embed_replay")
    M.embed(g, tb, Q.Q8_0, V, ib, T, Rows(yb, T, d))
    for _ in range(3):
        ids = rng.integers(0, V, T).astype(np.int32)
        ib.write(ids)
        yb.fill(np.nan)
        g.run()
        np.testing.assert_array_equal(yb.read(np.float32).reshape(T, d), table[ids])
    ib.write(np.array([V, -1, 0, V + 100, 1], np.int32))
    g.run()
    got = yb.read(np.float32).reshape(T, d)
    assert np.isnan(got[[0, 1, 3]]).all()
    np.testing.assert_array_equal(got[[2, 4]], table[[0, 1]])


@pytest.mark.parametrize("qt", [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.F16], ids=lambda q: q.name)
def test_decode_rows(gpu, rng, qt):
    """Rows staged in order at a word offset decode to the NumPy decoding, row t to output row t
    (rows of an odd byte length run on across word boundaries)."""
    epb = BLOCK[qt][0]
    d, n = epb * int(rng.integers(1, 7)), int(rng.integers(1, 40))
    raw, want = _table(rng, qt, n, d)
    pad = 4 * int(rng.integers(0, 5))
    tb = gpu.buffer(pad + raw.nbytes + 4, "staged")
    tb.write(raw, pad)
    yb = gpu.buffer(4 * n * (d + 1), "y")
    yb.fill(np.nan)
    g = gpu.graph("decode_rows")
    M.decode_rows(g, tb, qt, Rows(yb, n, d, 0, d + 1), table_off=pad)
    g.run()
    got = yb.read(np.float32).reshape(n, d + 1)[:, :d]
    np.testing.assert_array_equal(got, want)


def test_validation(gpu):
    tb, ib, yb = gpu.buffer(row_bytes(Q.Q8_0, 64) * 10, "t"), gpu.buffer(16, "ids"), gpu.buffer(4 * 4 * 64, "y")
    g = gpu.graph("bad")
    y = Rows(yb, 4, 64)
    with pytest.raises(ValueError, match="not supported"):
        M.embed(g, tb, Q.Q5_1, 10, ib, 4, y)
    with pytest.raises(ValueError, match="not whole Q8_0 blocks"):
        M.embed(g, tb, Q.Q8_0, 10, ib, 4, Rows(yb, 4, 40))
    with pytest.raises(ValueError, match="do not fit"):
        M.embed(g, tb, Q.Q8_0, 11, ib, 4, y)
    with pytest.raises(ValueError, match="4-aligned"):
        M.embed(g, tb, Q.Q8_0, 5, ib, 4, y, table_off=2)
    with pytest.raises(ValueError, match="overflow"):
        M.embed(g, tb, Q.Q8_0, 10, ib, 4, y, ids_off=1)
    with pytest.raises(ValueError, match="output of 4 rows"):
        M.embed(g, tb, Q.Q8_0, 10, ib, 3, y)
    assert not g.ops
