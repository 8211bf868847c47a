"""The ubatch size (UB) only changes how a prompt is cut into steps: the same tokens through
forwards of different UB each match the reference within MODEL.md's tolerance (the reference
follows each run through its router and QSA near-ties, where f32 runs of different UB, whose GDN
chunks and GEMM tiles see other row counts, may legitimately part ways)."""

from __future__ import annotations

import pytest

from hybrid_ref import device_logits, reference_logits
from vkflash.engine.gpu_forward import GpuForward
from vkflash.gpu.options import Fusion
from vkflash.model.make_model import make_model
from vkflash.model.ties import Seen

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["qwen4exp", "qwen3next"])
def test_ubatch_sizes_agree(gpu, rng, tmp_path, arch):
    """UB = 1, a ragged one and 64 over an 80-token prompt (past the QSA threshold at 35)."""
    seed = int(rng.integers(1 << 31))
    path = make_model(arch, "tiny", "F32", seed, tmp_path / f"{arch}-{seed}.gguf")[0]
    toks = rng.integers(0, 512, 80)
    for ub in (1, int(rng.integers(5, 30)), 64):
        fwd = GpuForward(path, ctx=128, ub=ub, kv="f32", gpu=gpu, logits_rows=min(ub, 64))
        seen = Seen()
        got = device_logits(fwd, toks, seen)
        reference_logits(path, toks, seen).check(got)


def test_dropped_graphs_free_what_they_own(gpu, rng, tmp_path):
    """A UB change drops the step graphs, and the buffers they own (qwen4exp's HC inject partials, a
    norm-inject fusion's: the tiny file's inject rows would otherwise stack with the mix's, unlike a
    real file's F32 inject beside quantized mix weights) are freed with them at once, not whenever
    the collector and the device's algorithm cache let go of them."""
    path = make_model("qwen4exp", "tiny", "F32", int(rng.integers(1 << 31)), tmp_path / "m.gguf")[0]
    gpu = gpu.with_options(gpu.options.without(Fusion.STACK), own_arena=True)
    fwd = GpuForward(path, ctx=64, ub=16, kv="f16", gpu=gpu)
    fwd.prefill(rng.integers(0, 512, 3))
    owned = [b for g in fwd.graphs() for b in g.owned]
    assert owned and all(b.tensor is not None for b in owned)
    fwd.set_ubatch(8)
    assert all(b.tensor is None and b.committed == 0 for b in owned)
    fwd.prefill(rng.integers(0, 512, 3))  # built again, with buffers of their own
    assert all(g.owned for g in fwd.graphs())
