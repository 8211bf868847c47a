"""The MoE benchmarks run end to end on small shapes and report positive rates."""

from __future__ import annotations

import pytest

from vkflash.bench.moe import expert_gemm_tflops, expert_gemv_bandwidth

pytestmark = pytest.mark.gpu


def test_bench_rows(gpu):
    rows = expert_gemm_tflops(gpu, quick=True) + expert_gemv_bandwidth(gpu, quick=True)
    names = [r["name"] for r in rows]
    assert names[:2] == ["moe gemm compact scalar", "moe gemm plain scalar"] and names[-1] == "moe gemv", names
    assert names[2:-1] in ([], ["moe gemm compact coopmat", "moe gemm plain coopmat"]), names
    for r in rows:
        rate = r.get("GB/s", r.get("TFLOP/s"))
        assert r["seconds"] > 0 and rate > 0, r
