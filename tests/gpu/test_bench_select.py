"""The selection benchmarks (MoE router, QSA selection) run on both kernels and report µs per call
against the issue's goal; the prefill QSA block scores on both kernels in ms."""

from __future__ import annotations

import pytest

from vkflash.bench.kernels import SELECT_GOAL_US, selection_rows

pytestmark = pytest.mark.gpu


def test_selection_rows(gpu):
    rows = selection_rows(gpu, quick=True)
    names = [r.name for r in rows]
    assert names == ["moe_router", "moe_router (VKFLASH_ROUTER_RANK=1)", "qsa_topk_wide",
                     "qsa_topk (VKFLASH_TOPK_WIDE=0)", "qsa_scores", "qsa_scores (VKFLASH_QSA_SCORE_TILE=0)"], names
    assert all(r.us > 0 and r.unit == "µs" and r.goal == SELECT_GOAL_US for r in rows[:4])
    assert all(r.us > 0 and r.unit == "ms" and r.rate == r.us / 1e3 for r in rows[4:])
