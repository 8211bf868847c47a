"""The ubatch size (UB) only changes how a prompt is cut into steps: the same tokens through
forwards of different UB each match the reference within MODEL.md's tolerance (the reference
follows each run through its router and QSA near-ties, where f32 runs of different UB, whose GDN
chunks and GEMM tiles see other row counts, may legitimately part ways)."""

from __future__ import annotations

import pytest

from hybrid_ref import device_logits, reference_logits
from vkflash.engine.gpu_forward import GpuForward
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
