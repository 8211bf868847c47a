"""The MoE benchmarks run end to end on small shapes and report positive rates."""

from __future__ import annotations

import pytest

from vkflash.bench.moe import expert_gemm_tflops, expert_gemv_bandwidth

pytestmark = pytest.mark.gpu


def test_bench_rows(gpu):
    rows = expert_gemm_tflops(gpu, quick=True) + expert_gemv_bandwidth(gpu, quick=True)
    names = [r["name"] for r in rows]
    gemv = [n for n in names if n.startswith("moe gemv")]
    assert names[:2] == ["moe gemm compact scalar", "moe gemm plain scalar"], names
    assert gemv[:2] == ["moe gemv legacy", "moe gemv teams (default)"] and set(gemv[2:]) <= {"moe gemv q8"}, names
    assert names[2:-len(gemv)] in ([], ["moe gemm compact coopmat", "moe gemm plain coopmat"]), names
    assert all(r["goal"] == 0.5 for r in rows if r["name"].startswith("moe gemv"))
    for r in rows:
        rate = r.get("GB/s", r.get("TFLOP/s"))
        assert r["seconds"] > 0 and rate > 0, r
