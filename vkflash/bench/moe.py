"""MoE benchmarks for `vkflash bench kernels`: routed-expert GEMM TFLOP/s (prefill), the coopmat expert
passes at the prefill regimes with the old and the wide-load weight fetch (`moe_pass`), and routed
decode GEMV weight GB/s, at Flash-Next shapes (d 2560 ↔ F 640, E 512, top-10; gate/up Q4_K, down Q5_0)
and Qwen3-Next's (d 2048 ↔ F 512).

One routed-expert stack set is ~1.5 GB (far beyond any last-level cache), and every call in a
recorded graph gets its own routing (ids rotate among several buffers), so no call re-reads the
experts the previous one left in cache. Rows are dict(name, shape, seconds, <unit>) like
vkflash/bench/matmul.py, with seconds per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.bench.kernels import timed
from vkflash.bench.model import stamped
from vkflash.formats.quants import random_blocks
from vkflash.gpu.context import Gpu
from vkflash.gpu.graph import Graph
from vkflash.gpu.ops.matmul import coopmat_possible, q8_possible
from vkflash.gpu.ops.moe import (DECODE_MAX_T, HALF_TYPES, ExpertStack, MoEPlan, RoutedExperts, cm_expert_tile,
                                 moe_routed, plan_words, split_gate_up, tile_width)
from vkflash.gpu.ops.views import Rows


@dataclass(frozen=True)
class Shape:
    """Routed-expert geometry of one benchmark."""

    d: int
    F: int
    E: int
    k: int
    q_gu: Q = Q.Q4_K
    q_down: Q = Q.Q5_0

    def __str__(self) -> str:
        return f"{self.d}<->{self.F} E={self.E} k={self.k} {self.q_gu.name}/{self.q_down.name}"


FLASH_NEXT = Shape(2560, 640, 512, 10)
QWEN3_NEXT = Shape(2048, 512, 512, 10)  # qwen3next shape-8L's routed experts
QUICK = Shape(256, 256, 16, 4)  # lavapipe: K-quant rows need d % 256 == 0
ROTATE = 4  # routings rotated among the calls of one graph


def _experts(gpu: Gpu, s: Shape, rng: np.random.Generator) -> RoutedExperts:
    """Random valid gate/up {d, F, E} and down {F, d, E} stacks (content does not change the speed)."""
    def stack(q: Q, k: int, n_out: int, name: str) -> ExpertStack:
        return ExpertStack(gpu.upload(random_blocks(q, s.E * n_out * k, rng), name), int(q), k, n_out, s.E)
    return RoutedExperts(stack(s.q_gu, s.d, s.F, "bench.gate"), stack(s.q_gu, s.d, s.F, "bench.up"),
                         stack(s.q_down, s.F, s.d, "bench.down"))


def _routings(gpu: Gpu, T: int, s: Shape, rng: np.random.Generator) -> list[tuple[Rows, Rows]]:
    """ROTATE (ids, weights) pairs: k distinct uniform experts per token (≈ T·k/E rows per expert)."""
    out = []
    for i in range(ROTATE):
        ids = np.argsort(rng.random((T, s.E)), axis=1)[:, :s.k].astype(np.int32)
        w = np.full((T, s.k), 1.0 / s.k, np.float32)
        out.append((Rows(gpu.upload(ids, f"bench.ids{i}"), T, s.k), Rows(gpu.upload(w, f"bench.w{i}"), T, s.k)))
    return out


def _fused_experts(gpu: Gpu, s: Shape, rng: np.random.Generator) -> RoutedExperts:
    """Random gate/up as one fused {d, 2F, E} stack (as the models store it) and down {F, d, E}."""
    gu = gpu.upload(random_blocks(s.q_gu, s.E * 2 * s.F * s.d, rng), "bench.gate_up")
    down = ExpertStack(gpu.upload(random_blocks(s.q_down, s.E * s.d * s.F, rng), "bench.down"), int(s.q_down), s.F,
                       s.d, s.E)
    return RoutedExperts(*split_gate_up(gu, int(s.q_gu), s.d, s.F, s.E), down)


def _routed_graph(gpu: Gpu, name: str, s: Shape, T: int, calls: int, compact: bool | None,
                  rng: np.random.Generator, coopmat: bool | None = None, ex: RoutedExperts | None = None,
                  fast: bool | None = None, half: bool | None = None) -> tuple[Graph, RoutedExperts]:
    """A graph of `calls` routed-expert passes over one stack set (`ex`, or new random experts), each
    with the next rotated routing (fast, half: the coopmat fetch, default the options')."""
    ex = ex or _experts(gpu, s, rng)
    x = Rows(gpu.upload(rng.standard_normal((T, s.d), dtype=np.float32), "bench.x"), T, s.d)
    h = Rows(gpu.buffer(4 * T * s.k * s.F, "bench.h"), T * s.k, s.F)
    ys = Rows(gpu.buffer(4 * T * s.k * s.d, "bench.ys"), T * s.k, s.d)
    plan = None
    if T > DECODE_MAX_T:
        bn = tile_width(T, s.k, s.E)
        plan = MoEPlan(gpu.buffer(4 * plan_words(T, s.k, s.E, bn), "bench.plan"), T, s.k, s.E, bn)
    g = gpu.graph(name)
    routings = _routings(gpu, T, s, rng)
    for i in range(calls):
        ids, w = routings[i % ROTATE]
        moe_routed(g, x, ids, w, ex, ys, h, plan=plan, compact=compact, name=f"moe{i}", coopmat=coopmat, fast=fast,
                   half=half)
    return g, ex


FETCHES = (("old fetch", False, False), ("wide-load fetch", True, False), ("wide-load fetch, halves", True, True))
"""The expert GEMM's weight fetches `moe_pass` times: (label, VKFLASH_MMID_FAST_FETCH, VKFLASH_MMID_HALF)."""
PASS_TOKENS = (512, 2048)  # prefill ubatches: ~10 and ~40 rows per expert at E 512, k 10


def _op_seconds(g: Graph, reps: int) -> dict[str, float]:
    """GPU seconds per replay of each op of g, by name (timestamps around every op), after warm-up."""
    out: dict[str, float] = {}

    def run() -> None:
        timed(g, 1)
        period = g.gpu.caps.timestamp_period_ns
        for _ in range(reps):
            g.run()
            for sub in g.submissions:
                ts = sub.seq.get_timestamps()
                for op, slot in zip(sub.ops, sub.op_slots):
                    out[op.name] = out.get(op.name, 0.0) + (ts[slot + 1] - ts[slot]) * period / 1e9 / reps
    stamped(g, run)
    return out


def expert_pass_rates(gpu: Gpu, quick: bool = False) -> list[dict]:
    """The coopmat expert passes (fused gate/up, down) at the prefill regimes, T 512 and 2048 tokens at
    the Qwen3-Next and Flash-Next expert shapes (quick: QUICK, T 64), with the old weight fetch, the
    wide-load one (VKFLASH_MMID_FAST_FETCH) on whole and on half groups (VKFLASH_MMID_HALF): GPU seconds
    per pass (timestamps), TFLOP/s, and in the shape column the weight GB/s (the bytes of the distinct
    experts the pass reads, each once)."""
    caps = gpu.caps
    shapes = (QUICK,) if quick else (QWEN3_NEXT, FLASH_NEXT)
    if not all(coopmat_possible(caps, q) and all(cm_expert_tile(caps, tile_width(T, s.k, s.E), nb) is not None
                                                 for T in ((64,) if quick else PASS_TOKENS) for nb in (1, 2))
               for s in shapes for q in (s.q_gu, s.q_down)):
        return []
    rng = np.random.default_rng()
    calls, reps = (2, 1) if quick else (8, 5)
    rows = []
    for s in shapes:
        ex = _fused_experts(gpu, s, rng)
        for T in (64,) if quick else PASS_TOKENS:
            bn = tile_width(T, s.k, s.E)
            live = min(s.E, T * s.k)
            for label_f, fast, half in FETCHES:
                g, _ = _routed_graph(gpu, "bench.moe_pass", s, T, calls, True, rng, coopmat=True, ex=ex, fast=fast,
                                     half=half)
                sec = _op_seconds(g, reps)
                for label, nb, w in (("gate_up", 2, ex.gate), ("down", 1, ex.down)):
                    if half and Q(w.qtype) not in HALF_TYPES:
                        continue  # the whole-group kernel of the row before
                    t = sum(v for k, v in sec.items() if k.endswith(f".{label}")) / calls
                    gbs = nb * live * w.expert_bytes / t / 1e9
                    rows.append({"name": f"moe {label} {label_f}",
                                 "shape": f"{s} T={T} bn={bn} {gbs:.0f} GB/s", "seconds": t,
                                 "TFLOP/s": 2.0 * nb * T * s.k * w.k * w.n_out / t / 1e12})
        for b in {ex.gate.buf, ex.down.buf}:
            gpu.free(b)
    return rows


def expert_gemm_tflops(gpu: Gpu, T: int | None = None, shape: Shape | None = None, quick: bool = False) -> list[dict]:
    """TFLOP/s of the routed experts for prefill (prepass + gate + up + down GEMMs), compact and plain
    grids, on the scalar expert GEMM and, where the device offers coopmat, the coopmat one.

    Default: T = 2048 tokens at Flash-Next shapes (≈ 40 rows per expert, 48-wide tiles); llama.cpp's
    routed-expert rate there is 8.7–10.1 TFLOP/s (the issue's goal: twice that).
    """
    s = shape or (QUICK if quick else FLASH_NEXT)
    T = T or (64 if quick else 2048)
    rng = np.random.default_rng()
    calls = 2 if quick else 8
    bn = tile_width(T, s.k, s.E)
    paths = ["scalar"]
    if all(coopmat_possible(gpu.caps, q) for q in (s.q_gu, s.q_down)) and all(
            cm_expert_tile(gpu.caps, bn, nb) is not None for nb in (1, 2)):
        paths.append("coopmat")
    rows = []
    for path in paths:
        for compact in (True, False):
            g, _ = _routed_graph(gpu, "bench.moe_gemm", s, T, calls, compact, rng, coopmat=path == "coopmat")
            sec = timed(g, 1 if quick else 5) / calls
            flops = 2.0 * T * s.k * 3 * s.d * s.F
            rows.append({"name": f"moe gemm {'compact' if compact else 'plain'} {path}",
                         "shape": f"{s} T={T} bn={bn}", "seconds": sec, "TFLOP/s": flops / sec / 1e12})
    return rows


GEMV_GOAL = 0.5  # the goal for the routed decode GEMV on the H200 (÷ copy, on the bytes read)


def expert_gemv_bandwidth(gpu: Gpu, T: int = 1, shape: Shape | None = None, quick: bool = False,
                          paths: bool = True) -> list[dict]:
    """Weight GB/s of the routed decode GEMV (gate + up + down of the distinct selected experts; one
    routed layer per call, its passes serial as in decode) on each path of bench.matmul.gemv_paths
    (the integer-dot one where gate/up and down types both have it); paths=False: the options' own."""
    from vkflash.bench.matmul import gemv_paths

    s = shape or (QUICK if quick else FLASH_NEXT)
    if T > DECODE_MAX_T:
        raise ValueError(f"the decode GEMV takes at most {DECODE_MAX_T} tokens")
    rng = np.random.default_rng()
    calls = ROTATE if quick else 48
    variants: list[tuple[str, Gpu]] = [("", gpu)]
    if paths:
        variants = gemv_paths(gpu, s.q_gu, s.d)
        if not q8_possible(gpu.caps, s.q_down, s.F):
            variants = [(n, g) for n, g in variants if not n.startswith("q8")]
            if not any("(default)" in n for n, _ in variants):  # the options ask for q8: down cannot
                variants = [(n, g) if n != "teams" else ("teams (default)", g) for n, g in variants]
    rows = []
    ex = _experts(gpu, s, rng)  # one stack set timed on every path
    for label, gg in variants:
        g, _ = _routed_graph(gg, "bench.moe_gemv", s, T, calls, None, rng, ex=ex)
        # every (token, slot) pair streams its expert's gate, up and down rows
        nbytes = T * s.k * (2 * ex.gate.expert_bytes + ex.down.expert_bytes)
        sec = timed(g, 2 if quick else 20) / calls
        plans = sorted({op.desc.split(f"k={s.k}", 1)[-1].strip() for op in g.ops if "gemv" in op.kernel.name
                        or "mul_mat_id_vec" in op.kernel.name} - {""})
        shape_s = f"{s} T={T}" + (f" {'/'.join(plans)}" if plans else "")
        rows.append({"name": f"moe gemv {label}".strip(), "shape": shape_s, "seconds": sec, "GB/s": nbytes / sec / 1e9,
                     "goal": GEMV_GOAL})
    return rows
