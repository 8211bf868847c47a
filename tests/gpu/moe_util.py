"""Shared helpers of the MoE tests: random expert stacks, skewed routings, float64 oracle and bounds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from matmul_util import U32, dequant_rows, random_weight
from vkflash.gpu.ops.moe import ExpertStack, RoutedExperts, split_gate_up
from vkflash.gpu.ops.views import Rows

K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
SILU_SLOPE = 1.1  # max |silu'(x)| ≈ 1.0998: an error δ in the gate moves silu(gate) by at most 1.1·δ


def row_len(q: Q, rng: np.random.Generator, hi: int) -> int:
    """A row length of whole blocks for q: 256 for K-quants, else a random multiple of 32 up to hi."""
    return 256 if q in K_QUANTS else 32 * int(rng.integers(2, hi // 32 + 1))


def stack(gpu, q: Q, E: int, n_out: int, k: int, rng: np.random.Generator) -> tuple[ExpertStack, np.ndarray]:
    """A random {k, n_out, E} stack on the GPU and its float64 values (E, n_out, k)."""
    raw = random_weight(q, E * n_out, k, rng)
    return ExpertStack(gpu.upload(raw, f"w.{q.name}"), int(q), k, n_out, E), \
        dequant_rows(raw, q, E * n_out, k).reshape(E, n_out, k)


@dataclass
class Experts:
    """One layer's routed experts on the GPU (separate and fused gate/up) and in float64."""

    split: RoutedExperts
    fused: RoutedExperts
    gate: np.ndarray  # (E, F, d)
    up: np.ndarray
    down: np.ndarray  # (E, d, F)


def experts(gpu, q_gu: Q, q_down: Q, E: int, d: int, F: int, rng: np.random.Generator) -> Experts:
    """Random gate/up (q_gu) and down (q_down) stacks; the fused form holds the same gate/up rows."""
    raw_g, raw_u = random_weight(q_gu, E * F, d, rng), random_weight(q_gu, E * F, d, rng)
    gate, up = (dequant_rows(r, q_gu, E * F, d).reshape(E, F, d) for r in (raw_g, raw_u))
    down_s, down = stack(gpu, q_down, E, d, F, rng)
    gs = ExpertStack(gpu.upload(raw_g, "gate"), int(q_gu), d, F, E)
    us = ExpertStack(gpu.upload(raw_u, "up"), int(q_gu), d, F, E)
    both = np.concatenate([raw_g.reshape(E, -1), raw_u.reshape(E, -1)], axis=1)  # {d, 2F, E}
    fg, fu = split_gate_up(gpu.upload(both.reshape(-1), "gate_up"), int(q_gu), d, F, E)
    return Experts(RoutedExperts(gs, us, down_s), RoutedExperts(fg, fu, down_s), gate, up, down)


def routing(T: int, k: int, E: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """ids (T × k, distinct per token) from a skewed distribution in which some experts get no rows,
    and positive weights summing to ~1 per token."""
    n_live = int(rng.integers(k, E + 1)) if E > k else E
    live = rng.permutation(E)[:n_live]
    probs = rng.dirichlet(np.full(n_live, 0.5))
    probs = (probs + 1e-3) / (probs + 1e-3).sum()  # every live expert can be drawn k-distinct
    ids = np.stack([live[rng.choice(n_live, k, replace=False, p=probs)] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.05, 1.0, (T, k))
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def routed_reference(x: np.ndarray, ids: np.ndarray, wts: np.ndarray, ex: Experts) -> tuple[np.ndarray, np.ndarray]:
    """(ys, bound), each (T·k, d) float64: ys[t·k + j] = w_tj·W_d(silu(W_g x_t) ⊙ W_u x_t) of expert ids[t, j],
    and bound = w_tj·|W_d|·(1.1·|W_g||x|·|u| + |silu(g)|·|W_u||x| + |h|), the magnitude every f32
    rounding step is relative to (the gate's and up's errors carried through silu, the product and W_d)."""
    T, k = ids.shape
    x64 = x.astype(np.float64)
    ys, bound = np.zeros((T * k, ex.down.shape[1])), np.zeros((T * k, ex.down.shape[1]))
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            g, u = ex.gate[e] @ x64[t], ex.up[e] @ x64[t]
            s = g / (1 + np.exp(-g))
            h = s * u
            ax = np.abs(x64[t])
            bh = SILU_SLOPE * (np.abs(ex.gate[e]) @ ax) * np.abs(u) + np.abs(s) * (np.abs(ex.up[e]) @ ax) + np.abs(h)
            ys[t * k + j] = wts[t, j] * (ex.down[e] @ h)
            bound[t * k + j] = wts[t, j] * (np.abs(ex.down[e]) @ bh)
    return ys, bound


def tol(bound: np.ndarray, n: int) -> np.ndarray:
    """f32 accumulation of n products is within γ_{n+64}·bound (64 covers decode and reductions);
    a wrong expert, weight, row or dropped 32-group moves a result by far more."""
    return 2 * (n + 64) * U32 * bound + 1e-30


def rows_view(gpu, a: np.ndarray, rng: np.random.Generator, name: str, pad4: bool = True) -> Rows:
    """a (n × m) uploaded at a random offset and row stride (multiples of 4 when pad4), NaN around it."""
    n, m = a.shape
    q = 4 if pad4 else 1
    off, stride = q * int(rng.integers(0, 3)), m + q * int(rng.integers(0, 3))
    buf = np.full(off + n * stride + 3, -5 if a.dtype == np.int32 else np.nan, a.dtype)
    for i in range(n):
        buf[off + i * stride:off + i * stride + m] = a[i]
    return Rows(gpu.upload(buf, name), n, m, off, stride)


def poisoned(gpu, n: int, m: int, rng: np.random.Generator, name: str, pad4: bool = False) -> Rows:
    """An output view at a random offset/stride (multiples of 4 when pad4) of a NaN-filled buffer."""
    q = 4 if pad4 else 1
    off, stride = q * int(rng.integers(0, 3)), m + q * int(rng.integers(0, 3))
    b = gpu.buffer(4 * (off + n * stride + 3), name)
    b.fill(np.nan)
    return Rows(b, n, m, off, stride)


def read_rows(v: Rows) -> np.ndarray:
    """The view's elements as (n_rows, n_cols) float64."""
    a = v.buf.read(np.float32)
    rows = [a[v.off + i * v.stride:v.off + i * v.stride + v.n_cols] for i in range(v.n_rows)]
    return np.stack(rows).astype(np.float64)
