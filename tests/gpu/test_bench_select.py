"""The selection benchmarks (MoE router, QSA selection) run on both kernels and report µs per call
against the issue's goal."""

from __future__ import annotations

import pytest

from vkflash.bench.kernels import SELECT_GOAL_US, selection_rows

pytestmark = pytest.mark.gpu


def test_selection_rows(gpu):
    rows = selection_rows(gpu, quick=True)
    names = [r.name for r in rows]
    assert names == ["moe_router", "moe_router (VKFLASH_ROUTER_RANK=1)", "qsa_topk_wide",
                     "qsa_topk (VKFLASH_TOPK_WIDE=0)"], names
    assert all(r.us > 0 and r.unit == "µs" and r.goal == SELECT_GOAL_US for r in rows)
