"""The row-group decode GEMV (shaders/gemv.comp) beyond test_matmul's sweep: every team width and
rows-per-team (both reductions: shuffle-xor within a subgroup, shared slots across subgroups), the
integer-dot variant on 8-bit activations (VKFLASH_GEMV_Q8) against its stated bound and llama.cpp's
rounding, the revert knob (VKFLASH_GEMV_TEAMS=0: mul_mat_vec.comp) agreeing with the new path, the
multi-column passes (VKFLASH_GEMV_COLS) equal to the per-column loop bit for bit, and the plan's
choices at the model's shapes."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from matmul_util import (make_problem, outside_untouched, q8_quantize, q8_tolerance, read_view, reference,
                         tolerance)
from vkflash.gpu.graph import Graph
from vkflash.gpu.ops import matmul as mm
from vkflash.gpu.ops.matmul import (GEMV_MAX_COLS, Q8_TYPES, TEAM_ROWS_WIDE, TEAM_STACK_ROWS, TEAM_WG, TEAMS_SLOWER,
                                    TYPES, GemvPlan, QWeight, gemv_cols, gemv_plan, matmul, q8_possible, team_smem,
                                    team_width)
from vkflash.gpu.ops.views import Rows
from vkflash.gpu.options import GpuOptions

pytestmark = pytest.mark.gpu

BLOCK256 = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)


def _k(q: Q, rng, lo: int = 256, hi: int = 2600) -> int:
    step = 256 if q in BLOCK256 else 32
    return step * int(rng.integers(max(1, lo // step), max(2, hi // step + 1)))


def _opts(gpu, **kw) -> GpuOptions:
    return replace(gpu.options, **kw)


def _run(gpu, p, opts: GpuOptions | None = None, plan: GemvPlan | None = None) -> tuple[np.ndarray, str]:
    g = Graph(gpu, "gemv", options=opts or gpu.options)
    matmul(g, p.w, p.xv, p.yv, plan=plan)
    g.run()
    return read_view(p.yv), g.ops[0].kernel.name


def _check(tag: str, got: np.ndarray, ref: np.ndarray, tol: np.ndarray) -> None:
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert np.isfinite(got).all(), f"{tag}: non-finite outputs (unwritten?)"
    assert (err <= tol).all(), (f"{tag}: worst (n,r)={worst} got {got[worst]!r} ref {ref[worst]!r} "
                                f"err {err[worst]:.3g} tol {tol[worst]:.3g} ({(err > tol).sum()} outside)")


@pytest.mark.parametrize("q", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F16], ids=lambda q: q.name)
def test_team_widths(gpu, rng, q):
    """Explicit plans: teams narrower and wider than a subgroup, 1, 2 or 4 rows per team, ragged rows."""
    for tpr, m in ((8, 2), (16, 1), (TEAM_WG, 2), (16, TEAM_ROWS_WIDE)):
        n_tok = int(rng.integers(1, GEMV_MAX_COLS + 1))
        p = make_problem(gpu, q, 2 * int(rng.integers(1, 40)) + 1, _k(q, rng), n_tok, rng)
        got, name = _run(gpu, p, plan=GemvPlan(tpr, m))
        ref, bound = reference(p)
        _check(f"{q.name} {p.w.n_out}x{p.w.k} n={n_tok} tpr={tpr} m={m}", got, ref,
               tolerance(bound, p.w.k, False))
        assert name == f"gemv_{q.name.lower()}"
        assert outside_untouched(p.yv), "writes outside the output view"


def _q8_gpu(gpu, q: Q, k: int):
    if not q8_possible(gpu.caps, q, k):
        pytest.skip(f"{gpu.caps.name}: no integer-dot GEMV for {q.name} (integer dot product / shared memory)")
    return gpu.with_options(_opts(gpu, gemv_q8=True))


@pytest.mark.parametrize("q", Q8_TYPES, ids=lambda q: q.name)
def test_gemv_q8(gpu, rng, q):
    """The integer-dot GEMV within Σ|W|·d/2 (+ f32) of float64, 1..8 columns, strided views, expert rows;
    the knob picks it for every Q8_TYPES weight."""
    k = _k(q, rng)
    g8 = _q8_gpu(gpu, q, k)
    for n_tok in (1, int(rng.integers(2, GEMV_MAX_COLS + 1))):
        p = make_problem(g8, q, 2 * int(rng.integers(1, 40)) + 1, k, n_tok, rng, expert=int(rng.integers(0, 2)))
        p.x *= rng.uniform(0.01, 10, size=(n_tok, k // 32, 1)).repeat(32, axis=2).reshape(n_tok, k).astype(np.float32)
        p = _reupload(g8, p)
        got, name = _run(g8, p)
        assert name == f"gemv_q8_{q.name.lower()}"
        ref, _ = reference(p)
        _check(f"{q.name} {p.w.n_out}x{k} n={n_tok} q8", got, ref, q8_tolerance(p))
        assert outside_untouched(p.yv)


def _reupload(gpu, p):
    """The problem with its (changed) x written to its view again."""
    buf = p.xv.buf
    for n in range(p.xv.n_rows):
        buf.write(p.x[n].astype(np.float32), 4 * (p.xv.off + n * p.xv.stride))
    return p


def test_q8_rounding(gpu, rng):
    """The activation blocks are llama.cpp's (d = amax/127, x_q = roundf(x·(1/d)), half away from zero):
    a Q8_0 weight of one-hot rows (d = 1) returns d·x_q of each element, bit for bit on drivers with
    correctly rounded division, otherwise d within an ulp and the codes within one step. Ties
    (x = (j + ½)·d) and zero blocks included."""
    k = 256
    g8 = _q8_gpu(gpu, Q.Q8_0, k)
    raw = np.zeros((k, k // 32, 34), np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    for r in range(k):
        raw[r, r // 32, 2 + r % 32] = 1
    w = QWeight(g8.upload(raw.reshape(-1), "onehot"), int(Q.Q8_0), k, k)
    x = rng.standard_normal((2, k)).astype(np.float32)
    x[0, :32] = 0  # a zero block
    amax = np.abs(x[1, 32:64]).max()
    x[1, 32:64] = np.sign(x[1, 32:64]) * np.round(np.abs(x[1, 32:64]) / amax * 127) * amax / 127  # near-exact codes
    x[1, 40] = np.float32(amax / 127 * 3.5)  # a tie (as far as f32 allows)
    xb, yb = g8.upload(x, "x"), g8.buffer(4 * 2 * k, "y")
    g = g8.graph("q8")
    matmul(g, w, Rows(xb, 2, k), Rows(yb, 2, k))
    g.run()
    got = yb.read(np.float32).reshape(2, k)
    q, d = q8_quantize(x)
    want = (d * q).astype(np.float32)
    if gpu.caps.device_type == "cpu":
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{bad.size} elements differ from ggml's rounding, first at {bad[0]}: " \
                              f"x {x.flat[bad[0]]!r} got {got.flat[bad[0]]!r} want {want.flat[bad[0]]!r}"
    else:  # an inexact amax/127 moves a whole block's d by an ulp: compare the codes, not the products
        codes = np.round(got / np.where(d > 0, d, 1))
        assert np.all(np.abs(got - want) <= d * 1.001) and np.all(np.abs(codes - q) <= 1)
        assert np.mean(codes == q) > 0.99, f"{np.mean(codes != q):.1%} of the codes differ from ggml's rounding"


@pytest.mark.parametrize("q", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_revert_knob_agrees(gpu, rng, q):
    """VKFLASH_GEMV_TEAMS=0 runs mul_mat_vec.comp, =1 gemv.comp (mul_mat_vec.comp still for the
    TEAMS_SLOWER types): both within the f32 bound of float64 (so within twice it of each other);
    VKFLASH_GEMV_Q8=1 within its own bound of both."""
    k, n_tok = _k(q, rng), int(rng.integers(1, GEMV_MAX_COLS + 1))
    p = make_problem(gpu, q, 2 * int(rng.integers(1, 40)) + 1, k, n_tok, rng)
    ref, bound = reference(p)
    tol = tolerance(bound, k, False)
    old, o_name = _run(gpu, p, GpuOptions.from_knobs(VKFLASH_GEMV_TEAMS="0", VKFLASH_GEMV_Q8="0"))
    new, n_name = _run(gpu, p, GpuOptions.from_knobs(VKFLASH_GEMV_TEAMS="1", VKFLASH_GEMV_Q8="0"))
    t = q.name.lower()
    assert (o_name, n_name) == (f"mul_mat_vec_{t}", f"mul_mat_vec_{t}" if q in TEAMS_SLOWER else f"gemv_{t}")
    _check("teams=0", old, ref, tol)
    _check("teams=1", new, ref, tol)
    assert np.all(np.abs(old - new) <= 2 * tol)
    if q8_possible(gpu.caps, q, k):
        q8, q_name = _run(gpu, p, GpuOptions.from_knobs(VKFLASH_GEMV_TEAMS="1", VKFLASH_GEMV_Q8="1"))
        assert q_name == f"gemv_q8_{t}"
        _check("q8=1", q8, ref, q8_tolerance(p))


def test_q8_skips_what_it_cannot_take(gpu, rng):
    """With the knob on, float and IQ4_XS weights keep their f32 GEMV (F16 mul_mat_vec.comp, the
    others the row groups)."""
    g8 = gpu.with_options(_opts(gpu, gemv_q8=True))
    for q in (Q.F16, Q.F32, Q.IQ4_XS):
        p = make_problem(g8, q, 5, 256, 1, rng)
        _, name = _run(g8, p)
        assert name == (f"mul_mat_vec_{q.name.lower()}" if q in TEAMS_SLOWER else f"gemv_{q.name.lower()}")


def test_plan_at_model_shapes(gpu):
    """On a GPU (caps faked): every lane busy at the dense and LM-head shapes, wide teams for the HC
    down projection's 320 rows of K = 10240, narrow ones for the HC mix's K = 320; fused and plain
    GEMVs of the same rows pick the same width (so they sum alike)."""
    caps = replace(gpu.caps, device_type="discrete")
    assert team_width(caps, 2560 // 32, 248320) == (8, 2)
    tpr, _ = team_width(caps, 10240 // 32, 320)
    assert tpr >= 64
    tpr, _ = team_width(caps, 320 // 32, 10240)
    assert tpr in (8, 16)
    for slices, rows in ((80, 12288), (40, 12288), (10, 10240), (320, 320)):
        tpr, nr = team_width(caps, slices, rows)
        assert tpr & (tpr - 1) == 0 and 8 <= tpr <= TEAM_WG and nr in (1, 2)
    on_gpu = SimpleNamespace(gpu=SimpleNamespace(caps=caps), options=gpu.options)
    assert gemv_plan(on_gpu, Q.Q6_K, 2560, 248320) == GemvPlan(8, 2)  # LM head, decode
    assert gemv_plan(on_gpu, Q.Q6_K, 2560, 248320, n_tok=7) == GemvPlan(8, TEAM_ROWS_WIDE)  # verify: same width
    per_column = SimpleNamespace(gpu=on_gpu.gpu, options=replace(gpu.options, gemv_cols=False))
    assert gemv_plan(per_column, Q.Q6_K, 2560, 248320, n_tok=7) == GemvPlan(8, 2)  # the revert knob
    assert gemv_plan(on_gpu, Q.Q4_K, 2560, 12288, n_tok=7).tpr == team_width(caps, 80, 12288)[0]
    assert gemv_plan(on_gpu, Q.Q4_K, 10240, 320, n_tok=7).m <= 2  # few rows: the teams stay many
    assert gemv_plan(on_gpu, Q.Q4_K, 2560, 12288, n_stack=2, n_tok=7).m == TEAM_STACK_ROWS // 2
    g = Graph(gpu, "plan")
    assert gemv_plan(g, Q.Q4_K, 2560, 12288, tpr=32, m=1) == GemvPlan(32, 1)
    with pytest.raises(ValueError, match="power of two"):
        gemv_plan(g, Q.Q4_K, 2560, 12288, tpr=24)


COLS_CPU = 2
"""Columns per pass the column tests let a CPU driver take (GEMV_COLS_CPU; LLVM's compile time grows with
them): n_tok 3, 5, 7 end on a ragged pass."""


def _both_cols(gpu, monkeypatch, p, plan: GemvPlan | None = None, **opts) -> tuple[np.ndarray, np.ndarray, str]:
    """The problem's outputs with VKFLASH_GEMV_COLS on and off, each into y poisoned anew, and the on-run's
    kernel and description."""
    monkeypatch.setattr(mm, "GEMV_COLS_CPU", COLS_CPU)
    out, desc = {}, {}
    for on in (True, False):
        p.yv.buf.fill(np.nan)
        g = Graph(gpu, "gemv", options=_opts(gpu, gemv_cols=on, **opts))
        matmul(g, p.w, p.xv, p.yv, plan=plan)
        g.run()
        out[on], desc[on] = read_view(p.yv), f"{g.ops[0].kernel.name} {g.ops[0].desc}"
        assert outside_untouched(p.yv), f"{desc[on]}: writes outside the output view"
    assert "cols=" in desc[True] and "cols=" not in desc[False], desc
    return out[True], out[False], desc[True]


@pytest.mark.parametrize("deq", [True, False], ids=["deq", "scaled"])
@pytest.mark.parametrize("q", TYPES, ids=lambda q: q.name)
def test_columns(gpu, rng, monkeypatch, q, deq):
    """VKFLASH_GEMV_COLS: the weights loaded once per pass of several columns give the per-column
    loop's outputs bit for bit, within the f32 bound of float64; ragged n_tok (2..8), n_out and K,
    every type on its default decode GEMV (gemv.comp; mul_mat_vec.comp for the TEAMS_SLOWER types),
    codes turned into weights once (VKFLASH_GEMV_DEQ=1) or scaled per column (0)."""
    n_tok = int(rng.integers(2, GEMV_MAX_COLS + 1))
    p = make_problem(gpu, q, 2 * int(rng.integers(1, 40)) + 1, _k(q, rng, hi=1200), n_tok, rng,
                     expert=int(rng.integers(0, 2)))
    on, off, desc = _both_cols(gpu, monkeypatch, p, gemv_deq=deq)
    assert desc.startswith("mul_mat_vec_" if q in TEAMS_SLOWER else "gemv_"), desc
    ref, bound = reference(p)
    _check(desc, on, ref, tolerance(bound, p.w.k, False))
    assert np.array_equal(on, off), f"{desc}: columns per pass differ from the per-column loop"


@pytest.mark.parametrize("deq", [True, False], ids=["deq", "scaled"])
@pytest.mark.parametrize("q", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda q: q.name)
def test_rows_per_team_keep_the_bits(gpu, rng, monkeypatch, q, deq):
    """A verify's several columns on 4-row teams (TEAM_ROWS_WIDE) give, bit for bit, the one-column
    decode on gemv_plan's 2-row teams of the same width, column by column (so MTP's greedy verify
    agrees with plain decoding); ragged n_out and K; both VKFLASH_GEMV_DEQ paths, each within the
    f32 bound of float64."""
    monkeypatch.setattr(mm, "GEMV_COLS_CPU", COLS_CPU)
    n_tok = int(rng.integers(2, GEMV_MAX_COLS + 1))
    p = make_problem(gpu, q, 2 * int(rng.integers(4, 40)) + 1, _k(q, rng, hi=1200), n_tok, rng)
    tpr = int(rng.choice([8, 16]))
    opts = _opts(gpu, gemv_deq=deq)
    wide, _ = _run(gpu, p, opts, plan=GemvPlan(tpr, TEAM_ROWS_WIDE))
    ref, bound = reference(p)
    _check(f"{q.name} deq={deq}", wide, ref, tolerance(bound, p.w.k, False))
    for n in range(n_tok):
        one = make_problem(gpu, q, p.w.n_out, p.w.k, 1, rng)
        one = _reupload(gpu, replace(one, w=p.w, x=p.x[n:n + 1].copy()))
        got, _ = _run(gpu, one, opts, plan=GemvPlan(tpr, 2))
        assert np.array_equal(got[0], wide[n]), f"{q.name} tpr={tpr}: column {n} of {n_tok} differs from decode"


@pytest.mark.parametrize("q", Q8_TYPES, ids=lambda q: q.name)
def test_columns_q8(gpu, rng, monkeypatch, q):
    """The integer-dot GEMV quantizes each column of a pass into its own shared blocks: bit for bit the
    per-column loop, within the q8 bound of float64 per column (blocks scaled apart per column); one row
    per team (compile time), teams within and across subgroups."""
    k = _k(q, rng, hi=1200)
    g8 = _q8_gpu(gpu, q, k)
    n_tok = int(rng.integers(2, GEMV_MAX_COLS + 1))
    p = make_problem(g8, q, 2 * int(rng.integers(1, 40)) + 1, k, n_tok, rng)
    p.x *= rng.uniform(0.01, 10, size=(n_tok, k // 32, 1)).repeat(32, axis=2).reshape(n_tok, k).astype(np.float32)
    p = _reupload(g8, p)
    plan = GemvPlan(int(rng.choice([8, 16, TEAM_WG])), 1, True)
    on, off, desc = _both_cols(g8, monkeypatch, p, plan, gemv_q8=True)
    assert desc.startswith(f"gemv_q8_{q.name.lower()}"), desc
    ref, _ = reference(p)
    _check(desc, on, ref, q8_tolerance(p))
    assert np.array_equal(on, off), f"{desc}: columns per pass differ from the per-column loop"


def test_columns_plan(gpu):
    """gemv_cols: all columns in one pass where the shared memory holds them, else the fewest passes with
    the columns spread evenly (q8 rows of K = 12288 on 48 KiB: 3 + 3 + 2 of 8); 1 with the knob off;
    at most GEMV_COLS_CPU on CPU drivers."""
    caps = replace(gpu.caps, device_type="discrete", shared_memory=48 << 10, subgroup_min=32)

    def g(on: bool, c=caps):
        return SimpleNamespace(options=replace(gpu.options, gemv_cols=on), gpu=SimpleNamespace(caps=c))

    assert [gemv_cols(g(True), n, lambda c: team_smem(caps, 2560, 2, False, c)) for n in (1, 7, 8)] == [1, 7, 8]
    assert gemv_cols(g(True), 8, lambda c: team_smem(caps, 2560, 2, True, c)) == 8
    assert [gemv_cols(g(True), n, lambda c: team_smem(caps, 12288, 2, True, c)) for n in (2, 3, 4, 7, 8)] == \
        [2, 3, 2, 3, 3]
    assert gemv_cols(g(False), 8, lambda c: 0) == 1
    cpu = replace(caps, device_type="cpu")
    assert gemv_cols(g(True, cpu), 8, lambda c: 0) == mm.GEMV_COLS_CPU
