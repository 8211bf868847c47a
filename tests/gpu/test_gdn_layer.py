"""The four GDN kernels chained in one graph (G2–G9 after the projections) vs the model reference's
causal_conv, recurrent and gated norm, over a prefill ubatch then decode steps with carried state."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.ops import gdn
from vkflash.gpu.ops.gdn import Gate, GDNShape, HeadMap
from vkflash.gpu.ops.views import Rows
from vkflash.model.layers.common import sigmoid, silu, softplus
from vkflash.model.layers.gdn import causal_conv, recurrent
from vkflash.model.layers.norms import l2_norm, rms

pytestmark = pytest.mark.gpu
EPS = 1e-6


@pytest.mark.parametrize("arch", ["qwen4exp", "qwen3next"])
def test_layer_chain(gpu, rng, arch):
    """Rows of a fused projection [m | z | b | a] → conv, gates, delta, gated norm; ubatches of
    T₀ (chunked), 1 and 1 (step) tokens in one recorded graph, states in place."""
    n_k, n_v, S, K = 2, 6, 32, 4
    head_map, act = (HeadMap.TILED, Gate.SIGMOID) if arch == "qwen4exp" else (HeadMap.GROUPED, Gate.SILU)
    shape = GDNShape(n_k, n_v, S, head_map)
    C, Z = shape.C, n_v * S
    W = C + Z + 2 * n_v  # one fused projection row
    parts = [int(rng.integers(20, 140)), 1, 1]
    T = sum(parts)
    proj = rng.standard_normal((T, W)).astype(np.float32)
    wconv = rng.normal(0, 0.5, (C, K)).astype(np.float32)
    dt = (1 + rng.uniform(-0.5, 0.5, n_v)).astype(np.float32)
    sa = (-rng.uniform(0.05, 1, n_v)).astype(np.float32)
    wn = rng.uniform(0.9, 1.1, S).astype(np.float32)

    pb, wb = gpu.upload(proj, "proj"), gpu.upload(wconv, "conv1d")
    parb = gpu.upload(np.concatenate([dt, sa, wn]), "dt|a|norm")
    conv_st, ssm_st = gpu.buffer(4 * (K - 1) * C, "conv_state"), gpu.buffer(4 * n_v * S * S, "ssm_state")
    cb, gates_b = gpu.buffer(4 * T * C, "c"), gpu.buffer(4 * 2 * T * n_v, "beta|g")
    ob, yb = gpu.buffer(4 * T * Z, "o"), gpu.buffer(4 * T * Z, "y")
    for b in (cb, gates_b, ob, yb):
        b.fill(np.nan)
    g = gpu.graph("gdn_layer")
    t0 = 0
    for n in parts:
        m = Rows(pb, n, C, t0 * W, W)
        c = Rows(cb, n, C, t0 * C)
        beta, gg = Rows(gates_b, n, n_v, t0 * 2 * n_v, 2 * n_v), Rows(gates_b, n, n_v, t0 * 2 * n_v + n_v, 2 * n_v)
        gdn.conv(g, m, Rows(wb, C, K), Rows(conv_st, K - 1, C), c)
        gdn.gates(g, Rows(pb, n, n_v, t0 * W + C + Z, W), Rows(pb, n, n_v, t0 * W + C + Z + n_v, W),
                  Rows.flat(parb, n_v), Rows.flat(parb, n_v, n_v), beta, gg)
        o = Rows(ob, n, Z, t0 * Z)
        gdn.delta(g, c, beta, gg, Rows(ssm_st, n_v, S * S), o, shape, EPS)
        gdn.gated_norm(g, o, Rows(pb, n, Z, t0 * W + C, W), Rows.flat(parb, S, 2 * n_v), Rows(yb, n, Z, t0 * Z), S,
                       EPS, act)
        t0 += n
    g.run()

    # float64 reference, as gdn_layer composes it
    p64 = proj.astype(np.float64)
    m, z, bb, aa = np.split(p64, [C, C + Z, C + Z + n_v], axis=1)
    c, conv_want = causal_conv(m, np.zeros((K - 1, C)), wconv.astype(np.float64))
    beta = sigmoid(bb)
    gate = softplus(aa + dt) * sa
    q = l2_norm(c[:, :n_k * S].reshape(T, n_k, S), EPS) / np.sqrt(S)
    k = l2_norm(c[:, n_k * S:2 * n_k * S].reshape(T, n_k, S), EPS)
    j = np.arange(n_v)
    pi = j % n_k if head_map == HeadMap.TILED else j // (n_v // n_k)
    o, ssm_want = recurrent(q[:, pi], k[:, pi], c[:, 2 * n_k * S:].reshape(T, n_v, S), beta, gate,
                            np.zeros((n_v, S, S)))
    a = sigmoid if act == Gate.SIGMOID else silu
    y = (rms(o, EPS) * wn * a(z.reshape(T, n_v, S))).reshape(T, Z)

    np.testing.assert_array_equal(conv_st.read(np.float32).reshape(K - 1, C), conv_want)
    # y is O(1) after the norm; its error is o's (≲ 1e-6 of the scale, see test_gdn_delta) over o's
    # rms, plus the gates' 2^-21 in g carried through e^g (measured ≤ 8e-7 of max|y|): 2e-5 leaves
    # a margin of 25, while a wrong map, gate or activation is O(1).
    err = np.abs(yb.read(np.float32).reshape(T, Z) - y)
    assert err.max() <= 2e-5 * np.abs(y).max(), f"y max err {err.max():.3g}"
    st_err = np.abs(ssm_st.read(np.float32).reshape(n_v, S, S) - ssm_want).max()
    assert st_err <= 2e-5 * np.abs(ssm_want).max(), f"state max err {st_err:.3g}"
