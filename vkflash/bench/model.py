"""`vkflash bench model`: prefill and decode rates of a model on the GPU forward, at depths; with
`--mtp`, greedy decoding by MTP speculation against plain decoding (see `bench_mtp`).

Rows: pp512 and pp2048 from an empty context, tg128 after a one-token prompt (each `reps` times:
the median, with the slowest and fastest), then at each depth of `--depth` the marginal window
that filled the context up to it (tokens ÷ seconds between the two depths, not a single probe),
pp512 and tg128 there. An untimed prefill first brings the GPU to its clocks. Per decode token:
dispatches, submissions and barriers of the recorded decode graph; host µs per step = wall time −
GPU time (GPU time from the graph's timestamps, recorded for that measurement only) and its share
of the step; bytes touched. Each decode row carries its roofline fraction: bytes touched per token
(weights read — k of E experts, one row of an embedding table, nothing of host tables — + K/V read
+ recurrent state read and written) × tok/s ÷ the copy bandwidth measured in the same run. The
longest prefill submission's GPU time is printed beside the submission budget. `--profile` adds
the per-op GPU time, grouped over layers, of the decode step and of one prefill step: the first pp
row's at depth 0 and the window's at the deepest depth. The forward reserves every step graph first
(its arena is what the memory plan counts), and the deep-context guard's steps taken during the
depth sweep are listed with the rows.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
from rich.console import Console
from rich.table import Table

from vkflash.bench.kernels import copy_bandwidth, gpu_ns
from vkflash.engine.api import SamplingParams
from vkflash.engine.gpu_forward import GpuForward, steps
from vkflash.engine.graphs.common import Head
from vkflash.engine.sampling import Sampler
from vkflash.engine.speculate import DraftPolicy, Speculator, agreeing
from vkflash.errors import DeviceError
from vkflash.formats.gguf_file import GGUFFile
from vkflash.gpu.context import Gpu
from vkflash.gpu.graph import Graph
from vkflash.gpu.ops.attention import Cache
from vkflash.model.hparams import hparams_from_gguf

T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """What to measure: prefill sizes from empty, the depth-row prefill window, decode steps, depths."""

    pp: tuple[int, ...] = (512, 2048)
    window: int = 512
    tg: int = 128
    depths: tuple[int, ...] = (0, 8192, 32768, 131072)
    host_steps: int = 64
    reps: int = 3  # timings of each depth-0 row

    @classmethod
    def quick(cls, depths: Sequence[int] | None = None) -> "Plan":
        """Small sizes with every row kind (CI on lavapipe)."""
        return cls((16, 64), 16, 8, tuple(depths) if depths is not None else (0, 48), 8, 2)

    def context(self) -> int:
        """Positions the sweep needs (the deepest rows, then one more window)."""
        return max(max(self.pp), 1 + self.tg, max(self.depths, default=0) + 2 * self.window + self.tg)


@dataclass
class Row:
    """One timed measurement: tokens fed from position `depth` in `seconds`."""

    name: str
    depth: int
    tokens: int
    seconds: float  # the median of the timings
    roofline: float | None = None  # decode rows: bytes/token × tok/s ÷ copy bandwidth
    spread: tuple[float, float] | None = None  # (slowest, fastest) tok/s over repeated timings

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @classmethod
    def repeated(cls, name: str, depth: int, tokens: int, seconds: Sequence[float]) -> "Row":
        """A row timed several times: the median, with the slowest and fastest rates."""
        return cls(name, depth, tokens, float(np.median(seconds)),
                   spread=(tokens / max(seconds), tokens / min(seconds)) if len(seconds) > 1 else None)


@dataclass
class DecodeCost:
    """The decode step's shape and where its time goes (µs per step, means over host_steps)."""

    dispatches: int
    submissions: int
    barriers: int
    step_us: float
    gpu_us: float
    host_split_us: dict[str, float] = field(default_factory=dict)  # GpuForward.host_split per step

    @property
    def host_us(self) -> float:
        return self.step_us - self.gpu_us

    @property
    def host_share(self) -> float:
        return self.host_us / self.step_us


@dataclass
class Result:
    device: str
    model: str
    copy_gbps: float
    weight_bytes: int  # weight bytes read per decode token
    rows: list[Row] = field(default_factory=list)
    decode: DecodeCost | None = None
    state_bytes: int = 0  # K/V and recurrent bytes a decode token touches at depth 0
    longest_submission_ms: float = 0.0  # GPU time of the longest prefill submission seen
    budget_ms: float = 0.0
    profile: dict[str, tuple[int, float]] = field(default_factory=dict)  # op → (calls, µs) per token
    prefill_profiles: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)  # row → op → per step
    guard: list[str] = field(default_factory=list)  # the deep-context guard's steps in the depth sweep

    def to_json(self) -> dict:
        d = asdict(self)
        d["rows"] = [dict(asdict(r), tok_per_s=r.rate) for r in self.rows]
        if self.decode is not None:
            d["decode"].update(host_us=self.decode.host_us, host_share=self.decode.host_share)
        return d


# --- bytes touched per decode token ---------------------------------------------------------
def weight_bytes_per_token(fwd: GpuForward) -> int:
    """Weight bytes one decode token reads: every matrix once, k of E experts' slices, one row of an
    embedding table that is not also the LM head."""
    hp, w = fwd.hp, fwd.model.weights
    total = 0
    for name, t in w.tensors.items():
        if name == "token_embd.weight" and w.get("output.weight") is not None:
            total += t.nbytes // hp.V
        elif "_exps" in name and hp.E:
            total += t.nbytes * hp.k // hp.E
        else:
            total += t.nbytes
    return total


def state_bytes_per_token(fwd: GpuForward, depth: int) -> int:
    """K/V bytes read at context `depth` (QSA layers read at most W = B + r − 1 cells) plus the GDN
    recurrent and conv states, read and written (f32)."""
    hp, kv = fwd.hp, fwd.model.kv
    total = 0
    for i, layer in kv.layers.items():
        r = hp.r[i] if hp.r else 0
        cells = depth + 1 if not r else min(depth + 1, hp.B + r - 1)
        total += 2 * Cache.nbytes(cells, layer.k.n_heads, layer.k.dim, layer.k.type)
    n_gdn = sum(hp.is_gdn[:hp.L])
    conv_channels = 2 * hp.n_k * hp.S + hp.n_v * hp.S
    total += 2 * 4 * n_gdn * (hp.n_v * hp.S * hp.S + max(0, hp.K_c - 1) * conv_channels)
    return total


# --- timing ---------------------------------------------------------------------------------
def warm(fwd: GpuForward, n: int) -> None:
    """Record (and so compile) every step graph feeding n tokens uses, so timing sees replays only."""
    plan = list(steps(n, fwd.ub))
    for j, (_, size) in enumerate(plan):
        fwd.graph_stats(size, Head.LAST if j == len(plan) - 1 else Head.NONE)


def timed_prefill(fwd: GpuForward, ids: np.ndarray) -> tuple[float, int]:
    """Seconds to feed ids (up to the greedy next token on the host), and that token."""
    warm(fwd, len(ids))
    t0 = time.perf_counter()
    nxt = fwd.prefill_argmax(ids)
    return time.perf_counter() - t0, nxt


WARM_SECONDS = 2.0  # untimed prefill before the first row, at least: the H200 ran a first pp512 at 40% speed
WARM_AGREE = 0.05  # ... and until two runs in a row agree this closely


def warm_up(fwd: GpuForward, prompt: Callable[[], np.ndarray], limit: int = 50) -> None:
    """Untimed prefills of prompt() until WARM_SECONDS have passed and the last two took times within
    WARM_AGREE of each other (at most `limit` runs): a GPU raises its clocks only under sustained load."""
    start, last = time.perf_counter(), None
    for _ in range(limit):
        fwd.reset()
        t = timed_prefill(fwd, prompt())[0]
        if last is not None and abs(t - last) <= WARM_AGREE * last and time.perf_counter() - start >= WARM_SECONDS:
            return
        last = t


def timed_decode(fwd: GpuForward, token: int, n: int) -> tuple[float, int]:
    """Seconds for n greedy decode steps from token, and the last token."""
    warm(fwd, 1)
    t0 = time.perf_counter()
    for _ in range(n):
        token = fwd.decode_argmax(token)
    return time.perf_counter() - t0, token


def stamped(g: Graph, run: Callable[[], T], **tracing: bool) -> T:
    """run() with g recorded with GPU timestamps (and `tracing` switches), then plainly again."""
    plain = g.options
    g.options = replace(plain, tracing=replace(plain.tracing, stamps=True, **tracing))
    g.record()
    try:
        return run()
    finally:
        g.options = plain
        g.record()


def longest_submission_ms(g: Graph, run: Callable[[], object]) -> float:
    """GPU ms of the longest submission of g while run() replays it once."""
    def measure() -> float:
        run()
        period = g.gpu.caps.timestamp_period_ns
        return max((s.seq.get_timestamps()[s.n_recorded] - s.seq.get_timestamps()[0]) * period / 1e6
                   for s in g.submissions)
    return stamped(g, measure)


def per_op(g: Graph, run: Callable[[], object], n: int) -> dict[str, tuple[int, float]]:
    """Per-op GPU µs per run of g over n calls of run(), ops of every layer summed under their name
    without the `blk.N.` prefix (timestamps after every op: the parts add up to more than a step)."""
    out: dict[str, list[float]] = {}

    def runs() -> None:
        period = g.gpu.caps.timestamp_period_ns
        for _ in range(n):
            run()
            for sub in g.submissions:
                ts = sub.seq.get_timestamps()
                for op, slot in zip(sub.ops, sub.op_slots):
                    name = re.sub(r"^blk\.\d+\.", "", op.name) + f" [{op.kernel.name}]"
                    calls_us = out.setdefault(name, [0, 0.0])
                    calls_us[0] += 1
                    calls_us[1] += (ts[slot + 1] - ts[slot]) * period / 1e3
    stamped(g, runs)
    return {k: (int(c) // n, us / n) for k, (c, us) in out.items()}


def profile(fwd: GpuForward, token: int, n: int) -> dict[str, tuple[int, float]]:
    """Per-op GPU µs per decode token over n steps (per_op)."""
    def step() -> None:
        nonlocal token
        token = fwd.decode_argmax(token)
    return per_op(fwd.graph(1, Head.LAST), step, n)


def profile_prefill(fwd: GpuForward, depth: int, tokens: int, ids: Callable[[int], np.ndarray],
                    n: int) -> dict[str, tuple[int, float]]:
    """Per-op GPU µs of one prefill step of `tokens` ids(tokens) at `depth` (each of n runs from a fresh
    context, or truncated back to the checkpoint at depth; per_op)."""
    def step() -> None:
        fwd.truncate(depth) if depth else fwd.reset()
        fwd.prefill_argmax(ids(tokens))
    return per_op(fwd.graph(tokens, Head.LAST), step, n)


def decode_cost(fwd: GpuForward, token: int, n: int) -> tuple[DecodeCost, int]:
    """Decode-graph size and mean wall / GPU µs per step over n steps (timestamps recorded only
    for this, then the graph is recorded plainly again)."""
    stats = fwd.graph_stats(1, Head.LAST)
    g = fwd.graph(1, Head.LAST)
    wall, gpu = [], []

    def steps() -> None:
        nonlocal token
        for _ in range(n):
            t0 = time.perf_counter()
            token = fwd.decode_argmax(token)
            wall.append(time.perf_counter() - t0)
            gpu.append(gpu_ns(g) / 1e9)
    fwd.host_split = {}
    try:
        stamped(g, steps)
        split = {k: 1e6 * v / n for k, v in fwd.host_split.items()}
    finally:
        fwd.host_split = None
    return DecodeCost(stats.dispatches, stats.submissions, stats.barriers, 1e6 * float(np.mean(wall)),
                      1e6 * float(np.mean(gpu)), split), token


def bench(path: Path, plan: Plan, ub: int | None = None, kv: str | None = None, with_profile: bool = False) -> Result:
    """Every row of the plan on one GPU forward of path (depths beyond the model's context skipped)."""
    n_train = hparams_from_gguf(GGUFFile(path)).n_ctx_train
    depths = tuple(sorted(d for d in set(plan.depths) if d + 2 * plan.window + plan.tg <= n_train))
    plan = replace(plan, depths=depths)
    gpu = Gpu()
    small = gpu.caps.device_type == "cpu" or max(plan.pp) < 512
    # the ceiling first: its buffers are freed before the model's budget (VKFLASH_MEM_BUDGET) holds
    copy = copy_bandwidth(gpu, (32 << 20) if small else (1 << 30), 5 if small else 50)
    fwd = GpuForward(path, ctx=min(plan.context(), n_train), ub=ub, kv=kv, gpu=gpu)
    fwd.reserve()
    res = Result(fwd.gpu.caps.name, path.name, copy.rate, weight_bytes_per_token(fwd),
                 state_bytes=state_bytes_per_token(fwd, 1), budget_ms=fwd.gpu.options.submit_budget_ms)
    rng = np.random.default_rng()

    def ids(n: int) -> np.ndarray:
        return rng.integers(0, fwd.n_vocab, n)

    def roofline(row: Row) -> Row:
        per_token = res.weight_bytes + state_bytes_per_token(fwd, row.depth + row.tokens // 2)
        row.roofline = per_token * row.rate / (copy.rate * 1e9)
        return row

    # untimed: every graph is recorded, the GPU leaves its idle clocks (a CPU device has none to leave)
    warm_up(fwd, lambda: ids(max(plan.pp)), limit=1 if small else 50)
    for n in plan.pp:
        times = []
        for _ in range(plan.reps):
            fwd.reset()
            times.append(timed_prefill(fwd, ids(n))[0])
        res.rows.append(Row.repeated(f"pp{n}", 0, n, times))
    fwd.reset()
    _, tok = timed_prefill(fwd, ids(1))
    times = []
    for _ in range(plan.reps):
        s, tok = timed_decode(fwd, tok, plan.tg)
        times.append(s)
    res.rows.append(roofline(Row.repeated(f"tg{plan.tg}", 1, plan.tg, times)))
    res.decode, tok = decode_cost(fwd, tok, plan.host_steps)
    if with_profile:
        res.profile = profile(fwd, tok, plan.host_steps)
        one_step = [n for n in plan.pp if n <= fwd.ub]
        if one_step:
            res.prefill_profiles[f"pp{one_step[0]}"] = profile_prefill(fwd, 0, one_step[0], ids, plan.reps)
    fwd.reset()
    pos = 0
    for d in depths:
        if d > pos:
            res.rows.append(Row(f"window {pos}→{d}", pos, d - pos, timed_prefill(fwd, ids(d - pos))[0]))
        # as llama-bench -d: the same window prefilled at depth d, one untimed run (graphs recorded
        # again after the caches grew, kernels only deep contexts use), then reps timed, each from d
        fwd.checkpoint()
        times = []
        for i in range(plan.reps + 1):
            fwd.truncate(d)
            s, tok = timed_prefill(fwd, ids(plan.window))
            times += [s] if i else []
        res.rows.append(Row.repeated(f"pp{plan.window} @ d{d}", d, plan.window, times))
        if with_profile and d == depths[-1] and d > 0 and plan.window <= fwd.ub:
            res.prefill_profiles[f"pp{plan.window} @ d{d}"] = profile_prefill(fwd, d, plan.window, ids, plan.reps)
            fwd.truncate(d)
            _, tok = timed_prefill(fwd, ids(plan.window))
        s, _ = timed_decode(fwd, tok, plan.tg)
        res.rows.append(roofline(Row(f"tg{plan.tg} @ d{d + plan.window}", d + plan.window, plan.tg, s)))
        pos = d + plan.window + plan.tg
    if plan.window <= fwd.ub:  # one more window at the deepest point: its longest submission (watchdog)
        window = fwd.graph(plan.window, Head.LAST)
        res.longest_submission_ms = longest_submission_ms(window, lambda: fwd.prefill_argmax(ids(plan.window)))
    res.guard = [e.line() for e in fwd.guard.events]
    return res


def show(res: Result, console: Console) -> None:
    """The rows as rich tables: rates with roofline fractions, then the decode step's cost."""
    t = Table(title=f"vkflash bench model — {res.model} on {res.device} (copy {res.copy_gbps:.1f} GB/s)")
    for c in ("test", "depth", "tokens", "seconds", "tok/s", "slowest–fastest", "roofline"):
        t.add_column(c)
    for r in res.rows:
        t.add_row(r.name, str(r.depth), str(r.tokens), f"{r.seconds:.3f}", f"{r.rate:.1f}",
                  "" if r.spread is None else f"{r.spread[0]:.1f}–{r.spread[1]:.1f}",
                  "" if r.roofline is None else f"{r.roofline:.1%}")
    console.print(t)
    for line in res.guard:
        console.print(line)
    d = res.decode
    if d is None:
        return
    k = Table(title="per decode token", show_header=False)
    for name, value in (
        ("dispatches", str(d.dispatches)), ("submissions", str(d.submissions)), ("barriers", str(d.barriers)),
        ("step µs (wall)", f"{d.step_us:.0f}"), ("GPU µs (timestamps)", f"{d.gpu_us:.0f}"),
        ("host µs (wall − GPU)", f"{d.host_us:.0f}"), ("host share of the step", f"{d.host_share:.1%}"),
        ("  of it in Python: prepare / submit call / finish",
         " / ".join(f"{d.host_split_us.get(k, 0.0):.0f}" for k in ("prepare", "submit", "finish"))
         + " µs (the rest: submission latency and fence wake-up)"),
        ("weight bytes read", f"{res.weight_bytes / 1e6:.2f} MB"),
        ("state bytes touched (depth 1)", f"{res.state_bytes / 1e6:.2f} MB"),
        ("longest prefill submission", f"{res.longest_submission_ms:.1f} ms GPU (budget {res.budget_ms:.0f} ms)"),
    ):
        k.add_row(name, value)
    console.print(k)
    tables = [("decode step per op (GPU µs per token, layers summed)", res.profile)] if res.profile else []
    tables += [(f"{row} prefill step per op (GPU µs per step, layers summed)", prof)
               for row, prof in res.prefill_profiles.items()]
    for title, prof in tables:
        p = Table(title=title)
        for c in ("op [kernel]", "calls", "µs", "share"):
            p.add_column(c)
        total = sum(us for _, us in prof.values())
        for name, (calls, us) in sorted(prof.items(), key=lambda kv: -kv[1][1]):
            p.add_row(name, str(calls), f"{us:.1f}", f"{us / total:.1%}")
        console.print(p)


def run(path: Path, quick: bool, depths: Sequence[int] | None, as_json: bool, console: Console,
        ub: int | None = None, kv: str | None = None, with_profile: bool = False, reps: int | None = None) -> Result:
    """`vkflash bench model`: measure, then print a table or JSON."""
    plan = Plan.quick(depths) if quick else (Plan(depths=tuple(depths)) if depths is not None else Plan())
    if reps is not None:
        plan = replace(plan, reps=reps)
    res = bench(path, plan, ub, kv, with_profile)
    if as_json:
        console.print_json(json.dumps(res.to_json()))
    else:
        show(res, console)
    return res


# --- MTP speculative decoding -----------------------------------------------------------------
ACCEPTS = (0.0, 0.5, 0.87, 1.0)
"""Default draft agreement probabilities of `--mtp`."""
MTP_DEPTHS = (0, 32768)
"""Default depths of `--mtp`."""


MTP_RUNS = 3
"""Timed runs of each `--mtp` row (after an untimed one): the table prints their median and range."""


@dataclass
class MtpRow:
    """Greedy decoding of `tokens` at `depth`, timed over several runs (`rates`, tok/s each): plain
    (accept None) or speculative, with drafts that agree with the known continuation with probability
    `accept`; the round counts are the timed runs' together."""

    depth: int
    accept: float | None
    tokens: int
    rates: list[float]
    rounds: int = 0
    plain_rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return float(np.median(self.rates))


@dataclass
class MtpResult:
    device: str
    model: str
    draft: str
    rows: list[MtpRow] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"device": self.device, "model": self.model, "draft": self.draft,
                "rows": [dict(asdict(r), tok_per_s=r.rate) for r in self.rows]}


def bench_mtp(path: Path, draft: Path | None, depths: Sequence[int], accepts: Sequence[float], tg: int,
              ub: int | None = None, kv: str | None = None, runs: int = MTP_RUNS) -> MtpResult:
    """At each depth: plain greedy decoding of tg tokens (the continuation), then for each agreement
    probability P speculative decoding of the same tokens from the same prefix, its output checked
    against the continuation. Each is run once untimed (GPU clocks up, graphs recorded; the adaptive
    draft length learns its estimates, as a server's does over its first requests), then `runs` times
    timed. Random weights accept almost nothing, so the drafts are replaced (`agreeing`) after the
    draft head ran: the draft and verify work is the real one."""
    n_train = hparams_from_gguf(GGUFFile(path)).n_ctx_train
    depths = sorted(d for d in set(depths) if d + tg + 16 <= n_train)
    sp = Speculator.open(path, draft, ctx=min(n_train, max(depths) + tg + 16), ub=ub, kv=kv)
    fwd = sp.fwd
    res = MtpResult(fwd.gpu.caps.name, path.name, draft.name if draft else "own MTP block")
    sp.warm()
    rng = np.random.default_rng()
    ids = rng.integers(0, fwd.n_vocab, max(depths) + 1)
    greedy = Sampler(SamplingParams(temperature=0.0))
    for d in depths:
        fwd.hooks, hooks = None, fwd.hooks  # plain decoding: the draft head neither runs nor catches up
        rates: list[float] = []
        for _ in range(1 + runs):
            sp.reset()
            x0 = sp.prefill_argmax(ids[:d + 1])
            t0, truth = time.perf_counter(), [x0]
            for _ in range(tg):
                truth.append(fwd.decode_argmax(truth[-1]))
            rates.append(tg / (time.perf_counter() - t0))
        res.rows.append(MtpRow(d, None, tg, rates[1:]))
        fwd.hooks = hooks
        for p in accepts:
            sp.policy = DraftPolicy(sp.cfg.adapt)
            row = MtpRow(d, p, tg, [])
            for i in range(1 + runs):
                sp.reset()
                x = sp.prefill_argmax(ids[:d + 1])
                sp.propose = agreeing(truth, d + 1, p, fwd.n_vocab, rng)
                out, t0 = [x], time.perf_counter()
                while len(out) <= tg:
                    out += sp.speculate(out[-1], greedy, out, tg + 1 - len(out))
                seconds = time.perf_counter() - t0
                sp.propose = None
                if out != truth:
                    raise DeviceError(f"depth {d}, P={p}: speculative decoding gave other tokens than plain decoding")
                if i:
                    row.rates.append(tg / seconds)
                    row.rounds, row.plain_rounds = row.rounds + sp.rounds, row.plain_rounds + sp.plain
                    row.drafted, row.accepted = row.drafted + sp.drafted, row.accepted + sp.accepted
            res.rows.append(row)
    return res


def show_mtp(res: MtpResult, console: Console) -> None:
    """The MTP rows: tok/s (median and range of the timed runs) and speed-up over plain decoding at the
    same depth, per agreement P."""
    t = Table(title=f"vkflash bench model --mtp — {res.model} (draft: {res.draft}) on {res.device}")
    for c in ("depth", "drafts agree", "tok/s", "range", "× plain", "tokens/round", "drafted/round", "plain rounds"):
        t.add_column(c)
    plain: dict[int, float] = {}
    for r in res.rows:
        spread = f"{min(r.rates):.1f}–{max(r.rates):.1f}"
        if r.accept is None:
            plain[r.depth] = r.rate
            t.add_row(str(r.depth), "plain decode", f"{r.rate:.1f}", spread, "1.00", "1", "", "")
            continue
        runs = len(r.rates)
        t.add_row(str(r.depth), f"{r.accept:g}", f"{r.rate:.1f}", spread, f"{r.rate / plain[r.depth]:.2f}",
                  f"{runs * r.tokens / max(r.rounds, 1):.2f}", f"{r.drafted / max(r.rounds, 1):.2f}",
                  f"{r.plain_rounds / runs:g}")
    console.print(t)


def run_mtp(path: Path, draft: Path | None, quick: bool, depths: Sequence[int] | None,
            accepts: Sequence[float] | None, as_json: bool, console: Console, ub: int | None = None,
            kv: str | None = None) -> MtpResult:
    """`vkflash bench model --mtp`: measure, then print a table or JSON."""
    plan = Plan.quick(depths) if quick else Plan(depths=tuple(depths) if depths is not None else MTP_DEPTHS)
    res = bench_mtp(path, draft, plan.depths, accepts if accepts is not None else ACCEPTS, plan.tg, ub, kv,
                    runs=1 if quick else MTP_RUNS)
    if as_json:
        console.print_json(json.dumps(res.to_json()))
    else:
        show_mtp(res, console)
    return res
