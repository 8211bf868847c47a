"""The matmul benchmarks run end to end on small shapes and report positive rates."""

from __future__ import annotations

import pytest

from vkflash.bench.matmul import gemm_tflops, gemv_bandwidth

pytestmark = pytest.mark.gpu


def test_bench_rows(gpu):
    rows = gemv_bandwidth(gpu, quick=True) + gemm_tflops(gpu, quick=True)
    assert [r["name"].split()[0] for r in rows] == ["gemv"] * 6 + ["gemm"]
    for r in rows:
        rate = r.get("GB/s", r.get("TFLOP/s"))
        assert r["seconds"] > 0 and rate > 0, r
