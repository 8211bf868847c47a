"""Matmul benchmarks for `vkflash bench kernels`: GEMV weight bandwidth and GEMM TFLOP/s.

Each measurement records one graph of many dispatches that rotate among several weight buffers
(at least 3, and enough to exceed any last-level cache several times over, so no rotation re-reads
a cached weight) and times many replays by wall clock (kernels.timed). Rows are
dict(name, shape, seconds, <unit>) with seconds per call and unit "GB/s" (weight bytes) or "TFLOP/s".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.bench.kernels import timed
from vkflash.formats.quant_blocks import row_bytes
from vkflash.formats.quants import random_blocks
from vkflash.gpu.context import Gpu
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.matmul import (CM_TILES, TEAM_TPR_MIN, TEAM_WG, TEAMS_SLOWER, CmTile, GemvPlan, HcMixGemv,
                                    QWeight, cm_shape, cm_tile, coopmat_possible, matmul, q8_possible, tiny_tokens)
from vkflash.gpu.ops.views import Rows

GEMV_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.IQ4_XS, Q.F16, Q.BF16)
DENSE = (2560, 12288)  # Flash-Next dense projection {in, out}: 9–18 MB at 4–6 bits
LM_HEAD = (2560, 248320)  # the Q6_K LM head
HC = 4  # Flash-Next hyper-connection streams
HC_DOWN = (Q.Q4_K, HC * 2560, 320)  # ℓ_pre = W_dn X: K = hc·d, lr = 320 rows
HC_MIX = (Q.Q5_0, 320, HC * 2560)  # W_up {lr, hc·d} (K = 320: no K-quant) in the fused HC mix GEMV
GOALS = {"dense": 0.6, "head": 0.75, "hc": 0.4}
"""The issue's goals on the H200, as fractions of the measured copy bandwidth."""
ROTATE_BYTES = 400 << 20  # weight bytes one rotation touches at least (H200 L2 is 50 MB)
CALLS = 48  # dispatches per recorded graph
GEMMS = ((Q.F16, 4096, 4096, 4096), (Q.Q4_K, 2560, 12288, 2048))
"""Prefill GEMMs (type, K, n_out, n_tok): f16 4096³, and a Q4_K dense Flash-Next projection over a
2048-token ubatch (the issue's goals: ≥ 150 and ≥ 100 TFLOP/s on the H200)."""
GEMMS_QUICK = ((Q.F16, 128, 128, 128), (Q.Q4_K, 256, 192, 80))
SPLIT_GEMMS = tuple((q, HC * 2560, 320, n) for n in (512, 2048) for q in (Q.Q4_K, Q.Q5_0)) + ((Q.Q4_K, 6144, 2560, 512),)
"""Prefill GEMMs with few output tiles (type, K, n_out, n_tok): the HC down projection ℓ_pre = W_dn X
(K = hc·d, lr = 320 rows; Q4_K attention mixers, Q5_0 FFN mixers) at 512 and 2048 tokens, and
attn_out (K = H·Dh = 6144 → d) at 512, for split-K (VKFLASH_MM_SPLITK)."""
SPLIT_GEMMS_QUICK = ((Q.Q4_K, 2048, 64, 64),)
INJECT = (HC * 2560, HC)  # W_inj {hc·d, hc} in F32: the transposed GEMV of prefill
COLS_SHAPES = ((Q.Q6_K, *LM_HEAD), (Q.Q4_K, *DENSE))
"""The multi-column GEMV rows (MTP verify: n_tok = COLS_TOKENS[1]): the Q6_K LM head and a dense Q4_K projection."""
COLS_SHAPES_QUICK = ((Q.Q6_K, 256, 1024), (Q.Q4_K, 256, 512))
COLS_TOKENS = (1, 7)  # a decode step, and the verify step of a 6-token draft


def _weights(gpu: Gpu, q: Q, k: int, n_out: int, n_bufs: int, rng: np.random.Generator) -> list[QWeight]:
    """n_bufs buffers holding the same random valid weight (content does not change the speed)."""
    raw = random_blocks(q, k * n_out, rng)
    return [QWeight(gpu.upload(raw, f"bench.w{i}"), int(q), k, n_out) for i in range(n_bufs)]


def _rotation(nbytes: int, quick: bool) -> int:
    return 3 if quick else max(3, min(32, -(-ROTATE_BYTES // nbytes)))


def gemv_paths(gpu: Gpu, q: Q, k: int) -> list[tuple[str, Gpu]]:
    """The decode GEMV paths to compare for weight type q and rows of k: `legacy` (mul_mat_vec.comp,
    VKFLASH_GEMV_TEAMS=0), `teams` (gemv.comp on f32 x), `q8` (gemv.comp on 8-bit x and integer dots,
    VKFLASH_GEMV_Q8=1, where possible; not for the TEAMS_SLOWER types, whose f32 GEMV stays on
    mul_mat_vec.comp); the one the Gpu's options pick is marked (default)."""
    o = gpu.options
    paths = [("legacy", replace(o, gemv_teams=False, gemv_q8=False))]
    if q not in TEAMS_SLOWER:
        paths.append(("teams", replace(o, gemv_teams=True, gemv_q8=False)))
    if q8_possible(gpu.caps, q, k):
        paths.append(("q8", replace(o, gemv_teams=True, gemv_q8=True)))
    picked = "legacy" if not o.gemv_teams else "q8" if o.gemv_q8 and q8_possible(gpu.caps, q, k) else \
        "legacy" if q in TEAMS_SLOWER else "teams"
    return [(f"{label} (default)" if label == picked else label, gpu.with_options(opts)) for label, opts in paths]


def _gemv_row(gpu: Gpu, label: str, ws: list[QWeight], n_tok: int, goal: str, quick: bool,
              rng: np.random.Generator, plan: GemvPlan | None = None, serial: bool = False) -> dict:
    """GB/s of one GEMV path over the weights ws (one matrix in rotated buffers): CALLS dispatches
    into distinct outputs (no barriers: throughput) or, serial, one output (a barrier between calls,
    as in a decode step)."""
    q, k, n_out = Q(ws[0].qtype), ws[0].k, ws[0].n_out
    nbytes = ws[0].nbytes
    x = gpu.upload(rng.standard_normal(n_tok * k, dtype=np.float32), "bench.x")
    calls = len(ws) if quick else max(CALLS, len(ws))
    g = gpu.graph(f"bench.gemv.{q.name}")
    y0 = gpu.buffer(4 * n_tok * n_out, "bench.y")
    desc = ""
    for i in range(calls):
        y = y0 if serial else gpu.buffer(4 * n_tok * n_out, f"bench.y{i}")
        matmul(g, ws[i % len(ws)], Rows(x, n_tok, k), Rows(y, n_tok, n_out), name=f"gemv{i}", plan=plan)
        desc = g.ops[-1].desc
    s = timed(g, 2 if quick else 20) / calls
    return {"name": f"gemv {q.name.lower()} {label}".strip(), "shape": f"{k}x{n_out} n={n_tok}{_plan_of(desc)}"
            + (" serial" if serial else ""), "seconds": s, "GB/s": nbytes / s / 1e9, "goal": GOALS.get(goal)}


def _plan_of(desc: str) -> str:
    """What a dispatch description adds after "type KxN n=T" (the row-group plan), with a leading space."""
    parts = desc.split(" ", 3)
    return f" {parts[3]}" if len(parts) == 4 else ""


def _hc_mix_row(gpu: Gpu, label: str, ws: list[QWeight], quick: bool, rng: np.random.Generator) -> dict:
    """GB/s of the fused HC mix GEMV (hc_pre, W_up, hc_mix; Fusion.HC_MIX), serial as in decode."""
    q, lr, n_out = Q(ws[0].qtype), ws[0].k, ws[0].n_out
    d = n_out // HC
    nbytes = ws[0].nbytes
    ell = Rows(gpu.upload(rng.standard_normal(lr, dtype=np.float32), "bench.ell"), 1, lr)
    X = Rows(gpu.upload(rng.standard_normal(n_out, dtype=np.float32), "bench.X"), 1, n_out)
    u = Rows(gpu.buffer(4 * d, "bench.u"), 1, d)
    calls = len(ws) if quick else max(CALLS, len(ws))
    g = gpu.graph("bench.hc_mix")
    for i in range(calls):
        g.add(HcMixGemv(ws[i % len(ws)], ell, X, u, HC, f"hc_mix{i}"))
    desc = g.ops[-1].desc
    s = timed(g, 2 if quick else 20) / calls
    return {"name": f"gemv hc_mix {q.name.lower()} {label}".strip(),
            "shape": f"{lr}x{n_out} n=1{_plan_of(desc)} serial",
            "seconds": s, "GB/s": nbytes / s / 1e9, "goal": GOALS["hc"]}


def gemv_bandwidth(gpu: Gpu, shapes: Iterable[tuple[Q, int, int]] | None = None, n_tok: int = 1,
                   quick: bool = False, paths: bool = True, sweep: bool = False) -> list[dict]:
    """Weight bytes per second of the decode GEMV for each (type, in, out), on every path of
    gemv_paths (paths=False: the options' own); rows carry the issue's goal (÷ copy).

    Defaults: every GEMV_TYPES at the dense Flash-Next shape, the Q6_K LM head, the HC down
    projection and the fused HC mix GEMV (both serial, as in a decode step). sweep: also every team
    width × rows per team of the row-group GEMVs (f32 and q8) at the dense Q4_K shape and the Q6_K LM
    head (for tuning gemv_plan). Each matrix is uploaded once and timed on every path.
    """
    rng = np.random.default_rng()
    rows = []
    default = shapes is None
    if shapes is None:
        shapes = [(q, 256, 512) if quick else (q, *DENSE) for q in GEMV_TYPES]
        shapes.append((Q.Q6_K, 256, 1024) if quick else (Q.Q6_K, *LM_HEAD))
    shapes = list(shapes)
    swept = (((Q.Q4_K, 256, 512), (Q.Q6_K, 256, 1024)) if quick else ((Q.Q4_K, *DENSE), (Q.Q6_K, *LM_HEAD))) \
        if sweep else ()
    widths = [TEAM_TPR_MIN << i for i in range((TEAM_WG // TEAM_TPR_MIN).bit_length())]

    def weights(q: Q, k: int, n_out: int) -> list[QWeight]:  # one matrix per shape, shared by its rows
        return _weights(gpu, q, k, n_out, _rotation(n_out * row_bytes(q, k), quick), rng)

    for i, (q, k, n_out) in enumerate(shapes):
        goal = "head" if default and i == len(GEMV_TYPES) else "dense"
        ws = weights(q, k, n_out)
        for label, g in (gemv_paths(gpu, q, k) if paths else [("", gpu)]):
            rows.append(_gemv_row(g, label, ws, n_tok, goal, quick, rng))
        if (q, k, n_out) in swept:  # the sweep on the same weights
            for q8 in (False, True) if q8_possible(gpu.caps, q, k) else (False,):
                for tpr in (widths[0], widths[-1]) if quick else widths:
                    for m in (1, 2) if quick else (1, 2, 4):
                        plan = GemvPlan(tpr, m, q8)
                        rows.append(_gemv_row(gpu, f"sweep {plan}", ws, n_tok, goal, quick, rng, plan))
        del ws
    for q, k, n_out in swept:
        if (q, k, n_out) not in shapes:
            ws = weights(q, k, n_out)
            for q8 in (False, True) if q8_possible(gpu.caps, q, k) else (False,):
                for tpr in (widths[0], widths[-1]) if quick else widths:
                    for m in (1, 2) if quick else (1, 2, 4):
                        plan = GemvPlan(tpr, m, q8)
                        rows.append(_gemv_row(gpu, f"sweep {plan}", ws, n_tok, "dense", quick, rng, plan))
    if default:
        q, k, n_out = (Q.Q4_K, 512, 64) if quick else HC_DOWN
        ws = weights(q, k, n_out)
        for label, g in (gemv_paths(gpu, q, k) if paths else [("", gpu)]):
            rows.append(_gemv_row(g, label, ws, 1, "hc", quick, rng, serial=True))
        q, k, n_out = (Q.Q5_0, 64, HC * 64) if quick else HC_MIX
        ws = weights(q, k, n_out)
        for label, g in (gemv_paths(gpu, q, k) if paths else [("", gpu)]):
            rows.append(_hc_mix_row(g, label, ws, quick, rng))
    return rows


def gemv_columns(gpu: Gpu, shapes: Iterable[tuple[Q, int, int]] | None = None, quick: bool = False) -> list[dict]:
    """The decode GEMV at n_tok 1 and 7 (a verify step) for each (type, in, out) (default COLS_SHAPES), with
    each weight slice loaded once for all columns (`cols`, VKFLASH_GEMV_COLS=1) and once per column
    (`per-column`); the option the Gpu has is marked (default). The n = 7 rows' shapes say their time
    as a multiple of the same path's n = 1 time (7.00× would be no saving at all)."""
    rng = np.random.default_rng()
    rows = []
    for q, k, n_out in shapes or (COLS_SHAPES_QUICK if quick else COLS_SHAPES):
        ws = _weights(gpu, q, k, n_out, _rotation(n_out * row_bytes(q, k), quick), rng)
        for label, on in (("cols", True), ("per-column", False)):
            g = gpu.with_options(replace(gpu.options, gemv_cols=on))
            tag = f"{label} (default)" if on == gpu.options.gemv_cols else label
            one = _gemv_row(g, tag, ws, COLS_TOKENS[0], "", quick, rng)
            many = _gemv_row(g, tag, ws, COLS_TOKENS[1], "", quick, rng)
            many["shape"] += f" {many['seconds'] / one['seconds']:.2f}x n={COLS_TOKENS[0]}"
            rows += [one, many]
        del ws
    return rows


def _gemm_operands(gpu: Gpu, q: Q, k: int, n_out: int, n_tok: int, quick: bool, rng: np.random.Generator,
                   n_y: int) -> tuple[int, list, Buffer, list[Buffer]]:
    """A GEMM bench's weight bytes, rotated weight copies (beyond the caches), random x and n_y outputs."""
    nbytes = n_out * row_bytes(q, k)
    ws = _weights(gpu, q, k, n_out, _rotation(nbytes, quick), rng)
    x = gpu.upload(rng.standard_normal(n_tok * k, dtype=np.float32), "bench.x")
    return nbytes, ws, x, [gpu.buffer(4 * n_tok * n_out, f"bench.y{i}") for i in range(n_y)]


def gemm_tflops(gpu: Gpu, shapes: Iterable[tuple[Q, int, int, int]] | None = None, quick: bool = False,
                tiles: bool = True) -> list[dict]:
    """TFLOP/s of the prefill GEMM for each (type, K, n_out, n_tok) (default GEMMS): the scalar f32
    GEMM, and where the device offers coopmat the coopmat GEMM at the tile cm_tile picks and (tiles)
    at every other tile that fits (named with the tile; the default one is marked)."""
    rng = np.random.default_rng()
    rows = []
    for q, k, n_out, n_tok in shapes or (GEMMS_QUICK if quick else GEMMS):
        nbytes, ws, x, ys = _gemm_operands(gpu, q, k, n_out, n_tok, quick, rng, 3)
        variants: list[tuple[str, CmTile | None]] = [("scalar", None)]
        shape = cm_shape(gpu.caps)
        best = cm_tile(gpu.caps, n_out, n_tok)
        if coopmat_possible(gpu.caps, q) and best is not None:
            others = [t for t in CM_TILES if t != best and t.valid(shape) and t.smem(shape.n) <= gpu.caps.shared_memory]
            variants += [(f"coopmat {best} (default)", best)] + ([(f"coopmat {t}", t) for t in others] if tiles else [])
        calls = max(3 if quick else 12, len(ws))
        for label, tile in variants:
            g = gpu.graph("bench.gemm")
            for i in range(calls):
                matmul(g, ws[i % len(ws)], Rows(x, n_tok, k), Rows(ys[i % 3], n_tok, n_out), name=f"gemm{i}",
                       coopmat=tile is not None, tile=tile)
            s = timed(g, 1 if quick else 5) / calls
            rows.append({"name": f"gemm {q.name.lower()} {label}", "shape": f"{k}x{n_out} n={n_tok}", "seconds": s,
                         "TFLOP/s": 2.0 * k * n_out * n_tok / s / 1e12, "weight_bytes": nbytes})
    return rows


def split_gemm_tflops(gpu: Gpu, shapes: Iterable[tuple[Q, int, int, int]] | None = None, quick: bool = False,
                      splits: Iterable[int] = ()) -> list[dict]:
    """TFLOP/s of the prefill GEMMs with few output tiles (default SPLIT_GEMMS), coopmat where the device
    offers it: unsplit, and as split_k chooses with VKFLASH_MM_SPLITK=1 (the path the options pick is
    marked (default)); `splits`: also about that many K chunks each (tuning split_k). The calls write
    one output, so each waits for the one before, as in a prefill step (independent calls would
    overlap and fill the GPU, which is what a lone small grid cannot)."""
    rng = np.random.default_rng()
    rows = []
    for q, k, n_out, n_tok in shapes or (SPLIT_GEMMS_QUICK if quick else SPLIT_GEMMS):
        nbytes, ws, x, (y,) = _gemm_operands(gpu, q, k, n_out, n_tok, quick, rng, 1)
        cm = coopmat_possible(gpu.caps, q)
        picked = "split-K" if gpu.options.mm_splitk else "unsplit"
        variants: list[tuple[str, Gpu, int | None]] = [
            ("unsplit", gpu, 1), ("split-K", gpu.with_options(replace(gpu.options, mm_splitk=True)), None)]
        variants += [(f"split {s}", gpu, s) for s in splits]
        calls = max(3 if quick else 12, len(ws))
        for label, gg, split in variants:
            g = gg.graph("bench.gemm_split")
            for i in range(calls):
                matmul(g, ws[i % len(ws)], Rows(x, n_tok, k), Rows(y, n_tok, n_out), name=f"gemm{i}",
                       coopmat=cm, split=split)
            desc = g.ops[0].desc.split(" ", 3)[3] if len(g.ops[0].desc.split(" ", 3)) == 4 else ""
            s = timed(g, 1 if quick else 5) / calls
            mark = " (default)" if label == picked else ""
            rows.append({"name": f"gemm {q.name.lower()} {label}{mark}",
                         "shape": f"{k}x{n_out} n={n_tok} {desc} serial",
                         "seconds": s, "TFLOP/s": 2.0 * k * n_out * n_tok / s / 1e12})
    return rows


def inject_bandwidth(gpu: Gpu, quick: bool = False) -> list[dict]:
    """GB/s (activation bytes read) of the transposed GEMV of prefill, the HC inject ι = W_inj X (F32
    {hc·d, hc}) at 512 and 2048 tokens: 8 tokens per workgroup (VKFLASH_MM_SPLITK=0) vs tiny_tokens';
    serial calls into one output, as split_gemm_tflops."""
    rng = np.random.default_rng()
    k, n_out = (512, HC) if quick else INJECT
    w = QWeight(gpu.upload(rng.standard_normal(k * n_out, dtype=np.float32), "bench.w_inj"), int(Q.F32), k, n_out)
    rows = []
    for n_tok in (64,) if quick else (512, 2048):
        x = gpu.upload(rng.standard_normal(n_tok * k, dtype=np.float32), "bench.x")
        y = gpu.buffer(4 * n_tok * n_out, "bench.y")
        for on in (False, True):
            g = gpu.with_options(replace(gpu.options, mm_splitk=on)).graph("bench.inject")
            calls = 3 if quick else 24
            for i in range(calls):
                matmul(g, w, Rows(x, n_tok, k), Rows(y, n_tok, n_out), name=f"inject{i}")
            s = timed(g, 1 if quick else 10) / calls
            mark = " (default)" if on == gpu.options.mm_splitk else ""
            rows.append({"name": f"gemv inject f32 {tiny_tokens(n_tok, on)} tok/wg{mark}",
                         "shape": f"{k}x{n_out} n={n_tok} serial", "seconds": s, "GB/s": 4 * n_tok * k / s / 1e9})
    return rows
