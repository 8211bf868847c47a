"""The GPU forward of qwen4exp vs the float64 NumPy reference on `make-model` tiny files (fresh seed
each run): hyper-connections, PLE (host hashing + gathered table rows, dilated conv), GDN with the
tiled head map and σ gate, QSA block selection (dense up to W = 35, sparse after: masked prefill,
gathered decode), MoE and the head mixer. Logits at every position, prefill-then-decode, greedy
tokens, verify rows equal to decode, rollback of GDN/PLE states and history (in place and by copy)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hybrid_ref import (assert_same_states, check_decode_graph, check_logits_at_every_position,
                        check_prefill_decode_greedy, check_prompt_then_steps, check_rollback, knobs, live_states)
from vkflash.engine.gpu_forward import GpuForward
from vkflash.model.make_model import make_model

pytestmark = pytest.mark.gpu
V, EOS = 512, 2  # tiny vocabulary and its PLE n-gram reset token



def _model(tmp_path: Path, rng: np.random.Generator, variant: str | None = None) -> Path:
    seed = int(rng.integers(1 << 31))
    return make_model("qwen4exp", "tiny", "F32", seed, tmp_path / f"q4e-{seed}.gguf", variant=variant)[0]


def _prompt(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random tokens with a few PLE EOS resets (at 0 or 1, and twice in a row) mixed in."""
    toks = rng.integers(0, V, n)
    toks[int(rng.integers(0, 2))] = EOS
    at = int(rng.integers(3, n - 2))
    toks[at:at + 2] = EOS
    return toks



@pytest.mark.parametrize("variant", [None, "hc_norm_2d,ple_conv_f16,tied", "dense"],
                         ids=["default", "2d-norms-f16-conv-tied", "dense"])
def test_logits_at_every_position(gpu, rng, tmp_path, variant):
    """Teacher-forced logits of a 64-token prompt in steps 24 + 24 + 16 match the reference; QSA
    selects sparsely from position 35 (masked prefill), except in the all-dense variant."""
    path = _model(tmp_path, rng, variant)
    toks = _prompt(rng, 64)
    fwd = GpuForward(path, ctx=128, ub=24, kv="f32", gpu=gpu, logits_rows=24)
    check_logits_at_every_position(fwd, path, toks)


def test_prefill_then_decode_and_greedy(gpu, rng, tmp_path):
    """prefill(33) + 17 decodes crossing the dense → sparse boundary (t+1 = 35, 36: gathered decode)
    = one 50-token prefill = the reference; then 64 greedy tokens are the reference's."""
    path = _model(tmp_path, rng)
    toks = _prompt(rng, 50)
    fwd = GpuForward(path, ctx=600, ub=32, kv="f32", gpu=gpu)
    check_prefill_decode_greedy(fwd, path, toks, cut=33, prompt=40)


def test_rollback_by_slots(gpu, rng, tmp_path):
    """A 4-token verify-sized step writes a state plane per token for the GDN and PLE conv states;
    truncating 1..3 of its tokens goes back to one (and the PLE history): check_rollback."""
    path = _model(tmp_path, rng)
    toks = _prompt(rng, 40)
    check_rollback(lambda: GpuForward(path, ctx=64, ub=16, kv="f32", gpu=gpu), path, toks, int(rng.integers(1, 4)))


def test_decode_graph_is_one_submission(gpu, rng, tmp_path):
    """Decode replays one recorded submission: PLE, gathered QSA attention, head mixer, argmax."""
    path = _model(tmp_path, rng)
    fwd = GpuForward(path, ctx=256, ub=16, kv="f16", gpu=gpu)
    check_decode_graph(fwd, {"inp_embd", "blk.1.ple_gate", "blk.3.qsa_select", "blk.7.attn_gated", "result_output"})


@pytest.mark.slow
def test_long_prompt_sparse_selection(gpu, rng, tmp_path):
    """A 640-token prompt (150+ blocks, 8 kept: QSA sparse almost everywhere) in ubatches of 64,
    then 8 one-token steps (gathered decode), match the reference at every position; the reference
    follows the device through the router and QSA near-ties such a prompt meets. ~20 s on lavapipe."""
    path = _model(tmp_path, rng)
    toks = _prompt(rng, 648)
    fwd = GpuForward(path, ctx=700, ub=64, kv="f32", gpu=gpu, logits_rows=64)
    check_prompt_then_steps(fwd, path, toks, 8)


@pytest.mark.parametrize("shape", [{"H": 24, "H_kv": 1}, {"Dh": 96}], ids=["gqa24", "dh96"])
def test_prefill_beyond_row_lists(gpu, rng, tmp_path, monkeypatch, shape):
    """Shapes the per-query row lists cannot run (24 q heads per kv head > attn_decode's 16; head
    dim 96, no decode-kernel layout): sparse prefill gathers through per-tile unions instead and
    matches the reference at every position of a 64-token prompt (sparse from 35)."""
    import vkflash.model.make_model as mm
    from dataclasses import replace

    key = ("qwen4exp", "tiny")
    monkeypatch.setitem(mm.GEOMETRIES, key, replace(mm.GEOMETRIES[key], **shape))
    path = _model(tmp_path, rng)
    fwd = GpuForward(path, ctx=128, ub=64, kv="f32", gpu=gpu, logits_rows=64)
    check_logits_at_every_position(fwd, path, _prompt(rng, 64))


@pytest.mark.parametrize("variant", [None, "dense"], ids=["qsa", "dense"])
def test_verify_rows_equal_decode(gpu, rng, tmp_path, variant):
    """A verify-sized step (2..8 tokens, logits of every row) computes each row exactly as a decode
    step at its position does, bit for bit: attention row by row with the row's own cache length
    (flash-decode splits of a 600-token cache) and, past W = 35, its own QSA cell list."""
    path = _model(tmp_path, rng, variant)
    toks = _prompt(rng, 48)
    n = int(rng.integers(2, 9))
    fwd = GpuForward(path, ctx=600, ub=16, kv="f16", gpu=gpu)
    fwd.prefill(toks[:40])
    rows = fwd.prefill_logits(toks[40:40 + n])
    fwd.reset()
    fwd.prefill(toks[:40])
    np.testing.assert_array_equal(rows, np.stack([fwd.decode(int(t)) for t in toks[40:40 + n]]))


@pytest.mark.parametrize("back", [1, 3, 4])
def test_rollback_in_place_equals_copy(gpu, rng, tmp_path, back):
    """A 5-token verify step truncated by `back`: moving the live plane back (RSROLL=1, no copy) and
    copying the kept plane into the live one (RSROLL=0) leave every recurrent state and the PLE
    history bit for bit as a fresh run that fed only the kept tokens, and the next logits alike."""
    path = _model(tmp_path, rng)
    toks = _prompt(rng, 40)
    fresh = GpuForward(path, ctx=64, ub=16, kv="f32", gpu=gpu)
    fresh.prefill(toks[:31])
    fresh.verify(toks[31:36 - back])  # one step of the kept tokens (a decode step for 1)
    want = live_states(fresh)
    want_next = fresh.prefill(toks[36 - back:38])
    for roll in ("1", "0"):
        with knobs(RSROLL=roll):
            fwd = GpuForward(path, ctx=64, ub=16, kv="f32", gpu=gpu)
        rec = fwd.model.state.rec
        fwd.prefill(toks[:31])
        start = rec.live
        fwd.verify(toks[31:36])
        fwd.truncate(36 - back)
        assert rec.live == (start + 5 - (back if roll == "1" else 0)) % rec.n_planes
        assert_same_states(live_states(fwd), want)
        np.testing.assert_array_equal(fwd.prefill(toks[36 - back:38]), want_next)


@pytest.mark.parametrize("quant", ["mix", "Q8_0"])
def test_ple_rows_raw_equal_host_decoded(gpu, rng, tmp_path, quant):
    """PLE table rows staged as stored and decoded by the graph (VKFLASH_PLE_RAW=1, Q4_0 or Q8_0
    tables) give the same logits, bit for bit, as rows decoded to f32 on the host (=0), over a
    prefill of ragged steps and decode steps."""
    seed = int(rng.integers(1 << 31))
    path = make_model("qwen4exp", "tiny", quant, seed, tmp_path / f"q4e-{seed}.gguf")[0]
    toks = _prompt(rng, 40)
    out = {}
    for raw in ("1", "0"):
        with knobs(VKFLASH_PLE_RAW=raw):
            fwd = GpuForward(path, ctx=64, ub=16, kv="f32", gpu=gpu)
        assert (fwd.model.state.ple_type is not None) == (raw == "1")
        out[raw] = np.vstack([fwd.prefill(toks[:37]), *(fwd.decode(int(t)) for t in toks[37:])])
    np.testing.assert_array_equal(out["1"], out["0"])
