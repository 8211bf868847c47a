"""The decode attention benchmark runs end to end on small shapes and reports both paths."""

from __future__ import annotations

import pytest

from vkflash.bench.attention import decode_bandwidth

pytestmark = pytest.mark.gpu


def test_bench_rows(gpu):
    rows = decode_bandwidth(gpu, quick=True)
    assert [r["name"] for r in rows] == [f"attn {p} {t}" for t in ("f16", "q8_0") for _ in range(2)
                                         for p in ("decode", "flash")]
    assert [r["shape"].split()[0] for r in rows[:4]] == ["ctx=1024"] * 2 + ["cells=64/1024"] * 2
    for r in rows:
        assert r["seconds"] > 0 and r["GB/s"] > 0, r
