"""The QSA revert knobs (BLKTOPK, GP, POOLED), read once, and the reference options that compute the
same selection, so the GPU forward, `vkflash verify` and the reference backend agree on one rule.

`cell` mode (BLKTOPK=0) gives every cell of a block its block's score, so the boundary block is a
tie at almost every position and the tie rule decides the output: vkflash breaks ties lower cell
index first (`index`), while llama.cpp's CPU breaks them in its heap order (`heap`, the reference's
option for comparing with llama.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vkflash.settings import Settings, current

TIE_RULE = "index"
"""How vkflash's cell mode breaks ties among equal scores: the lower cell index first."""


@dataclass(frozen=True)
class QSAConfig:
    """`cell` selection (BLKTOPK=0), gathered sparse prefill (GP=1) through each query's own list
    (VKFLASH_QSA_ROWS=1) or per-tile unions, the lazy summary cache (POOLED=1; else re-pool every step)."""

    cell: bool
    gathered: bool
    pooled: bool
    rows: bool = True

    @classmethod
    def from_settings(cls, s: Settings | None = None) -> "QSAConfig":
        s = s or current()
        return cls(cell=not s["BLKTOPK"], gathered=bool(s["GP"]), pooled=bool(s["POOLED"]),
                   rows=bool(s["VKFLASH_QSA_ROWS"]))

    def reference_options(self) -> dict[str, Any]:
        """The NumPy reference's QSA options for the same selection (model/layers/common.RefOptions)."""
        return {"qsa_mode": "cell" if self.cell else "block", "tie_rule": TIE_RULE}
