"""The GPU forward of qwen3next vs the float64 NumPy reference on `make-model` tiny files (fresh
seed each run): logits at every prompt position for both GDN layouts (attn_qkv+attn_gate, legacy
ssm_in), prefill-then-decode = one prefill, greedy tokens, checkpoint-slot rollback, one-submission
decode."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hybrid_ref import (SAME, check_decode_graph, check_logits_at_every_position, check_prefill_decode_greedy,
                        check_prompt_then_steps, check_rollback, device_logits, reference_logits, rel)
from vkflash.engine.gpu_forward import GpuForward
from vkflash.engine.graphs.common import Head
from vkflash.gpu.ops.attention import decode_splits
from vkflash.model.make_model import make_model
from vkflash.model.ties import Seen

pytestmark = pytest.mark.gpu
V = 512  # the tiny vocabulary



def _model(tmp_path: Path, rng: np.random.Generator, variant: str | None = None) -> Path:
    seed = int(rng.integers(1 << 31))
    return make_model("qwen3next", "tiny", "F32", seed, tmp_path / f"q3n-{seed}.gguf", variant=variant)[0]



@pytest.mark.parametrize("variant, split", [(None, False), ("ssm_in", False), (None, True)],
                         ids=["attn_qkv", "ssm_in", "gdn_split"])
def test_logits_at_every_position(gpu, rng, tmp_path, variant, split):
    """Teacher-forced logits of a 64-token prompt in steps 24 + 24 + 16 (chunked GDN, GEMM paths)
    match the reference; grouped v-head order, silu gate, ssm_ba (and ssm_in) rows re-ordered at upload;
    also with the delta rule's per-chunk pass and scan (VKFLASH_GDN_SPLIT=1)."""
    path = _model(tmp_path, rng, variant)
    toks = rng.integers(0, V, 64)
    dev = gpu.with_options(replace(gpu.options, gdn_split=split))
    fwd = GpuForward(path, ctx=128, ub=24, kv="f32", gpu=dev, logits_rows=24)
    assert any(op.desc.startswith("split") for op in fwd.graph(24, Head.LAST).ops) == split
    check_logits_at_every_position(fwd, path, toks)


def test_prefill_then_decode_and_greedy(gpu, rng, tmp_path):
    """prefill(37) + 13 decodes (step GDN, flash-decode) = one 50-token prefill = the reference; then
    64 greedy tokens from the device argmax are the reference's greedy continuation."""
    path = _model(tmp_path, rng)
    toks = rng.integers(0, V, 50)
    fwd = GpuForward(path, ctx=600, ub=32, kv="f32", gpu=gpu)
    assert decode_splits(fwd.n_ctx) > 1
    check_prefill_decode_greedy(fwd, path, toks, cut=37, prompt=21)


def test_rollback_by_slots_and_by_replay(gpu, rng, tmp_path):
    """A 4-token verify-sized step writes checkpoint slots: truncating 1..3 of its tokens restores a
    slot (check_rollback); truncating further back replays the prefix, after which the logits are
    those of a fresh run fed in the same steps, which match the reference."""
    path = _model(tmp_path, rng)
    toks = rng.integers(0, V, 40)

    def make_fwd():
        return GpuForward(path, ctx=64, ub=16, kv="f32", gpu=gpu)

    fwd = check_rollback(make_fwd, path, toks, int(rng.integers(1, 4)))
    fwd.truncate(20)  # no slot reaches this far: the prefix is re-run (steps 16 + 4)
    assert fwd.n_past == 20
    got = fwd.prefill(toks[20:40])
    fresh, seen = make_fwd(), Seen()
    device_logits(fresh, toks[:20], seen)
    want = device_logits(fresh, toks[20:40], seen)[-1]
    assert rel(got, want) <= SAME
    reference_logits(path, toks, seen).check(want, 39)


def test_decode_graph_is_one_submission(gpu, rng, tmp_path):
    """Decode replays one recorded submission that ends in the LM head and argmax."""
    path = _model(tmp_path, rng)
    fwd = GpuForward(path, ctx=256, ub=16, kv="f16", gpu=gpu)
    check_decode_graph(fwd, {"inp_embd", "blk.0.gdn_o", "blk.3.attn_gated", "blk.7.ffn_out", "result_output"})


@pytest.mark.slow
@pytest.mark.parametrize("variant", [None, "ssm_in"], ids=["attn_qkv", "ssm_in"])
def test_long_prompt(gpu, rng, tmp_path, variant):
    """A 640-token prompt in ubatches of 64 (chunked GDN over many chunks, GEMM paths), then 8
    one-token steps (step GDN, flash-decode), match the reference at every position; it follows
    the device through the router near-ties such a prompt meets. ~10 s on lavapipe."""
    path = _model(tmp_path, rng, variant)
    toks = rng.integers(0, V, 648)
    fwd = GpuForward(path, ctx=700, ub=64, kv="f32", gpu=gpu, logits_rows=64)
    check_prompt_then_steps(fwd, path, toks, 8)
