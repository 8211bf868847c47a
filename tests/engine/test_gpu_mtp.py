"""MTP self-speculative decoding on the GPU (MODEL.md §5.10), on `make-model` tiny qwen4exp files with
an MTP block, in the model file and as a separate MTP-only file (also in a smaller quant than the
target): the draft head against model/mtp.py, greedy speculation token for token plain decoding,
the states a rolled-back verify leaves bit for bit those of plain decoding, sampled speculation
with the target's token distribution, the livelock guard, configuration errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chi2 import chi2_pvalue
from fakes import ByteCodec
from hybrid_ref import assert_same_states, device_logits, knobs, live_states
from vkflash.engine.api import SamplingParams, TokenEvent
from vkflash.engine.generate import generate
from vkflash.engine.gpu_forward import GpuForward
from vkflash.engine.speculate import GUARD, Speculator, agreeing
from vkflash.errors import ConfigError
from vkflash.model import mtp as ref_mtp
from vkflash.model import qwen4exp
from vkflash.model.make_model import make_model
from vkflash.model.ties import ROUTE_TIE, Follow, Seen
from vkflash.model.weights import load_model

pytestmark = pytest.mark.gpu
V = 512
EXACT = 1e-3  # MODEL.md §7.10: max|Δ| ≤ 1e-3·std(logits)
ALPHA = 1e-5  # false-alarm rate of the statistical test


def _models(tmp_path: Path, rng: np.random.Generator, layout: str) -> tuple[Path, Path | None]:
    """(model, draft file or None) for layout in-file | separate | separate-q8 (the draft in Q8_0,
    the target in F32: the same seed gives the same weights before quantization)."""
    seed = int(rng.integers(1 << 31))
    if layout == "in-file":
        return make_model("qwen4exp", "tiny", "F32", seed, tmp_path / f"m{seed}.gguf", mtp_block=True)[0], None
    trunk, draft = make_model("qwen4exp", "tiny", "F32", seed, tmp_path / f"t{seed}.gguf", mtp_separate=True)
    if layout == "separate-q8":
        draft = make_model("qwen4exp", "tiny", "Q8_0", seed, tmp_path / f"q{seed}.gguf", mtp_separate=True)[1]
    return trunk, draft


def _open(gpu, path: Path, draft: Path | None, ctx: int = 128, ub: int = 8, kv: str = "f16",
          small_path: Path | None = None, **flags: str) -> Speculator:
    with knobs(**flags):
        return Speculator.open(path, draft, small_path, ctx=ctx, ub=ub, kv=kv, gpu=gpu)


def _reference_rows(path: Path, draft: Path | None, toks: list[int], x: int, drafted: list[int], seen: Seen,
                    dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """model/mtp.py's draft logits for: catch-up rows 1..n−1, the draft row (x), then chained rows on
    the GPU's own drafted tokens; the target follows the device through router/QSA near-ties.
    Also each of those rows' MTP router gap (k-th minus (k+1)-th probability over the k-th)."""
    w = load_model(path, dtype)
    follow = Follow(seen, w.hp)
    st = qwen4exp.new_state(w, keep_hidden=True, cache_dtype=np.float32, route=follow.route, select=follow.select)
    qwen4exp.prefill(toks, st)
    probs: list[np.ndarray] = []
    ms = ref_mtp.new_mtp_state(w, load_model(draft, dtype) if draft else None, cache_dtype=np.float32,
                               dump=lambda name, a: probs.append(a) if name.endswith("ffn_moe_probs") else None)
    n = st.n
    p = np.arange(1, n + 1)
    logits, R = ref_mtp.mtp_rows(np.asarray(st.tokens + [x])[p], st.hidden[p - 1], p, ms)
    rows, gaps, H = [logits[-1]], [probs[-1][-1]], R[-1:]
    for j, d in enumerate(drafted[:-1], 1):
        lg, H = ref_mtp.mtp_rows(np.array([d]), H, np.array([n + j]), ms)
        rows.append(lg[-1])
        gaps.append(probs[-1][-1])
    k = w.hp.k
    top = -np.sort(-np.array(gaps), axis=1)
    return np.array(rows), (top[:, k - 1] - top[:, k]) / top[:, k - 1]


@pytest.mark.parametrize("layout", ["in-file", "separate", "separate-q8"])
def test_draft_head_matches_reference(gpu, rng, tmp_path, layout):
    """After a 29-token prompt (ubatches 8+8+8+4+1: the catch-up of every prompt position), the
    draft row and 4 chained rows: logits within MODEL.md's 1e-3·std of the float64 reference (or
    4× the float32 reference's own error), the same drafted tokens. A row whose MTP router has a
    near-tie (report, do not fail: §7.10) is left out; a prompt whose draft row has one is drawn again."""
    path, draft = _models(tmp_path, rng, layout)
    sp = _open(gpu, path, draft, kv="f32")
    for _ in range(5):  # a near-tie in the draft row's router: ~1e-3 of prompts
        toks = [int(t) for t in rng.integers(0, V, 29)]
        sp.reset()
        seen = Seen()
        x = int(np.argmax(device_logits(sp.fwd, np.asarray(toks), seen)[-1]))
        dr = sp.drafter.draft(x, 5, logits=True)
        assert dr.logits is not None
        ref64, gaps = _reference_rows(path, draft, toks, x, dr.ids, seen, np.float64)
        ok = gaps > ROUTE_TIE
        if ok[0]:
            break
    assert ok[0], "the draft row's MTP router has a near-tie in five prompts; nothing to compare"
    ref32, _ = _reference_rows(path, draft, toks, x, dr.ids, seen, np.float32)
    for i in np.flatnonzero(ok):
        err = np.abs(dr.logits[i] - ref64[i]).max() / ref64[i].std()
        tol = max(EXACT, 4 * np.abs(ref32[i] - ref64[i]).max() / ref64[i].std())
        assert err <= tol, f"row {i}: max|Δ| = {err:.2e}·std > {tol:.2e}"
        top2 = np.sort(ref64[i])[-2:]
        assert dr.ids[i] == int(np.argmax(ref64[i])) or top2[1] - top2[0] <= 2 * tol * ref64[i].std()


def _generate(fwd, prompt: list[int], params: SamplingParams) -> tuple[list[int], object]:
    evs = list(generate(fwd, ByteCodec(eog=-1), prompt, params, ubatch=16))
    return [e.token for e in evs if isinstance(e, TokenEvent)], evs[-1]


@pytest.mark.parametrize("layout, draft_len, accept, adapt, prompts, catchup_async, ub", [
    ("in-file", 2, 0.6, "0", (21, 25), "1", 8), ("separate-q8", 7, 0.9, "1", (22, 26), "1", 8),
    ("in-file", 4, None, "0", (23,), "1", 8), ("in-file", 3, 0.6, "0", (24,), "0", 8),
    ("in-file", 6, 0.9, "0", (21,), "1", 4)])
def test_greedy_speculation_is_plain_decoding(gpu, rng, tmp_path, layout, draft_len, accept, adapt, prompts,
                                              catchup_async, ub):
    """For several prompts (ubatches of 8 and a tail, QSA sparse from position 35), greedy output
    with MTP is token for token plain decoding's up to the context end (≥ 64 tokens): with drafts
    agreeing with the output with probability `accept` (rounds accept every number of drafts and
    roll the rest back; fixed or adaptive length), or the head's own drafts (on random weights
    nearly all rejected); timings count the drafts. The catch-up rows run ahead of the target
    step unwaited, or (VKFLASH_MTP_CATCHUP_ASYNC=0) waited for. A ubatch smaller than a round
    (UB 4, DRAFT 6) boots, warms as the server does, and verifies at most 4 tokens a step."""
    path, draft = _models(tmp_path, rng, layout)
    plain = GpuForward(path, ctx=90, ub=8, kv="f16", gpu=gpu)
    sp = _open(gpu, path, draft, ctx=90, ub=ub, DRAFT=str(draft_len), SPEC_ADAPT=adapt,
               VKFLASH_MTP_CATCHUP_ASYNC=catchup_async)
    assert sp.drafter._async == (catchup_async == "1")
    sp.warm()
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    for n_prompt in prompts:
        prompt = [int(t) for t in rng.integers(0, V, n_prompt)]
        want, _ = _generate(plain, prompt, params)
        assert len(want) == 90 - n_prompt >= 64
        if accept is not None:
            sp.propose = agreeing(want, n_prompt, accept, V, rng)
            sp.policy.t_plain = 1.0  # adaptive: drafting looks cheap next to a plain round, so it happens
        got, fin = _generate(sp, prompt, params)
        assert got == want
        assert fin.reason == "length" and fin.timings.draft_n == sp.drafted > 0  # type: ignore[attr-defined]
        if accept is not None:
            assert 0 < sp.accepted < sp.drafted


@pytest.mark.parametrize("rsroll", ["1", "0"])
def test_rollback_leaves_plain_decoding_states(gpu, rng, tmp_path, rsroll):
    """After greedy speculation whose verify steps are partly rejected (drafts agreeing with
    probability 0.5), every recurrent state, the PLE history, the K/V, indexer-key and summary rows
    of the sequence are bit for bit those of plain decoding of the same tokens; RSROLL=1 (live
    plane moved) and RSROLL=0 (plane copied) alike."""
    path, _ = _models(tmp_path, rng, "in-file")
    prompt = [int(t) for t in rng.integers(0, V, 37)]
    plain = GpuForward(path, ctx=96, ub=8, kv="f16", gpu=gpu)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want, _ = _generate(plain, prompt, params)
    sp = _open(gpu, path, None, ctx=96, RSROLL=rsroll, DRAFT="5", SPEC_ADAPT="0")
    sp.propose = agreeing(want, len(prompt), 0.5, V, rng)
    got, _ = _generate(sp, prompt, params)
    assert got == want and 0 < sp.accepted < sp.drafted
    assert sp.n_past == plain.n_past == len(prompt) + len(want) - 1
    assert_same_states(live_states(sp.fwd), live_states(plain))
    n = plain.n_past
    for i, kv in plain.model.kv.layers.items():
        np.testing.assert_array_equal(sp.fwd.model.kv[i].k.read(n), kv.k.read(n))
        np.testing.assert_array_equal(sp.fwd.model.kv[i].v.read(n), kv.v.read(n))
    for i, idx in plain.model.state.idx.items():
        mine = sp.fwd.model.state.idx[i]
        np.testing.assert_array_equal(mine.keys.read(n), idx.keys.read(n))
        blocks = n // idx.r * idx.keys.dim
        np.testing.assert_array_equal(mine.summary.read(np.float32, blocks), idx.summary.read(np.float32, blocks))


def test_draft_rows_stay_inside_the_head_cache(gpu, rng, tmp_path, monkeypatch):
    """A prompt ending 1..4 positions short of the caches' first chunk (64), then rounds of 6 drafts
    (mostly accepted, so later rounds start anywhere): every cell a round writes into the head's K/V
    cache is memory the cache holds (the target's verify step grows the caches only after the
    draft); the output is plain decoding's."""
    from vkflash.engine.graphs.mtp import CELL_SHIFT
    from vkflash.gpu.ops.attention import Cache

    path, _ = _models(tmp_path, rng, "in-file")
    n_prompt = 64 - int(rng.integers(1, 5))
    prompt = [int(t) for t in rng.integers(0, V, n_prompt)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want, _ = _generate(GpuForward(path, ctx=128, ub=8, kv="f16", gpu=gpu), prompt, params)
    sp = _open(gpu, path, None, ctx=128, DRAFT="6", SPEC_ADAPT="0")
    sp.propose = agreeing(want, n_prompt, 0.9, V, rng)
    d, kv = sp.drafter, sp.drafter.d.model.kv[sp.fwd.hp.L].k
    written: list[tuple[int, int]] = []  # (last cell a round writes, cells the cache holds)
    start = d._start

    def recorded(x: int, k: int, device_chain: bool):
        g = start(x, k, device_chain)
        written.append((d._pos0 + k - 1 - CELL_SHIFT, kv.buf.committed // Cache.nbytes(1, kv.n_heads, kv.dim, kv.type)))
        return g

    monkeypatch.setattr(d, "_start", recorded)
    got, _ = _generate(sp, prompt, params)
    assert got == want and written and written[0][0] >= 64
    assert all(cell < held for cell, held in written), written


def test_livelock_guard(gpu, rng, tmp_path):
    """Drafts forced to be wrong with a fixed draft length: after GUARD rounds in a row that kept only
    their own first token, one plain step; the output is plain decoding's."""
    path, draft = _models(tmp_path, rng, "separate")
    prompt = [int(t) for t in rng.integers(0, V, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    want, _ = _generate(GpuForward(path, ctx=64, ub=8, kv="f16", gpu=gpu), prompt, params)
    sp = _open(gpu, path, draft, ctx=64, DRAFT="3", SPEC_ADAPT="0")
    sp.propose = lambda pos, drafts: [(want[pos - len(prompt)] + 1) % V for _ in drafts]
    got, _ = _generate(sp, prompt, params)
    assert got == want and sp.accepted == 0 and sp.rounds == 20 and sp.plain == 20 // (GUARD + 1)


def test_sampled_speculation_has_the_target_distribution(gpu, rng, tmp_path):
    """Rejection-sampled speculation at temperature 0.7 over 160 tokens: each generated token t_i,
    under the target's distribution p_i after the tokens before it (a plain forward teacher-forced
    on the output), has a uniform randomized PIT value: the p_i-mass of the tokens more likely than
    t_i plus U·p_i(t_i). Binned in 8, chi-square p-value > ALPHA (tokens drawn from the draft's
    distribution instead land on less likely tokens: PIT values near 1)."""
    path, draft = _models(tmp_path, rng, "separate")
    prompt = [int(t) for t in rng.integers(0, V, 10)]
    params = SamplingParams(temperature=0.7, max_tokens=160, ignore_eos=True, seed=int(rng.integers(1 << 31)))
    sp = _open(gpu, path, draft, ctx=192, DRAFT="4", SPEC_ADAPT="0")
    got, _ = _generate(sp, prompt, params)
    assert len(got) == 160 and 0 < sp.accepted < sp.drafted
    plain = GpuForward(path, ctx=192, ub=8, kv="f16", gpu=gpu)
    rows = plain.prefill_logits(prompt + got[:-1])[len(prompt) - 1:]
    from vkflash.engine.sampling import Sampler

    s = Sampler(params)
    u = np.random.default_rng()
    pit = []
    for i, (row, t) in enumerate(zip(rows, got)):
        p = s.probs(row, prompt + got[:i])
        order = np.argsort(-p, kind="stable")
        rank = int(np.flatnonzero(order == t)[0])
        pit.append(p[order[:rank]].sum() + u.random() * p[t])
    counts = np.histogram(pit, bins=8, range=(0, 1))[0].astype(float)
    pvalue, _ = chi2_pvalue(counts, np.full(8, 1 / 8))
    assert pvalue > ALPHA, f"PIT chi-square p = {pvalue:.2e}: {counts}"


def test_configuration_errors(gpu, rng, tmp_path):
    """MTP on a model without an MTP block, a draft file that is not an MTP file or of another
    geometry, a model that is not qwen4exp: one clear error each."""
    from dataclasses import replace

    from vkflash.engine.draft import _check_draft
    from vkflash.model.hparams import hparams_from_gguf

    path, draft = _models(tmp_path, rng, "separate")
    with pytest.raises(ConfigError, match="no MTP block"):
        _open(gpu, path, None)
    with pytest.raises(ConfigError, match="not a qwen4exp MTP file"):
        _open(gpu, path, path)
    hp, dhp = hparams_from_gguf(path), hparams_from_gguf(draft)
    with pytest.raises(ConfigError, match="does not fit the model: d = 256"):
        _check_draft(hp, replace(dhp, d=256), "x.gguf")
    other = make_model("qwen3next", "tiny", "F32", 1, tmp_path / "n.gguf")[0]
    with pytest.raises(ConfigError, match="needs a qwen4exp model"):
        _open(gpu, other, draft)


def test_bad_small_draft_is_one_config_error(gpu, rng, tmp_path):
    """MODEL_DRAFT_SMALL that is no GGUF, not an MTP file, of another geometry, no smaller than the
    draft, or missing: one ConfigError line naming the knob, from the speculator, the server's
    loader and `vkflash plan --mtp` alike (before any of it is uploaded)."""
    from dataclasses import replace

    from typer.testing import CliRunner

    from vkflash.cli import app
    from vkflash.engine.draft import _check_draft
    from vkflash.model.hparams import hparams_from_gguf
    from vkflash.server.backend import open_speculator

    path, draft = _models(tmp_path, rng, "separate-q8")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(rng.bytes(64))
    cases = [(junk, "MODEL_DRAFT_SMALL: .*junk.gguf: not a GGUF file"),
             (path, f"MODEL_DRAFT_SMALL {path.name}: not a qwen4exp MTP file"),
             (_models(tmp_path, rng, "separate")[1], "MODEL_DRAFT_SMALL .* is not smaller than the draft it replaces")]
    for small, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            _open(gpu, path, draft, small_path=small)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="MODEL_DRAFT_SMALL x.gguf does not fit the model: hc = 3"):
        _check_draft(hparams_from_gguf(path), replace(hparams_from_gguf(draft), hc=3), "x.gguf", "MODEL_DRAFT_SMALL")
    with pytest.raises(ConfigError, match="MODEL_DRAFT_SMALL '.*none.gguf': no such file"):
        open_speculator(path, str(draft), str(tmp_path / "none.gguf"), ctx=64, gpu=gpu)
    r = CliRunner().invoke(app, ["plan", str(path), "--ctx", "128", "--mtp", "--draft", str(draft), "--draft-small",
                                 str(path)])
    assert r.exit_code == 1 and r.output.strip().splitlines() == [
        f"error: MODEL_DRAFT_SMALL {path.name}: not a qwen4exp MTP file (arch qwen4exp, nextn_predict_layers 0)"]


def test_job_log_names_draft_and_verify_submissions(gpu, rng, tmp_path):
    """VKFLASH_JOB_LOG=1: the catch-up, draft-round and verify submissions are lines of their own."""
    import io
    from dataclasses import replace

    from vkflash.gpu import trace

    path, _ = _models(tmp_path, rng, "in-file")
    logged = gpu.with_options(replace(gpu.options, tracing=replace(gpu.options.tracing, job_log=True)))
    sp = _open(logged, path, None, ctx=64, DRAFT="3", SPEC_ADAPT="0")
    old, trace.OUT = trace.OUT, io.StringIO()
    try:
        _generate(sp, [int(t) for t in rng.integers(0, V, 9)], SamplingParams(temperature=0.0, max_tokens=6))
        log = trace.OUT.getvalue()
    finally:
        trace.OUT = old
    names = {line.split()[2] for line in log.splitlines() if line.startswith("job ")}
    assert {"mtp.catch.8", "mtp.round.1.3", "qwen4exp.verify.4"} <= names, names
