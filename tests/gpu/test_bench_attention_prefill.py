"""The prefill attention benchmarks run end to end on small shapes and report positive rates; the
QSA rows really gather (union below the causal range)."""

from __future__ import annotations

import pytest

from vkflash.bench.attention_prefill import prefill_tflops, qsa_prefill

pytestmark = pytest.mark.gpu


def test_bench_rows(gpu):
    rows = prefill_tflops(gpu, quick=True) + qsa_prefill(gpu, quick=True)
    names = [r["name"] for r in rows]
    assert names[0] == "flash prefill f16 scalar" and "qsa prefill old: per tile, scalar" in names
    assert "qsa prefill one dispatch, scalar" in names and "qsa prefill masked dense (GP=0), scalar" in names
    assert "qsa prefill per-query lists, decode kernel" in names
    for r in rows:
        assert r["seconds"] > 0 and r["TFLOP/s"] > 0, r
    union = next(r for r in rows if r["name"] == "qsa_union tile=64")["shape"]
    assert int(union.split("|U|=")[1].split()[0]) < 512 - 96, union
