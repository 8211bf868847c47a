"""Following another engine through near-ties (MODEL.md §7.10: report near-ties, do not fail).

An f32 engine and the float64 reference route a token differently, or keep different QSA blocks,
when the k-th and (k+1)-th candidates are closer than the engine's rounding; one flipped expert
moves a token's output by O(its weight). To compare the two on everything else, the reference
takes the other engine's side of such near-ties, and only there: `Follow.route` and
`Follow.select` are the reference's `route` and `select` hooks (RefOptions), fed with what the
engine computed (its router logits and QSA block scores, rows in feeding order).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from vkflash.model.hparams import HParams

ROUTE_TIE = 1e-3
"""Experts whose probability is within this fraction of the k-th one's are tied with it."""
QSA_TIE = 1e-4
"""Relative gap of the kb-th and (kb+1)-th visible block scores treated as a tie."""
TAPS = (("router", "ffn_moe_logits"), ("scores", "idx_scores"))
"""Seen's tables and the reference op names that fill them."""


@dataclass
class Seen:
    """What the other engine computed, by layer, rows appended in feeding order: router logits
    (T, E) of MoE layers and block scores (T, ≥ n_blocks; only the visible ones are read)."""

    router: dict[int, np.ndarray] = field(default_factory=dict)
    scores: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, kind: str, layer: int, rows: np.ndarray) -> None:
        """Append one step's rows of `kind` ("router" or "scores") for `layer`."""
        table = getattr(self, kind)
        table[layer] = rows if layer not in table else np.vstack([table[layer], rows])

    def add_taps(self, taps: Mapping[str, np.ndarray], n_layers: int, T: int) -> None:
        """Append one T-token step's tapped values, by the reference's names (see tap_names)."""
        for i in range(n_layers):
            for kind, op in TAPS:
                if (name := f"blk.{i}.{op}") in taps:
                    self.add(kind, i, taps[name].reshape(T, -1))


def tap_names(n_layers: int) -> list[str]:
    """The intermediates an engine reports for Seen: router logits and QSA block scores per layer."""
    return [f"blk.{i}.{op}" for i in range(n_layers) for _, op in TAPS]


class Follow:
    """The reference hooks: `route` takes the engine's experts where they differ from the
    reference's only by experts within ROUTE_TIE of the k-th probability; `select` takes the
    engine's block scores for a query whose kb-th and (kb+1)-th visible scores are within QSA_TIE
    (or, for `cell` mode's partly kept block, the (kb+1)-th and (kb+2)-th). Any other difference
    stays, for the comparison to report. `followed` counts the near-ties taken. `widen` scales both
    tie bounds, for an engine that rounds coarser than f32 (f16 cooperative-matrix inputs)."""

    def __init__(self, seen: Seen, hp: HParams, widen: float = 1.0) -> None:
        self.seen, self.r, self.B = seen, hp.r, hp.B
        self.route_tie, self.qsa_tie = ROUTE_TIE * widen, QSA_TIE * widen
        self.fed: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.followed = 0

    def _rows(self, kind: str, i: int, T: int, table: dict[int, np.ndarray]) -> np.ndarray:
        t0 = self.fed[kind, i]
        self.fed[kind, i] += T
        return table[i][t0:t0 + T]

    def route(self, i: int, p: np.ndarray, I: np.ndarray) -> np.ndarray:
        if i not in self.seen.router:
            return I
        J = np.argsort(-self._rows("route", i, len(p), self.seen.router), axis=1, kind="stable")[:, :I.shape[1]]
        out = I.copy()
        for t in range(len(p)):
            differ = set(I[t].tolist()) ^ set(J[t].tolist())
            p_k = p[t, I[t, -1]]
            if differ and all(abs(p[t, e] - p_k) <= self.route_tie * p_k for e in differ):
                out[t] = J[t]
                self.followed += 1
        return out

    def select(self, i: int, pos: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if i not in self.seen.scores:
            return scores
        dev = self._rows("select", i, len(pos), self.seen.scores)
        r = self.r[i]
        kb = self.B // r
        out = scores.copy()
        for t, p in enumerate(pos):
            nb = (int(p) + 1) // r
            if nb <= kb:
                continue
            q = np.sort(scores[t, :nb])[::-1]
            ranks = [kb - 1] + [kb] * (nb > kb + 1)  # `cell` mode also keeps part of the (kb+1)-th block
            if any(q[j] - q[j + 1] <= self.qsa_tie * abs(q[j]) for j in ranks):
                out[t, :nb] = dev[t, :nb]
                self.followed += 1
        return out
