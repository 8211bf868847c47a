"""The MoE benchmarks run end to end on small shapes and report positive rates."""

from __future__ import annotations

import pytest

from vkflash.bench.moe import expert_gemm_tflops, expert_gemv_bandwidth

pytestmark = pytest.mark.gpu


def test_bench_rows(gpu):
    rows = expert_gemm_tflops(gpu, quick=True) + expert_gemv_bandwidth(gpu, quick=True)
    assert [r["name"] for r in rows] == ["moe gemm compact", "moe gemm plain", "moe gemv"]
    for r in rows:
        rate = r.get("GB/s", r.get("TFLOP/s"))
        assert r["seconds"] > 0 and rate > 0, r
