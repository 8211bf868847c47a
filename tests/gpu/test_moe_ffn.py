"""The whole MoE FFN (MODEL.md §5.7 M1–M4) of the step graphs (engine/graphs/hybrid.py
moe_sublayer) on the GPU vs the float64 model reference (vkflash/model/layers/moe.py), the
combine kernel, and the VKFLASH_MMID_COMPACT knob."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from matmul_util import dequant_rows, random_weight
from moe_util import SILU_SLOPE, experts, poisoned, read_rows, routed_reference, rows_view, tol
from vkflash.engine.dump import read_taps, tapped
from vkflash.engine.graphs.common import StepModel
from vkflash.engine.graphs.hybrid import moe_sublayer
from vkflash.engine.weights_gpu import GpuTensor, GpuWeights
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.moe import moe_combine
from vkflash.gpu.options import GpuOptions
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


def _dense(gpu, q: Q, n_out: int, k: int, rng, name: str) -> tuple[GpuTensor, np.ndarray]:
    raw = random_weight(q, n_out, k, rng)
    return GpuTensor(name, gpu.upload(raw, name), q, (k, n_out)), dequant_rows(raw, q, n_out, k)


def _layer(gpu, rng, u: np.ndarray, E: int, d: int, F: int, F_s: int, k: int, fused: bool):
    """Layer 0's MoE tensors as the forward uploads them (gate/up Q4_K, one buffer when fused, down
    Q5_0 as in real files; shared Q8_0/Q6_K; F32 gates), a model of them, and the reference's."""
    ex = experts(gpu, Q.Q4_K, Q.Q5_0, E, d, F, rng)
    wr = _router(u, E, rng)
    wsg = (rng.standard_normal(d) / np.sqrt(d)).astype(np.float32)
    b = "blk.0."
    t = {b + "ffn_gate_inp.weight": GpuTensor("router", gpu.upload(wr, "router"), Q.F32, (d, E)),
         b + "ffn_gate_inp_shexp.weight": GpuTensor("sh_gate_inp", gpu.upload(wsg, "sh_gate_inp"), Q.F32, (d,))}
    (sg, sg64), (su, su64) = (_dense(gpu, Q.Q8_0, F_s, d, rng, n) for n in ("sh_gate", "sh_up"))
    sd, sd64 = _dense(gpu, Q.Q6_K, d, F_s, rng, "sh_down")
    t.update({b + "ffn_gate_shexp.weight": sg, b + "ffn_up_shexp.weight": su, b + "ffn_down_shexp.weight": sd})
    r = ex.fused if fused else ex.split
    for leaf, st in (("gate", r.gate), ("up", r.up)):
        t[b + f"ffn_{leaf}_exps.weight"] = GpuTensor(leaf, st.buf, Q(st.qtype), (d, F, E), st.row0, st.expert_rows)
    t[b + "ffn_down_exps.weight"] = GpuTensor("down", r.down.buf, Q(r.down.qtype), (F, d, E))
    hp = SimpleNamespace(E=E, k=k, F=F, F_s=F_s, d=d)
    model = StepModel(gpu, hp, GpuWeights(hp, None, t), None, None, None)
    ref = MoEW(wr.astype(np.float64), ex.gate, ex.up, ex.down, wsg.astype(np.float64), sg64, su64, sd64)
    return model, ref, ex


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


def _run(gpu, rng, model: StepModel, u: np.ndarray, options: GpuOptions | None = None):
    """f = MoE(u) through moe_sublayer, and the router's top-k ids (tapped)."""
    d, T = u.shape[1], u.shape[0]
    f = poisoned(gpu, T, d, rng, "f")
    g = gpu.with_options(options or GpuOptions()).graph("moe_ffn")
    E.scale(g, moe_sublayer(g, model, 0, rows_view(gpu, u, rng, "u")), 1.0, f, name="f")
    dumped, taps = tapped(g, ["blk.0.ffn_moe_topk"])
    dumped.run()
    ids = read_taps(taps)["blk.0.ffn_moe_topk"].view(np.int32)
    return read_rows(f), ids, g


@pytest.mark.parametrize("E", [16, 13])
def test_moe_ffn_vs_reference(gpu, rng, E):
    """Ragged T through the decode (T ≤ 8) and prefill paths; fused and separate gate/up stacks."""
    k, d, F, F_s = 4, 256, int(rng.integers(2, 6)) * 32, 256
    for T in (1, 3, 8, 9, 37, 130):
        u = rng.standard_normal((T, d), dtype=np.float32)
        model, ref, ex = _layer(gpu, rng, u, E, d, F, F_s, k, fused=bool(rng.integers(0, 2)))
        dumped: dict[str, np.ndarray] = {}
        opts = RefOptions(dump=lambda n, x: dumped.__setitem__(n.split(".")[-1], x))
        want = moe(u.astype(np.float64), ref, k, opts, 0)
        got, got_ids, _ = _run(gpu, rng, model, u)
        ids, wts = dumped["ffn_moe_topk"], dumped["ffn_moe_weights"]
        np.testing.assert_array_equal(got_ids, ids)
        limit = tol(_bound(u, ref, ex, ids, wts), max(d, F, F_s))
        err = np.abs(got - want)
        worst = np.unravel_index(np.argmax(err / limit), err.shape)
        assert (err <= limit).all(), (f"E={E} T={T}: worst {worst} got {got[worst]} want {want[worst]} "
                                      f"tol {limit[worst]}")


def test_compact_knob(gpu, rng):
    """VKFLASH_MMID_COMPACT=0 launches the plain grid over every expert × max tiles; same bits."""
    E, k, d, F, F_s, T = 13, 4, 256, 64, 256, int(rng.integers(20, 80))  # T > BN: the plain grid is larger
    u = rng.standard_normal((T, d), dtype=np.float32)
    model, _, _ = _layer(gpu, rng, u, E, d, F, F_s, k, fused=False)
    outs, grids = [], []
    for compact in ("1", "0"):
        f, _, g = _run(gpu, rng, model, u, GpuOptions.from_knobs(VKFLASH_MMID_COMPACT=compact))
        outs.append(f)
        grids.append({op.name: op.groups for op in g.ops if op.kernel.name.startswith("mul_mat_id_")})
    assert np.array_equal(outs[0], outs[1])
    for name, groups in grids[0].items():
        assert np.prod(groups[1:]) < np.prod(grids[1][name][1:]), f"{name}: the compact grid is not smaller"
