"""The whole MoE FFN (MODEL.md §5.7 M1–M4) on the GPU vs the float64 model reference
(vkflash/model/layers/moe.py), the combine kernel, and the VKFLASH_MMID_COMPACT knob."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from matmul_util import dequant_rows, random_weight
from moe_util import SILU_SLOPE, experts, poisoned, read_rows, routed_reference, rows_view, tol
from vkflash import settings
from vkflash.gpu.ops.matmul import QWeight
from vkflash.gpu.ops.moe import MoEScratch, MoEWeights, moe_combine, moe_ffn
from vkflash.model.layers.common import RefOptions
from vkflash.model.layers.moe import moe
from vkflash.model.weights import MoEW

pytestmark = pytest.mark.gpu

GAP = 0.05  # router logits of one token differ by ≥ GAP: f32 rounding (~1e-6) cannot reorder them


@pytest.mark.parametrize("with_shared", [True, False])
def test_combine(gpu, rng, with_shared):
    """f = Σ_j ys[t·k + j] + σ(g_t)·s_t, read from offset/strided views, written into a poisoned one."""
    T, d, k = int(rng.integers(1, 40)), int(rng.integers(1, 300)), int(rng.integers(1, 11))
    ys = rng.standard_normal((T * k, d), dtype=np.float32)
    s = rng.standard_normal((T, d), dtype=np.float32)
    gl = (rng.standard_normal((T, 1)) * 4).astype(np.float32)
    f = poisoned(gpu, T, d, rng, "f")
    g = gpu.graph("combine")
    sv, gv = (rows_view(gpu, s, rng, "s", False), rows_view(gpu, gl, rng, "g", False)) if with_shared else (None, None)
    moe_combine(g, rows_view(gpu, ys, rng, "ys", False), f, k, sv, gv)
    g.run()
    y64 = ys.astype(np.float64).reshape(T, k, d)
    sh = 1 / (1 + np.exp(-gl.astype(np.float64))) * s if with_shared else np.zeros((T, d))
    want, bound = y64.sum(axis=1) + sh, np.abs(y64).sum(axis=1) + np.abs(sh)
    got = read_rows(f)
    assert (np.abs(got - want) <= (k + 8) * 2.0**-23 * bound).all()  # k additions + σ's exp and division
    a = f.buf.read(np.float32)
    inside = np.zeros(a.size, bool)
    for t in range(T):
        inside[f.off + t * f.stride:f.off + t * f.stride + d] = True
    assert np.isnan(a[~inside]).all(), "writes outside f"


def _router(u: np.ndarray, E: int, rng: np.random.Generator) -> np.ndarray:
    """W_r (E × d, f32) with W_r u_t = a permutation of GAP-spaced logits (exact solve: T ≤ d)."""
    T = u.shape[0]
    z = np.stack([rng.permutation(E) * GAP for _ in range(T)]) + rng.uniform(-2, 2, (T, 1))
    return (np.linalg.pinv(u.astype(np.float64)) @ z).T.astype(np.float32)


def _dense(gpu, q: Q, n_out: int, k: int, rng, name: str) -> tuple[QWeight, np.ndarray]:
    raw = random_weight(q, n_out, k, rng)
    return QWeight(gpu.upload(raw, name), int(q), k, n_out), dequant_rows(raw, q, n_out, k)


def _layer(gpu, rng, u: np.ndarray, E: int, d: int, F: int, F_s: int, fused: bool):
    """Random layer weights (gate/up Q4_K, down Q5_0 as in real files; shared Q8_0/Q6_K; F32 gates)."""
    ex = experts(gpu, Q.Q4_K, Q.Q5_0, E, d, F, rng)
    wr = _router(u, E, rng)
    wsg = (rng.standard_normal(d) / np.sqrt(d)).astype(np.float32)
    sg, sg64 = _dense(gpu, Q.Q8_0, F_s, d, rng, "sh_gate")
    su, su64 = _dense(gpu, Q.Q8_0, F_s, d, rng, "sh_up")
    sd, sd64 = _dense(gpu, Q.Q6_K, d, F_s, rng, "sh_down")
    gw = MoEWeights(QWeight(gpu.upload(wr, "router"), int(Q.F32), d, E), ex.fused if fused else ex.split,
                    QWeight(gpu.upload(wsg, "sh_gate_inp"), int(Q.F32), d, 1), sg, su, sd)
    ref = MoEW(wr.astype(np.float64), ex.gate, ex.up, ex.down, wsg.astype(np.float64), sg64, su64, sd64)
    return gw, ref, ex


def _bound(u: np.ndarray, ref: MoEW, ex, ids: np.ndarray, wts: np.ndarray) -> np.ndarray:
    """Σ_j (routed bound + |y_j|) + the shared FFN's bound carried through σ (σ' ≤ 1/4 on the gate logit)."""
    T, k = ids.shape
    ys, b = routed_reference(u, ids, wts, ex)
    routed = (b + np.abs(ys)).reshape(T, k, -1).sum(axis=1)
    x = u.astype(np.float64)
    g, up = x @ ref.sh_gate.T, x @ ref.sh_up.T
    sl = g / (1 + np.exp(-g))
    hs = sl * up
    ax = np.abs(x)
    bh = SILU_SLOPE * (ax @ np.abs(ref.sh_gate.T)) * np.abs(up) + np.abs(sl) * (ax @ np.abs(ref.sh_up.T)) + np.abs(hs)
    s = hs @ ref.sh_down.T
    gate = 1 / (1 + np.exp(-(x @ ref.sh_gate_inp)))[:, None]
    dgate = 0.25 * (ax @ np.abs(ref.sh_gate_inp))[:, None]  # σ' ≤ 1/4 times the logit's magnitude
    shared = gate * (bh @ np.abs(ref.sh_down.T)) + dgate * np.abs(s) + gate * np.abs(s)
    return routed + shared


def _run(gpu, rng, gw: MoEWeights, u: np.ndarray, k: int, scratch: MoEScratch) -> tuple[np.ndarray, object]:
    d = u.shape[1]
    f = poisoned(gpu, u.shape[0], d, rng, "f")
    g = gpu.graph("moe_ffn")
    moe_ffn(g, rows_view(gpu, u, rng, "u"), gw, k, f, scratch)
    g.run()
    return read_rows(f), g


@pytest.mark.parametrize("E", [16, 13])
def test_moe_ffn_vs_reference(gpu, rng, E):
    """Ragged T through the decode (T ≤ 8) and prefill paths; fused and separate gate/up stacks."""
    k, d, F, F_s = 4, 256, int(rng.integers(2, 6)) * 32, 256
    scratch = MoEScratch.create(gpu, 130, k, d, E, F, F_s)
    for T in (1, 3, 8, 9, 37, 130):
        u = rng.standard_normal((T, d), dtype=np.float32)
        gw, ref, ex = _layer(gpu, rng, u, E, d, F, F_s, fused=bool(rng.integers(0, 2)))
        dumped: dict[str, np.ndarray] = {}
        opts = RefOptions(dump=lambda n, x: dumped.__setitem__(n.split(".")[-1], x))
        want = moe(u.astype(np.float64), ref, k, opts, 0)
        got, _ = _run(gpu, rng, gw, u, k, scratch)
        ids, wts = dumped["ffn_moe_topk"], dumped["ffn_moe_weights"]
        np.testing.assert_array_equal(scratch.ids.read(np.int32, T * k).reshape(T, k), ids)
        limit = tol(_bound(u, ref, ex, ids, wts), max(d, F, F_s))
        err = np.abs(got - want)
        worst = np.unravel_index(np.argmax(err / limit), err.shape)
        assert (err <= limit).all(), (f"E={E} T={T}: worst {worst} got {got[worst]} want {want[worst]} "
                                      f"tol {limit[worst]}")


def test_compact_knob(gpu, rng, monkeypatch):
    """VKFLASH_MMID_COMPACT=0 launches the plain grid over every expert × max tiles; same bits."""
    E, k, d, F, F_s, T = 13, 4, 256, 64, 256, int(rng.integers(20, 80))  # T > BN: the plain grid is larger
    u = rng.standard_normal((T, d), dtype=np.float32)
    gw, _, _ = _layer(gpu, rng, u, E, d, F, F_s, fused=False)
    scratch = MoEScratch.create(gpu, T, k, d, E, F, F_s)
    outs, grids = [], []
    for compact in ("1", "0"):
        monkeypatch.setattr(settings, "_current", settings.load(env={"VKFLASH_MMID_COMPACT": compact}))
        f, g = _run(gpu, rng, gw, u, k, scratch)
        outs.append(f)
        grids.append({op.name: op.groups for op in g.ops if op.kernel.name.startswith("mul_mat_id_")})
    assert np.array_equal(outs[0], outs[1])
    for name, groups in grids[0].items():
        assert np.prod(groups[1:]) < np.prod(grids[1][name][1:]), f"{name}: the compact grid is not smaller"
