"""The matmul benchmarks run end to end on small shapes and report positive rates."""

from __future__ import annotations

import pytest

from vkflash.bench.matmul import gemm_tflops, gemv_bandwidth

pytestmark = pytest.mark.gpu


def test_bench_rows(gpu):
    rows = gemv_bandwidth(gpu, quick=True) + gemm_tflops(gpu, quick=True)
    assert [r["name"].split()[0] for r in rows[:6]] == ["gemv"] * 6
    gemm = [r["name"] for r in rows[6:]]
    assert gemm[0] == "gemm f16 scalar" and "gemm q4_k scalar" in gemm, gemm
    assert all(n.startswith(("gemm f16 ", "gemm q4_k ")) for n in gemm), gemm
    for r in rows:
        rate = r.get("GB/s", r.get("TFLOP/s"))
        assert r["seconds"] > 0 and rate > 0, r
