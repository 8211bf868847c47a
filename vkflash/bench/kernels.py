"""`vkflash bench kernels`: measured copy bandwidth, each kernel's GB/s against it, replay cost.

All rates come from one run on one device, so ratios (kernel GB/s ÷ copy GB/s) are meaningful;
absolute numbers on lavapipe say little. Times are wall-clock over many replays of one recorded
graph, with several buffers rotated so caches do not flatter the result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
from rich.console import Console
from rich.table import Table

from vkflash.gpu.context import Gpu
from vkflash.gpu.graph import Graph


@dataclass
class Row:
    name: str
    shape: str
    us: float  # per call
    rate: float  # GB/s or TFLOP/s
    unit: str
    vs_copy: float | None = None  # rate ÷ copy bandwidth (GB/s rows only)
    goal: float | None = None  # the goal for vs_copy (on the H200), where it sets one


WARMUP_S = 0.2
"""Replays before timing start: an idle GPU runs at low clocks (the H200 idles at 345 MHz)."""


def timed(g: Graph, reps: int) -> float:
    """Seconds per replay of an already-built graph, after WARMUP_S of warm-up replays."""
    t0 = time.perf_counter()
    g.run()
    while time.perf_counter() - t0 < WARMUP_S:
        g.run()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.run()
    return (time.perf_counter() - t0) / reps


def gpu_ns(g: Graph) -> float:
    """GPU time of the graph's last replay (recorded with timestamps): first to last timestamp of
    each submission."""
    period = g.gpu.caps.timestamp_period_ns
    total = 0.0
    for sub in g.submissions:
        ts = sub.seq.get_timestamps()
        total += (ts[sub.n_recorded] - ts[0]) * period
    return total


def gpu_seconds(g: Graph, reps: int) -> list[float]:
    """GPU seconds of each of `reps` replays (timestamps, so host waits do not count), after
    WARMUP_S of warm-up replays; the graph is recorded plainly again afterwards."""
    plain = g.options
    g.options = replace(plain, tracing=replace(plain.tracing, stamps=True))
    g.record()
    try:
        timed(g, 1)
        out = []
        for _ in range(reps):
            g.run()
            out.append(gpu_ns(g) / 1e9)
    finally:
        g.options = plain
        g.record()
    return out


def copy_bandwidth(gpu: Gpu, nbytes: int, reps: int) -> Row:
    """Bytes read + written per second by the compute-shader copy, over 3 rotated buffer pairs: the
    median of `reps` replays by GPU timestamps (wall time per replay moved it 2× between runs),
    with the spread of the replays in the shape column. The buffers are freed after."""
    from vkflash.gpu.ops.copy import copy_words

    g = gpu.graph("bench.copy")
    bufs = [(gpu.buffer(nbytes, f"src{i}"), gpu.buffer(nbytes, f"dst{i}")) for i in range(3)]
    for src, dst in bufs:
        copy_words(g, src, 0, dst, 0, nbytes // 4)
    times = np.array(gpu_seconds(g, reps)) / len(bufs)
    for pair in bufs:
        for b in pair:
            gpu.free(b)
    s = float(np.median(times))
    spread = (times.max() - times.min()) / s
    return Row("copy", f"{nbytes >> 20} MiB ±{spread / 2:.0%}", s * 1e6, 2 * nbytes / s / 1e9, "GB/s", 1.0)


def replay_cost(gpu: Gpu, n: int) -> tuple[Row, Row]:
    """µs per replay of a recorded graph of n tiny dispatches vs recording it afresh each time."""
    from vkflash.gpu.ops.copy import copy_words

    src, dst = gpu.buffer(1024, "a"), gpu.buffer(1024, "b")
    g = gpu.graph(f"bench.replay{n}")
    for _ in range(n):
        copy_words(g, src, 0, dst, 0, 16)
    reps = max(5, 2000 // n)
    replay = timed(g, reps)
    t0 = time.perf_counter()
    fresh_reps = max(2, reps // 10)
    for _ in range(fresh_reps):
        g.record()
        g.run()
    fresh = (time.perf_counter() - t0) / fresh_reps
    return (Row("replay", f"{n} dispatches", replay * 1e6, replay * 1e6 / n, "us/dispatch"),
            Row("record+run", f"{n} dispatches", fresh * 1e6, fresh * 1e6 / n, "us/dispatch"))


def raw_kp(gpu: Gpu, pythonpath: str | None) -> list[dict]:
    """Raw kp eval() cost of 1/100/1000 dispatches with the kp found on `pythonpath` (stock build)."""
    from vkflash.gpu.registry import kernel

    spv = gpu.spirv(kernel("copy"))
    fd, name = tempfile.mkstemp(suffix=".spv")
    path = Path(name)
    with os.fdopen(fd, "wb") as f:
        f.write(spv)
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "vkflash.gpu.replay_cost", str(path), "1", "100", "1000"],
                       capture_output=True, text=True, env=env, timeout=600)
    path.unlink(missing_ok=True)
    if r.returncode != 0:
        return []
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def kernel_rows(gpu: Gpu, quick: bool, only: tuple[str, ...] = (), sweep: bool = False) -> list[Row]:
    """GB/s of each bandwidth-bound kernel family that is registered (filled as families land);
    `only`: the families named (KERNEL_BENCHES keys), sweep: the GEMV plan sweep too."""
    rows: list[Row] = []
    for name, bench in KERNEL_BENCHES.items():
        if only and name not in only:
            continue
        rows += bench(gpu, quick, sweep) if name == "gemv" else bench(gpu, quick)
    return rows


def _rate(name: str, shape: str, g: Graph, n_calls: int, nbytes: int, reps: int) -> Row:
    s = timed(g, reps) / n_calls
    return Row(name, shape, s * 1e6, nbytes / s / 1e9, "GB/s")


def elementwise_rows(gpu: Gpu, quick: bool) -> list[Row]:
    """silu, RMSNorm, softmax and argmax over big f32 arrays (bytes read + written per call)."""
    from vkflash.gpu.ops import argmax, eltwise, norm, softmax
    from vkflash.gpu.ops.views import Rows

    rows_n, d = (512, 2560) if quick or gpu.caps.device_type == "cpu" else (8192, 10240)
    reps = 3 if quick else 30
    bufs = [(gpu.buffer(rows_n * d * 4, f"x{i}"), gpu.buffer(rows_n * d * 4, f"y{i}")) for i in range(3)]
    for x, _ in bufs:
        x.write(np.random.default_rng().standard_normal(rows_n * d, dtype=np.float32))
    nb = rows_n * d * 4
    out = []
    for name, build in (
        ("silu", lambda g, x, y: eltwise.silu(g, Rows(x, rows_n, d), Rows(y, rows_n, d))),
        ("rms_norm", lambda g, x, y: norm.rms_norm(g, Rows(x, rows_n, d), Rows(y, rows_n, d), 1e-6)),
        ("softmax", lambda g, x, y: softmax.softmax(g, Rows(x, rows_n, d), Rows(y, rows_n, d))),
    ):
        g = gpu.graph(f"bench.{name}")
        for x, y in bufs:
            build(g, x, y)
        out.append(_rate(name, f"{rows_n}x{d}", g, len(bufs), 2 * nb, reps))
    vocab = 248320
    logits = [gpu.buffer(vocab * 4, f"logits{i}") for i in range(3)]
    scratch = gpu.buffer(argmax.scratch_bytes(gpu.caps, vocab), "scratch")
    idx = gpu.buffer(4, "idx")
    g = gpu.graph("bench.argmax")
    for lg in logits:
        argmax.argmax(g, Rows.flat(lg, vocab), idx, scratch=scratch)
    out.append(_rate("argmax", f"{vocab}", g, len(logits), vocab * 4, reps * 10))
    return out


def _rows(results: list[dict], unit: str) -> list[Row]:
    """Bench result dicts (name, shape, seconds, `unit`, optional goal) as table rows."""
    return [Row(r["name"], r["shape"], r["seconds"] * 1e6, r[unit], unit, goal=r.get("goal")) for r in results]


def gemv_rows(gpu: Gpu, quick: bool, sweep: bool = False) -> list[Row]:
    """Decode GEMV weight GB/s on each path (dense Flash-Next shapes, Q6_K LM head, HC down and mix)."""
    from vkflash.bench import matmul

    small = quick or gpu.caps.device_type == "cpu"
    return _rows(matmul.gemv_bandwidth(gpu, quick=small, sweep=sweep), "GB/s")


def gemv_cols_rows(gpu: Gpu, quick: bool) -> list[Row]:
    """Decode GEMVs at 1 and 7 token columns (the LM head, a dense Q4_K projection), weights loaded once
    for all columns and once per column (VKFLASH_GEMV_COLS)."""
    from vkflash.bench import matmul

    return _rows(matmul.gemv_columns(gpu, quick=quick or gpu.caps.device_type == "cpu"), "GB/s")


def gemm_rows(gpu: Gpu, quick: bool) -> list[Row]:
    """Prefill GEMM TFLOP/s (scalar and coopmat tiles)."""
    from vkflash.bench import matmul

    return _rows(matmul.gemm_tflops(gpu, quick=quick or gpu.caps.device_type == "cpu"), "TFLOP/s")


def split_rows(gpu: Gpu, quick: bool) -> list[Row]:
    """Prefill GEMMs with few output tiles, unsplit vs split-K (TFLOP/s), and the HC inject's
    transposed GEMV at 8 vs fewer tokens per workgroup (GB/s of activations): VKFLASH_MM_SPLITK."""
    from vkflash.bench import matmul

    small = quick or gpu.caps.device_type == "cpu"
    return (_rows(matmul.split_gemm_tflops(gpu, quick=small), "TFLOP/s")
            + _rows(matmul.inject_bandwidth(gpu, quick=small), "GB/s"))


def moe_gemm_rows(gpu: Gpu, quick: bool) -> list[Row]:
    """Routed-expert GEMM TFLOP/s (compact vs plain grid)."""
    from vkflash.bench import moe

    return _rows(moe.expert_gemm_tflops(gpu, quick=quick or gpu.caps.device_type == "cpu"), "TFLOP/s")


def moe_pass_rows(gpu: Gpu, quick: bool) -> list[Row]:
    """Coopmat routed-expert passes, old vs wide-load fetch, at the prefill regimes (weight GB/s in the shape)."""
    from vkflash.bench import moe

    return _rows(moe.expert_pass_rates(gpu, quick=quick or gpu.caps.device_type == "cpu"), "TFLOP/s")


def moe_gemv_rows(gpu: Gpu, quick: bool) -> list[Row]:
    """Routed decode GEMV weight GB/s on each path."""
    from vkflash.bench import moe

    return _rows(moe.expert_gemv_bandwidth(gpu, quick=quick or gpu.caps.device_type == "cpu"), "GB/s")


def gdn_delta_rows(gpu: Gpu, quick: bool) -> list[Row]:
    """The chunked GDN delta rule at qwen4exp's prefill shape (T 2048, n_v 48, n_k 16, S 128; quick or
    CPU: T 256, n_v 6, n_k 2): the matrix form split in two passes (its plan's slice, and 8 columns),
    in one kernel (VKFLASH_GDN_SPLIT=0), and the scalar form (VKFLASH_GDN_MATRIX=0), gates raw as in
    the model. GB/s of the bytes it must move: conv rows and raw gates in, o out, the state in and out."""
    from vkflash.gpu.ops import gdn
    from vkflash.gpu.ops.views import F32, Rows

    small = quick or gpu.caps.device_type == "cpu"
    T, n_k, n_v, S = (256, 2, 6, 128) if small else (2048, 16, 48, 128)
    shape = gdn.GDNShape(n_k, n_v, S, gdn.HeadMap.TILED)
    rng = np.random.default_rng()
    x = rng.standard_normal((T, shape.C), dtype=np.float32)
    c = x / (1 + np.exp(-x))  # silu, like the conv output
    ba = rng.normal(0, 2, (T, 2 * n_v)).astype(np.float32)
    dt_a = np.concatenate([1 + rng.uniform(-0.5, 0.5, n_v), -rng.uniform(0.05, 1, n_v)]).astype(np.float32)
    state = rng.normal(0, 0.5, (n_v, S, S)).astype(np.float32)
    sets = [(gpu.upload(c, f"c{i}"), gpu.upload(ba, f"ba{i}"), gpu.upload(state, f"state{i}"),
             gpu.buffer(F32 * T * n_v * S, f"o{i}")) for i in range(3)]
    params = gpu.upload(dt_a, "dt|ssm_a")
    nbytes = F32 * (T * (shape.C + 2 * n_v + n_v * S) + 2 * n_v * S * S)
    reps = 2 if gpu.caps.device_type == "cpu" else 5 if quick else 20
    out = []
    for variant, cols in ((gdn.Variant.SPLIT, None), (gdn.Variant.SPLIT, 8), (gdn.Variant.MATRIX, None),
                          (gdn.Variant.CHUNK, None)):
        g = gpu.graph(f"bench.gdn_delta.{variant.name.lower()}")
        for cb, bab, sb, ob in sets:  # the gates fold into the delta kernel (Fusion.GDN_GATES)
            beta, gate = g.tensor(T, n_v, "beta"), g.tensor(T, n_v, "g")
            gdn.gates(g, Rows(bab, T, n_v, 0, 2 * n_v), Rows(bab, T, n_v, n_v, 2 * n_v), Rows.flat(params, n_v),
                      Rows.flat(params, n_v, n_v), beta, gate)
            plan = gdn.delta(g, Rows(cb, T, shape.C), beta, gate, Rows(sb, n_v, S * S), Rows(ob, T, n_v * S), shape,
                             1e-6, variant, cols=cols)
        out.append(_rate(f"gdn_delta {variant.name.lower()}",
                         f"T{T} {n_v}x{n_k}x{S} chunk {plan.chunk} cols {plan.cols}", g, len(sets), nbytes, reps))
    return out


def attention_rows(gpu: Gpu, quick: bool) -> list[Row]:
    """Decode attention K/V GB/s (qwen4exp heads, 32k–128k dense and the QSA gather): the decode
    kernel and the flash path it replaces."""
    from vkflash.bench import attention

    return _rows(attention.decode_bandwidth(gpu, quick=quick or gpu.caps.device_type == "cpu"), "GB/s")


def attention_prefill_rows(gpu: Gpu, quick: bool) -> list[Row]:
    """Flash-attention prefill TFLOP/s (scalar vs coopmat) and QSA prefill attention old vs new."""
    from vkflash.bench import attention_prefill as ap

    small = quick or gpu.caps.device_type == "cpu"
    return _rows(ap.prefill_tflops(gpu, quick=small) + ap.qsa_prefill(gpu, quick=small), "TFLOP/s")


SELECT_GOAL_US = 15.0  # the goal for the MoE router and the QSA selection per decode token (H200, 32k)


def _latency(name: str, shape: str, g: Graph, n_calls: int, reps: int) -> Row:
    """µs per call of a graph of n_calls dependent calls (one output: a barrier between them, as in decode)."""
    s = timed(g, reps) / n_calls
    return Row(name, shape, s * 1e6, s * 1e6, "µs", goal=SELECT_GOAL_US)


def selection_rows(gpu: Gpu, quick: bool) -> list[Row]:
    """The decode token's MoE router (E 512, k 10) and QSA selection (B 2048, r 4 at a 32k context:
    8192 blocks, kb 512, cell list), each on the default kernel and the other one (VKFLASH_ROUTER_RANK,
    VKFLASH_TOPK_WIDE), µs per call against the issue's ≤ 15 µs."""
    from vkflash.gpu.ops.moe import moe_router
    from vkflash.gpu.ops.qsa import qsa_select
    from vkflash.gpu.ops.views import Rows

    small = quick or gpu.caps.device_type == "cpu"
    rng = np.random.default_rng()
    calls, reps = (4, 2) if small else (64, 20)
    E, k = 512, 10
    ctx, r, B = (4096, 4, 256) if small else (32768, 4, 2048)
    nb = ctx // r
    out = []
    for rank in (gpu.options.router_rank, not gpu.options.router_rank):
        gg = gpu.with_options(replace(gpu.options, router_rank=rank))
        tag = "" if rank == gpu.options.router_rank else f" (VKFLASH_ROUTER_RANK={int(rank)})"
        zs = [gpu.upload(rng.standard_normal(E).astype(np.float32), f"z{i}") for i in range(3)]
        ids, w = gpu.buffer(4 * k, "ids"), gpu.buffer(4 * k, "w")
        g = gg.graph("bench.router")
        for i in range(calls):
            moe_router(g, Rows(zs[i % 3], 1, E), Rows(ids, 1, k), Rows(w, 1, k), k)
        out.append(_latency(f"moe_router{tag}", f"E={E} k={k} T=1 {g.ops[0].desc.split()[-1]} serial", g, calls,
                            reps))
    for wide in (gpu.options.topk_wide, not gpu.options.topk_wide):
        gg = gpu.with_options(replace(gpu.options, topk_wide=wide))
        tag = "" if wide == gpu.options.topk_wide else f" (VKFLASH_TOPK_WIDE={int(wide)})"
        params = gpu.upload(np.array([ctx - 1, ctx], np.int32), "params")
        ss = [gpu.upload(np.maximum(rng.standard_normal(nb + 1), 0).astype(np.float32), f"s{i}") for i in range(3)]
        cells, gp = gpu.buffer(4 * (B + r), "cells"), gpu.buffer(8, "gp")
        g = gg.graph("bench.qsa_select")
        for i in range(calls):
            qsa_select(g, params, 0, Rows(ss[i % 3], 1, nb + 1), Rows(cells, 1, B + r - 1), r=r, B=B,
                       gather_params=gp)
        out.append(_latency(f"{g.ops[0].kernel.name}{tag}", f"ctx={ctx} r={r} B={B} T=1 list serial", g, calls,
                            reps))
    return out + score_rows(gpu, small)


def score_rows(gpu: Gpu, small: bool) -> list[Row]:
    """Prefill QSA block scores of a 512-token ubatch at depth 32k (n_I 4 heads of 128, r 4), in query
    tiles and one query per workgroup (VKFLASH_QSA_SCORE_TILE=0): ms per call."""
    from vkflash.gpu.ops.qsa import qsa_scores
    from vkflash.gpu.ops.views import Rows

    rng = np.random.default_rng()
    T, ctx, n_I, D, r = (64, 2048, 4, 64, 4) if small else (512, 32768, 4, 128, 4)
    nb = (ctx + T) // r
    params = gpu.upload(np.array([ctx, ctx + T], np.int32), "params")
    qI = gpu.upload(rng.standard_normal((T, n_I * D)).astype(np.float32), "qI")
    kappa = gpu.upload(rng.standard_normal((nb, D)).astype(np.float32), "kappa")
    s = gpu.buffer(4 * T * nb, "scores")
    out = []
    for tile in (gpu.options.qsa_score_tile, not gpu.options.qsa_score_tile):
        g = gpu.with_options(replace(gpu.options, qsa_score_tile=tile)).graph("bench.qsa_scores")
        qsa_scores(g, params, 0, Rows(qI, T, n_I * D), Rows(kappa, nb, D), Rows(s, T, nb), n_I=n_I, r=r)
        tag = "" if tile == gpu.options.qsa_score_tile else f" (VKFLASH_QSA_SCORE_TILE={int(tile)})"
        ms = 1e3 * timed(g, 2 if small else 20)
        out.append(Row(f"qsa_scores{tag}", f"T={T} ctx={ctx} n_I={n_I} D_I={D} r={r}", 1e3 * ms, ms, "ms"))
    return out


KERNEL_BENCHES: dict[str, Callable[..., list[Row]]] = {
    "eltwise": elementwise_rows, "gemv": gemv_rows, "gemv_cols": gemv_cols_rows, "gemm": gemm_rows,
    "splitk": split_rows, "moe_gemm": moe_gemm_rows, "moe_pass": moe_pass_rows, "moe_gemv": moe_gemv_rows,
    "select": selection_rows, "gdn": gdn_delta_rows,
    "attn_decode": attention_rows, "attn_prefill": attention_prefill_rows}
"""Kernel families of `vkflash bench kernels`, by the names --only takes."""


def run(quick: bool, as_json: bool, console: Console, only: tuple[str, ...] = (), sweep: bool = False) -> None:
    unknown = set(only) - set(KERNEL_BENCHES)
    if unknown:
        from vkflash.errors import ConfigError

        raise ConfigError(f"--only: unknown families {sorted(unknown)} (have {', '.join(KERNEL_BENCHES)})")
    gpu = Gpu()
    nbytes = (32 << 20) if quick or gpu.caps.device_type == "cpu" else (1 << 30)
    copy = copy_bandwidth(gpu, nbytes, reps=5 if quick else 50)
    rows = [copy]
    for r in kernel_rows(gpu, quick, only, sweep):
        if r.unit == "GB/s":
            r.vs_copy = r.rate / copy.rate
        rows.append(r)
    if not only:
        for n in (1, 100, 1000):
            rows += replay_cost(gpu, n)
    stock = str(Path(__file__).resolve().parents[2] / "build" / "kp-stock" / "out")  # launcher/build_kp.py --stock
    raw = {"patched": raw_kp(gpu, None)} if not only else {}
    if Path(stock).exists() and not only:
        raw["stock"] = raw_kp(gpu, stock)
    if as_json:
        print(json.dumps({"device": gpu.caps.name, "rows": [asdict(r) for r in rows], "raw_kp": raw}, indent=1))
        return
    t = Table(title=f"vkflash bench kernels — {gpu.caps.name} ({gpu.caps.driver})")
    for c in ("kernel", "shape", "µs/call", "rate", "unit", "÷ copy", "goal"):
        t.add_column(c)
    for r in rows:
        if r.goal is None:
            goal = ""
        elif r.unit == "µs":
            goal = f"≤ {r.goal:g} µs" + (" ok" if r.us <= r.goal else " above")
        else:
            goal = f"≥ {r.goal:.2f}" + ("" if r.vs_copy is None else " ok" if r.vs_copy >= r.goal else " below")
        t.add_row(r.name, r.shape, f"{r.us:.1f}", f"{r.rate:.3g}", r.unit,
                  "" if r.vs_copy is None else f"{r.vs_copy:.2f}", goal)
    console.print(t)
    if not raw:
        return
    k = Table(title="raw Kompute eval() cost (one sequence, replayed)")
    for c in ("kp build", "dispatches", "µs per eval", "µs record+first eval"):
        k.add_column(c)
    for build, res in raw.items():
        for d in res:
            k.add_row(build, str(d["dispatches"]), f"{d['replay_us']:.1f}", f"{d['record_and_run_us']:.1f}")
    console.print(k)
