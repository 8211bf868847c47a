"""The matmul benchmarks run end to end on small shapes and report positive rates."""

from __future__ import annotations

import pytest

from vkflash.bench.matmul import GEMV_TYPES, gemm_tflops, gemv_bandwidth, gemv_columns

pytestmark = pytest.mark.gpu


def test_bench_rows(gpu):
    gemv = gemv_bandwidth(gpu, quick=True)
    rows = gemv + gemm_tflops(gpu, quick=True)
    names = [r["name"] for r in gemv]
    assert all(n.startswith("gemv ") for n in names), names
    for t in ("q4_k", "q5_k", "q6_k", "iq4_xs", "hc_mix q5_0"):
        assert f"gemv {t} legacy" in names and f"gemv {t} teams (default)" in names, (t, names)
    for t in ("q8_0", "f16", "bf16"):  # TEAMS_SLOWER: the f32 GEMV stays on mul_mat_vec.comp
        assert f"gemv {t} legacy (default)" in names and f"gemv {t} teams" not in names, (t, names)
    assert sum("(default)" in n for n in names) == len(GEMV_TYPES) + 3  # + LM head, HC down, HC mix
    assert [r["goal"] for r in gemv if r["name"] == "gemv q6_k teams (default)"][1] == 0.75
    gemm = [r["name"] for r in rows[len(gemv):]]
    assert gemm[0] == "gemm f16 scalar" and "gemm q4_k scalar" in gemm, gemm
    assert all(n.startswith(("gemm f16 ", "gemm q4_k ")) for n in gemm), gemm
    for r in rows:
        rate = r.get("GB/s", r.get("TFLOP/s"))
        assert r["seconds"] > 0 and rate > 0, r


def test_gemv_sweep(gpu):
    """--sweep: every team width × rows per team of the row-group GEMV (q8 too where possible)."""
    rows = [r for r in gemv_bandwidth(gpu, shapes=[], quick=True, sweep=True)]
    assert rows and all(r["name"].startswith(("gemv q4_k sweep tpr=", "gemv q6_k sweep tpr=")) for r in rows)
    assert all(r["GB/s"] > 0 for r in rows)


def test_split_rows(gpu):
    """The split-K rows (unsplit, split_k's choice, an explicit split) and the inject rows run end to end."""
    from vkflash.bench.matmul import inject_bandwidth, split_gemm_tflops

    rows = split_gemm_tflops(gpu, quick=True, splits=(3,))
    assert [r["name"].split(" ", 2)[2] for r in rows] == ["unsplit", "split-K (default)", "split 3"], rows
    assert "split=3x" in rows[2]["shape"], rows[2]
    inject = inject_bandwidth(gpu, quick=True)
    assert sum("(default)" in r["name"] for r in inject) == 1, inject
    for r in rows + inject:
        assert r["seconds"] > 0 and r.get("GB/s", r.get("TFLOP/s")) > 0, r


def test_gemv_columns(gpu):
    """The multi-column rows: both paths at n = 1 and 7 for the LM head and the dense Q4_K shapes (quick),
    the n = 7 rows with their time as a multiple of n = 1, one path marked the default."""
    rows = gemv_columns(gpu, quick=True)
    on, off = ("cols (default)", "per-column") if gpu.options.gemv_cols else ("cols", "per-column (default)")
    assert [r["name"] for r in rows] == [f"gemv {t} {p}" for t in ("q6_k", "q4_k") for p in (on, on, off, off)]
    assert all(" n=1 " in r["shape"] for r in rows[::2]) and all(" n=7 " in r["shape"] for r in rows[1::2])
    for one, many in zip(rows[::2], rows[1::2]):
        assert many["shape"].endswith(f" {many['seconds'] / one['seconds']:.2f}x n=1"), many
    assert all(r["seconds"] > 0 and r["GB/s"] > 0 for r in rows)
