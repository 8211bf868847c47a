"""QSA (MODEL.md §5.6 Q1–Q9): indexer key cache, lazily pooled summary rows, block scores and the
per-query selection in `block` (default) or `cell` mode with the libstdc++ heap tie order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkflash.model.hparams import HParams
from vkflash.model.layers.norms import rms_norm
from vkflash.model.layers.rope import rope_neox
from vkflash.model.weights import IndexerW


@dataclass
class IndexerCache:
    """Raw indexer keys ρ (n, D_I) in the cache dtype and one summary row κ_b per complete block."""

    keys: np.ndarray
    summary: np.ndarray  # (nb_complete, D_I), compute dtype

    @classmethod
    def empty(cls, hp: HParams, cache_dtype: np.dtype, dtype: np.dtype) -> IndexerCache:
        return cls(np.zeros((0, hp.D_I), cache_dtype), np.zeros((0, hp.D_I), dtype))

    def append(self, rho: np.ndarray, r: int, w: IndexerW, hp: HParams) -> None:
        """(Q1) write ρ rounded to the cache dtype; (Q2)–(Q3) pool every newly complete block."""
        self.keys = np.concatenate([self.keys, rho.astype(self.keys.dtype)])
        nb_old, nb = len(self.summary), len(self.keys) // r
        if nb == nb_old:
            return
        blocks = self.keys[nb_old * r: nb * r].astype(self.summary.dtype).reshape(nb - nb_old, r, hp.D_I)
        P = blocks.sum(axis=1) * (1.0 / r)  # (Q2) Σ of r slices in slot order, ×1/r
        first = np.arange(nb_old, nb) * r  # RoPE at the block's first position
        kappa = rope_neox(rms_norm(P, w.k_norm, hp.eps)[:, None, :], first, hp.n_rot, hp.theta)[:, 0]
        self.summary = np.concatenate([self.summary, kappa])  # (Q3)


def indexer_queries(u: np.ndarray, pos: np.ndarray, w: IndexerW, hp: HParams) -> np.ndarray:
    """(Q4) qI_{t,h} = RoPE_{p_t}(rms((W_Iq u_t)_h) ⊙ q_norm), (T, n_I, D_I)."""
    q = (u @ w.q_proj.T).reshape(len(u), hp.n_I, hp.D_I)
    return rope_neox(rms_norm(q, w.q_norm, hp.eps), pos, hp.n_rot, hp.theta)


def block_scores(qI: np.ndarray, kappa: np.ndarray) -> np.ndarray:
    """(Q5) s_{t,b} = Σ_h relu(qI_{t,h}·κ_b), heads added in order; (T, nb)."""
    dots = np.maximum(np.einsum("thd,bd->thb", qI, kappa), 0.0)
    s = np.zeros((qI.shape[0], kappa.shape[0]), dtype=qI.dtype)
    for h in range(qI.shape[1]):
        s += dots[:, h]
    return s


def heap_select(c: list[float], W: int) -> list[int]:
    """Top-W of c by libstdc++ `std::partial_sort` (heap select, comp = greater): the cell indices kept."""
    h = list(range(W))

    def sift(i: int, v: int) -> None:
        x = i
        while 2 * x + 2 < W:  # two children: take the smaller c, the right one on ties
            right = 2 * x + 2
            child = right - 1 if c[h[right]] > c[h[right - 1]] else right
            h[x] = h[child]
            x = child
        if W % 2 == 0 and x == (W - 2) // 2:  # a lone left child
            h[x] = h[2 * x + 1]
            x = 2 * x + 1
        while x > i:  # push v up past strictly greater parents
            parent = (x - 1) // 2
            if not c[h[parent]] > c[v]:
                break
            h[x] = h[parent]
            x = parent
        h[x] = v

    for i in range((W - 2) // 2, -1, -1):  # build
        sift(i, h[i])
    for j in range(W, len(c)):  # scan
        if c[j] > c[h[0]]:
            sift(0, j)
    return h


def select_cells(t: int, s_t: np.ndarray, r: int, B: int, mode: str, tie_rule: str) -> np.ndarray:
    """(Q6)–(Q8) Sel_t for a query at position t with visible block scores s_t (nb,): sorted cell indices."""
    W = B + r - 1
    if t + 1 <= W:  # (Q6) exactly dense
        return np.arange(t + 1)
    nb = (t + 1) // r
    tail = np.arange(nb * r, t + 1)
    s = s_t[:nb]
    if mode == "block":  # (Q8) kb best blocks by (s desc, b asc) + the tail
        kb = B // r
        best = np.lexsort((np.arange(nb), -s))[:kb]
        cells = (best[:, None] * r + np.arange(r)[None, :]).reshape(-1)
        return np.sort(np.concatenate([cells, tail]))
    c = np.concatenate([np.repeat(s, r), np.full(len(tail), np.inf, dtype=s.dtype)])  # (Q7)
    if tie_rule == "heap":
        kept = np.array(heap_select(c.tolist(), W))
    else:
        kept = np.lexsort((np.arange(t + 1), -c))[:W]
    return np.sort(kept)


def qsa_mask(pos: np.ndarray, scores: np.ndarray, n_kv: int, r: int, B: int, mode: str, tie_rule: str) -> np.ndarray:
    """(Q9) M_t as bool (T, n_kv): each query sees its visible blocks ⌊(t+1)/r⌋ only (U9)."""
    mask = np.zeros((len(pos), n_kv), dtype=bool)
    for row, t in enumerate(pos):
        mask[row, select_cells(int(t), scores[row], r, B, mode, tie_rule)] = True
    return mask
