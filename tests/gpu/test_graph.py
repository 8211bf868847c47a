"""The graph runner: long dependent chains replayed with fresh inputs, barriers only on real
dependencies, submissions split and kept in flight, and the staging path of device-only buffers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from chain import chain, chain_ref
from vkflash.gpu import context
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.views import Rows

pytestmark = pytest.mark.gpu

ALPHAS = np.array([-1.0, -0.5, 0.5, 1.0, -2.0], np.float32)


@pytest.mark.parametrize("per_submission", [0, 16], ids=["one_submission", "split"])
def test_long_chain_replays_with_fresh_input(gpu, rng, per_submission):
    """≥ 100 dependent dispatches, exact after the first run and after replays of new inputs."""
    n, steps = int(rng.integers(200, 3000)), int(rng.integers(100, 140))
    alphas = rng.choice(ALPHAS, steps)
    pb, qb = gpu.buffer(4 * n, "P"), gpu.buffer(4 * n, "Q")
    p, q = Rows.flat(pb, n), Rows.flat(qb, n)
    g = gpu.graph("chain", max_ops_per_submission=per_submission)
    chain(g, p, q, alphas)
    for replay in range(4):
        x0, y0 = rng.standard_normal((2, n)).astype(np.float32)
        pb.write(x0)
        qb.write(y0)
        g.run()
        want_p, want_q = chain_ref(x0, y0, alphas)
        np.testing.assert_array_equal(pb.read(np.float32), want_p, err_msg=f"replay {replay}")
        np.testing.assert_array_equal(qb.read(np.float32), want_q, err_msg=f"replay {replay}")
    expected_subs = 1 if not per_submission else -(-steps // per_submission)
    assert len(g.submissions) == expected_subs
    # one barrier at the top of each submission, plus one before every op but the first of each
    assert g.barriers == steps


def test_barriers_only_on_dependencies(gpu, rng):
    """Independent dispatches share a barrier interval; RAW, WAR and WAW each start a new one."""
    n = 64
    x1, x2, y1, y2, y3 = (gpu.upload(rng.standard_normal(n).astype(np.float32), nm)
                          for nm in ("x1", "x2", "y1", "y2", "y3"))
    v = {b.name: Rows.flat(b, n) for b in (x1, x2, y1, y2, y3)}
    g = gpu.graph("deps")
    E.silu(g, v["x1"], v["y1"])          # 0
    E.sigmoid(g, v["x2"], v["y2"])       # 1: independent of 0: same interval
    E.add(g, v["y1"], v["x2"], v["y3"])  # 2: reads y1 (RAW on 0): barrier
    E.scale(g, v["x2"], 2.0, v["x1"])    # 3: writes x1, read by 0 before that barrier: none
    E.scale(g, v["y3"], 3.0, v["y2"])    # 4: reads y3 (RAW on 2), writes y2 (WAW on 1): barrier
    E.silu(g, v["x1"], v["y1"])          # 5: reads x1 (RAW on 3, already behind 4's barrier): none
    E.mul(g, v["x2"], v["x2"], v["y3"])  # 6: writes y3, read by 4 (WAR): barrier
    g.record()
    (sub,) = g.submissions
    # kp op slots: 0 = the submission's leading barrier; a gap marks a barrier before that op
    assert sub.op_slots == [1, 2, 4, 5, 7, 8, 10]
    assert g.barriers == 4


def test_results_with_independent_ops_in_one_interval(gpu, rng):
    """The unbarriered pair above computes correctly (run, check, replay with new data)."""
    n = int(rng.integers(100, 1000))
    a, b = gpu.buffer(4 * n, "a"), gpu.buffer(4 * n, "b")
    ya, yb = gpu.buffer(4 * n, "ya"), gpu.buffer(4 * n, "yb")
    g = gpu.graph("pair")
    E.scale(g, Rows.flat(a, n), -2.0, Rows.flat(ya, n))
    E.scale(g, Rows.flat(b, n), 0.5, Rows.flat(yb, n))
    for _ in range(2):
        xa, xb = rng.standard_normal((2, n)).astype(np.float32)
        a.write(xa)
        b.write(xb)
        ya.fill(np.nan)
        yb.fill(np.nan)
        g.run()
        np.testing.assert_array_equal(ya.read(np.float32), np.float32(-2) * xa)
        np.testing.assert_array_equal(yb.read(np.float32), np.float32(0.5) * xb)
    assert g.barriers == 1


def test_staging_round_trip_odd_offsets(gpu, rng, monkeypatch):
    """Device-only buffers (as on a discrete GPU) are written and read through the staging ring:
    unaligned edges (read-modify-write of the boundary words) and transfers of several chunks. On a
    view of the device with its own ring and ledger: the shared one keeps no ring (memory plans of
    later tests count what a UMA device holds)."""
    gpu = gpu.with_options(gpu.options, own_arena=True)
    gpu.staging  # the full-size ring exists before the chunk size is shrunk below
    monkeypatch.setattr(context, "STAGING_BYTES", 256)
    monkeypatch.setattr(gpu, "caps", dataclasses.replace(gpu.caps, uma=False))
    nbytes = int(rng.integers(1500, 3000))
    buf = gpu.buffer(nbytes, "device_only")
    assert not buf.host_visible
    model = rng.integers(0, 256, buf.nbytes, dtype=np.uint8)
    buf.write(model)
    for _ in range(6):
        off = int(rng.integers(0, nbytes - 2))
        data = rng.integers(0, 256, int(rng.integers(1, min(900, nbytes - off))), dtype=np.uint8)
        buf.write(data, off)
        model[off:off + data.size] = data
        lo = int(rng.integers(0, nbytes - 1))
        cnt = int(rng.integers(1, nbytes - lo))
        np.testing.assert_array_equal(buf.read(np.uint8, cnt, lo), model[lo:lo + cnt])
    np.testing.assert_array_equal(buf.read(np.uint8), model)
    f = rng.standard_normal(17).astype(np.float32)
    buf.write(f, 3)
    np.testing.assert_array_equal(buf.read(np.float32, 17, 3), f)


def test_barrier_every_dispatch_revert_knob(gpu, rng):
    """VKFLASH_DEP_BARRIERS=0 puts a barrier before every dispatch; results equal the tracked path."""
    from vkflash.gpu.options import GpuOptions

    n = int(rng.integers(100, 1000))
    x = gpu.upload(rng.standard_normal(n).astype(np.float32), "x")
    outs = {}
    for flag in ("1", "0"):
        y1, y2, y3 = (gpu.buffer(4 * n, f"y{i}") for i in range(3))
        g = gpu.with_options(GpuOptions.from_knobs(VKFLASH_DEP_BARRIERS=flag)).graph(f"knob{flag}")
        E.silu(g, Rows.flat(x, n), Rows.flat(y1, n))
        E.sigmoid(g, Rows.flat(x, n), Rows.flat(y2, n))      # independent of the silu
        E.add(g, Rows.flat(y1, n), Rows.flat(y2, n), Rows.flat(y3, n))
        g.run()
        outs[flag] = (g.barriers, y3.read(np.float32))
    assert outs["1"][0] == 2 and outs["0"][0] == 4  # leading barrier + (1 dependency | every op)
    np.testing.assert_array_equal(outs["1"][1], outs["0"][1])


@pytest.mark.parametrize("flag", ["auto", "1", "0"])
def test_spin_wait_knob(gpu, rng, flag):
    """VKFLASH_SPIN_WAIT: auto polls on GPUs only; a polled chain gives the sleeping one's bits."""
    from vkflash.gpu.options import GpuOptions

    gpu = gpu.with_options(GpuOptions.from_knobs(VKFLASH_SPIN_WAIT=flag))
    assert gpu.spin_wait == (flag == "1" or (flag == "auto" and gpu.caps.device_type != "cpu"))
    n, steps = int(rng.integers(200, 3000)), int(rng.integers(20, 40))
    alphas = rng.choice(ALPHAS, steps)
    pb, qb = gpu.buffer(4 * n, "P"), gpu.buffer(4 * n, "Q")
    g = gpu.graph(f"spin{flag}")
    chain(g, Rows.flat(pb, n), Rows.flat(qb, n), alphas)
    x0, y0 = rng.standard_normal((2, n)).astype(np.float32)
    pb.write(x0)
    qb.write(y0)
    g.run()
    want_p, want_q = chain_ref(x0, y0, alphas)
    np.testing.assert_array_equal(pb.read(np.float32), want_p)
    np.testing.assert_array_equal(qb.read(np.float32), want_q)


def test_gpu_failure_becomes_device_error(gpu, rng):
    """A kp error while a submission runs (how a lost device shows) is a DeviceError naming the
    graph, so the server can report itself unhealthy."""
    from vkflash.errors import DeviceError

    n = 16
    x, y = gpu.upload(rng.standard_normal(n).astype(np.float32), "x"), gpu.buffer(4 * n, "y")
    g = gpu.graph("doomed")
    E.silu(g, Rows.flat(x, n), Rows.flat(y, n))
    g.record()

    class Lost:
        def __init__(self, seq):
            self.seq = seq

        def eval_async(self):
            self.seq.eval_async()

        def eval_await(self, *a):
            self.seq.eval_await()
            raise RuntimeError("vk::Queue::submit: ErrorDeviceLost")

    sub = g.submissions[0]
    sub.seq = Lost(sub.seq)
    with pytest.raises(DeviceError, match="doomed"):
        g.run()
    assert g.in_flight == 0
