"""`vkflash verify`: the GPU forward and the NumPy reference on the same tokens, op by op.

Both sides run a prefill step of T−1 tokens and one decode step, with f32 K/V caches and the
same dequantized weights. Every intermediate both name alike (`blk.N.l_out`, `result_output`, …)
is compared as max|Δ| / RMS(ref) (logits: / std(ref)) against MODEL.md §7.10: 1e-4 for the
residual stream, 1e-3 for logits, and the greedy token must agree; those decide pass/fail. Other
intermediates get 1e-3 (a peaked attention, layer 0 of real Qwen models, differs by ~2e-4 in f32)
and locate a failure: the earliest op over tolerance in the first failing layer is named, which
is where a wrong kernel or a corrupt weight first shows. The GPU runs first: the reference then
follows it through router and QSA near-ties (model/ties.py), which f32 may resolve either way.

The GPU computes in f32. With a float64 reference (models up to F64_LIMIT) the reference also runs
in float32, F32_DRAWS times, and a value's bound is at least F32_FACTOR × the worst of those f32
runs' own errors (for the residual stream, its worst in the step): some models amplify f32
rounding past MODEL.md's bounds whoever computes them (qwen3next-tiny's GDN layers, ~10× per
layer, reach 2e-4 at layer 7 in NumPy f32), and a GPU as good as NumPy f32 is correct. One f32
run's error is one draw of a heavy-tailed quantity where rounding is amplified (the GDN gated
norm of a near-zero head, then every later layer): over 600 qwen3next-tiny verifies the GPU's
error over one NumPy run's was 1.1 in geometric mean, but over 4 in 22 verifies (up to 10); over
the worst of 4 runs, below 3.4 in all. The runs after the first move half the f32 token
embeddings one ulp (fixed seeds), so every later op rounds anew (f32_draws).
Larger models get a float32 reference, itself that far off: the first of the F32_DRAWS f32 runs.
Every bound is × F32_REF_FACTOR, the residual stream's at least F32_REF_RESIDUAL, and every bound
at least 2·F32_FACTOR × the other runs' worst distance from the first, which grows with the
model's own amplification of f32 rounding. Qwen2.5-Coder-0.5B, 25 draws of 16 random tokens, on
the residual stream: GPU vs NumPy f32 mostly 1e-4–1e-3, but 6.0e-3, 7.6e-3 and 8.6e-3 in three
draws (and 1.4e-2 once in a test run), where the model's massive activations (max|x| ≈ 100 RMS)
meet f32 sums of 4864 terms; in those three NumPy f32 itself was 2.3e-3–6.5e-3 from float64, the
GPU 4.4e-3–5.8e-3, and the f32 runs 2.7e-3–5.2e-3 apart. A wrong kernel is off by O(1).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vkflash.errors import ConfigError
from vkflash.model.ties import Follow, Seen

if TYPE_CHECKING:
    from vkflash.engine.gpu_forward import GpuForward

RESIDUAL_TOL = 1e-4
"""max|Δ|/RMS(ref) of the residual stream after each sublayer (§7.10: per-layer residuals)."""
OP_TOL = 1e-3
"""max|Δ|/RMS(ref) of any other intermediate (norm outputs, projections, attention)."""
LOGITS_TOL = 1e-3
"""max|Δ|/std(ref) of the logits (§7.10)."""
RESIDUALS = frozenset({"inp_embd", "attn_residual", "l_out", "ple_out"})
LOGITS = "result_output"
F64_LIMIT = 1 << 30
"""Reference weights are float64 up to this many bytes (tiny models), float32 above."""
F32_FACTOR = 4.0
"""How much worse than the float32 reference (vs float64) the GPU may be before its f32 floor fails."""
F32_DRAWS = 4
"""float32 reference runs whose worst error is the f32 floor's measure (see the module docstring)."""
F32_REF_FACTOR = 8.0
"""Every bound's factor when the reference itself is float32 (models above F64_LIMIT)."""
F32_REF_RESIDUAL = 1e-2
"""The residual stream's bound when the reference itself is float32 (see the module docstring)."""
_BLK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class OpError:
    """One compared intermediate: which step, its name, its error in units of the reference's scale."""

    phase: str  # "prefill" | "decode"
    name: str
    err: float
    tol: float

    @property
    def layer(self) -> int | None:
        """N of `blk.N.<op>`, None for global names."""
        m = _BLK.match(self.name)
        return int(m.group(1)) if m else None

    @property
    def ok(self) -> bool:
        return bool(self.err <= self.tol)  # NaN fails


@dataclass(frozen=True)
class Greedy:
    """One step's greedy token on both sides; `near`: the reference's top two logits lie within twice
    the logits bound (× std), where either may win (MODEL.md §7.10: report such a near-tie, not fail)."""

    gpu: int
    ref: int
    near: bool

    @property
    def ok(self) -> bool:
        return self.gpu == self.ref or self.near


@dataclass
class Report:
    """Every comparison in execution order (prefill, then decode) and the greedy-token check."""

    tokens: int
    rows: list[OpError] = field(default_factory=list)
    argmax: dict[str, Greedy] = field(default_factory=dict)  # by phase

    @property
    def first_failed_check(self) -> OpError | None:
        """The first residual-stream or logits comparison over its tolerance (what fails verify)."""
        return next((r for r in self.rows if checked(r.name) and not r.ok), None)

    @property
    def first_bad(self) -> OpError | None:
        """The op where the failure starts: the earliest op over tolerance in the step and layer
        of the first failed check. Intermediates elsewhere only inform: a graph may lay a value
        out differently or fuse it away (e.g. a residual add in a matmul store)."""
        c = self.first_failed_check
        if c is None:
            return None
        return next(r for r in self.rows if r.phase == c.phase and r.layer == c.layer and not r.ok)

    @property
    def passed(self) -> bool:
        return self.first_failed_check is None and all(g.ok for g in self.argmax.values()) and bool(self.rows)


def relative_error(name: str, got: np.ndarray, ref: np.ndarray) -> float:
    """max|got − ref| / RMS(ref), or / std(ref) for the logits (a zero scale counts as 1), over the
    reference's finite entries (−inf marks don't-care ones, e.g. invisible QSA blocks); a
    non-finite GPU value there is an infinite error."""
    ref = np.asarray(ref, np.float64)
    keep = np.isfinite(ref)
    if not keep.any():
        return 0.0
    d = np.abs(np.asarray(got, np.float64)[keep] - ref[keep])
    diff = float(d.max()) if np.isfinite(d).all() else float("inf")
    r = ref[keep]
    scale = float(r.std() if name == LOGITS else np.sqrt(np.mean(r * r)))
    return diff / (scale or 1.0)


def checked(name: str) -> bool:
    """Whether `name` decides pass/fail: the residual stream and the logits (MODEL.md §7.10)."""
    return name == LOGITS or name.rsplit(".", 1)[-1] in RESIDUALS


def tolerance(name: str) -> float:
    """The bound on `name`'s relative error: logits, residual stream, or any other op."""
    if name == LOGITS:
        return LOGITS_TOL
    return RESIDUAL_TOL if name.rsplit(".", 1)[-1] in RESIDUALS else OP_TOL


def compare(phase: str, gpu: dict[str, np.ndarray], ref: dict[str, np.ndarray],
            refs32: Sequence[dict[str, np.ndarray]] = (), scale: float = 1.0,
            residual_floor: float = 0.0, f32_factor: float = F32_FACTOR) -> list[OpError]:
    """OpErrors for the names both sides produced, in the reference's (execution) order. A GPU
    buffer holds its op's output in its leading elements (rows at offset 0); a buffer smaller
    than the reference value cannot hold it and is reported as a failure; a 2-D view wider than
    the reference's rows is cut to them. Bounds are × `scale`, the residual stream's at least
    `residual_floor`; with float32 reference runs `refs32`, a bound is at least `f32_factor` × their
    worst error, for the residual stream its worst error in the step (per value it scatters: one
    layer may come out 10× better than its neighbours by chance)."""
    floors: dict[str, float] = {}
    if refs32:
        floors = {n: f32_factor * max(relative_error(n, r[n], ref[n]) for r in refs32)
                  for n in ref if all(n in r for r in refs32)}
        residual = [f for n, f in floors.items() if checked(n) and n != LOGITS]
        for n in floors:
            if residual and checked(n) and n != LOGITS:
                floors[n] = max(residual)
    rows = []
    for name, want in ref.items():
        if name not in gpu:
            continue
        flat = gpu[name]
        if flat.ndim == 2 and want.ndim == 2 and flat.shape[0] >= want.shape[0] and flat.shape[1] > want.shape[1]:
            flat = flat[:want.shape[0], :want.shape[1]]  # a view sized for the most columns (QSA blocks)
        flat = flat.reshape(-1)
        tol = max(scale * tolerance(name), floors.get(name, 0.0))
        if checked(name) and name != LOGITS:
            tol = max(tol, residual_floor)
        if flat.size < want.size:
            rows.append(OpError(phase, name, float("inf"), tol))
            continue
        rows.append(OpError(phase, name, relative_error(name, flat[:want.size].reshape(want.shape), want), tol))
    return rows


def reference_steps(weights: Any, steps: Sequence[np.ndarray],
                    seen: Seen | None = None) -> list[dict[str, np.ndarray]]:
    """The reference's floating-point intermediates of each step, by name, in emission order;
    following the GPU through router and QSA near-ties when given what it `seen` (model/ties.py)."""
    from vkflash.engine.qsa_config import QSAConfig
    from vkflash.model import reference

    out: list[dict[str, np.ndarray]] = []

    def dump(name: str, x: np.ndarray) -> None:
        if np.issubdtype(np.asarray(x).dtype, np.floating):
            out[-1][name] = np.array(x)

    hooks = {}
    if seen is not None:
        follow = Follow(seen, weights.hp)
        hooks = {"route": follow.route, "select": follow.select}
    qsa = QSAConfig.from_settings()  # the selection mode and tie rule the GPU runs with
    state = reference.new_state(weights, cache_dtype=np.float32, dump=dump, **hooks, **qsa.reference_options())
    for ids in steps:
        out.append({})
        reference.prefill(ids, state)
    return out


def f32_draws(weights: Any, steps: Sequence[np.ndarray], seen: Seen | None = None,
              n: int = F32_DRAWS) -> list[list[dict[str, np.ndarray]]]:
    """n float32 reference runs of `steps` (float32 `weights`), as reference_steps gives each: the
    first on the weights as they are, run k on token embeddings of which a random half (seed k) is
    moved one ulp up or down: every op after the embedding rounds differently, and the runs' errors
    are alike in size (geometric mean within 2% of the first's, measured on qwen3next-tiny)."""
    runs = [reference_steps(weights, steps, seen)]
    e = weights.token_embd
    for k in range(1, n):
        u = np.random.default_rng(k).random(e.shape)
        away = np.where(u < 0.25, -np.inf, np.where(u < 0.5, np.inf, e)).astype(e.dtype)
        runs.append(reference_steps(replace(weights, token_embd=np.nextafter(e, away)), steps, seen))
    return runs


def open_forward(path: Path, n_tokens: int, ctx: int) -> "GpuForward":
    """A GPU forward sized for verify: f32 caches, one prefill step of n_tokens − 1 with all logits."""
    from vkflash.engine.gpu_forward import GpuForward

    n = max(1, n_tokens - 1)
    return GpuForward(path, ctx=max(ctx, n_tokens), ub=n, kv="f32", logits_rows=n)


def reference_dtype(path: Path) -> type:
    """float64 when the dequantized weights fit F64_LIMIT bytes, else float32 (still exact weights)."""
    from vkflash.formats.gguf_file import GGUFFile

    n = sum(t.n_elements for t in GGUFFile(path).tensors.values())
    return np.float64 if 8 * n <= F64_LIMIT else np.float32


def verify(path: Path, tokens: Sequence[int], fwd: "GpuForward | None" = None, ctx: int = 512) -> Report:
    """Run tokens[:-1] as one prefill step and tokens[-1] as a decode step on the GPU (`fwd`, or a
    fresh one) and the reference; compare every shared intermediate."""
    from vkflash.model.reference import GLOBAL_NAMES, LAYER_OPS
    from vkflash.model.weights import load_model

    toks = np.asarray(tokens, np.int64).reshape(-1)
    if len(toks) < 2:
        raise ConfigError("verify needs at least 2 tokens (a prefill step and a decode step)")
    fwd = fwd or open_forward(path, len(toks), ctx)
    fwd.reset()
    steps = [toks[:-1], toks[-1:]]
    L = fwd.hp.L
    names = [*GLOBAL_NAMES, *(f"blk.{i}.{op}" for i in range(L) for op in LAYER_OPS)]
    gpu = [fwd.dump_step(ids, names) for ids in steps]  # first: the reference follows its near-ties
    seen = Seen()
    for got, ids in zip(gpu, steps):
        seen.add_taps(got, L, len(ids))
    f32_ref = reference_dtype(path) is not np.float64
    runs32 = f32_draws(load_model(path, np.float32), steps, seen)
    # a float32 reference is the first f32 run; the others' distance from it sizes the f32 floor,
    # doubled: the reference's own f32 error adds to the GPU's
    refs = runs32.pop(0) if f32_ref else reference_steps(load_model(path, np.float64), steps, seen)
    report = Report(len(toks))
    for s, (phase, got, ref) in enumerate(zip(("prefill", "decode"), gpu, refs)):
        report.rows += compare(phase, got, ref, [run[s] for run in runs32], F32_REF_FACTOR if f32_ref else 1.0,
                               F32_REF_RESIDUAL if f32_ref else 0.0, 2 * F32_FACTOR if f32_ref else F32_FACTOR)
        if LOGITS in got and LOGITS in ref:
            n, V = ref[LOGITS].shape
            gpu_logits, last = got[LOGITS][:n * V].reshape(n, V), ref[LOGITS][-1]
            tol = next(r.tol for r in report.rows if r.phase == phase and r.name == LOGITS)
            top2 = np.sort(last)[-2:]  # one logit (V = 1): never a tie
            report.argmax[phase] = Greedy(int(gpu_logits[-1].argmax()), int(last.argmax()),
                                          V > 1 and bool(top2[1] - top2[0] <= 2 * tol * ref[LOGITS].std()))
    return report


def prompt_tokens(path: Path, prompt: str | None, n_random: int, rng: np.random.Generator) -> list[int]:
    """The prompt's tokens (the model's tokenizer), or n_random random ids below V."""
    from vkflash.formats.gguf_file import GGUFFile
    from vkflash.model.hparams import hparams_from_gguf

    if prompt is not None:
        from vkflash.model.tokenizer import Tokenizer

        return Tokenizer.from_gguf(path).encode(prompt)
    if n_random < 2:
        raise ConfigError(f"verify needs at least 2 tokens (a prefill step and a decode step), not {n_random}")
    V = hparams_from_gguf(GGUFFile(path)).V
    return [int(t) for t in rng.integers(0, V, n_random)]


def print_report(report: Report, console: Any, every_op: bool = False) -> None:
    """A rich table: per step and layer the layer output's error and the worst op's (every compared
    op with `every_op`), then the verdict naming the first op over tolerance."""
    from rich.table import Table

    t = Table(title=f"vkflash verify: GPU vs reference on {report.tokens} tokens — max|Δ|/RMS (logits: /std)")
    for c in ("step", "layer", "output", "worst op", "error", "tolerance", ""):
        t.add_column(c)

    def verdict(rs: list[OpError]) -> str:
        return "ok" if all(r.ok for r in rs) else "[red]FAIL[/red]"

    groups: dict[tuple[str, str], list[OpError]] = {}
    for r in report.rows:
        key = (r.phase, r.name if every_op or r.layer is None else f"blk.{r.layer}")
        groups.setdefault(key, []).append(r)
    for (phase, key), rs in groups.items():
        worst = max(rs, key=lambda r: (not r.ok, r.err / r.tol))
        out = next((r for r in rs if r.name.endswith(".l_out")), None)
        t.add_row(phase, "" if rs[0].layer is None else str(rs[0].layer),
                  "" if out is None else f"{out.err:.2e}", worst.name, f"{worst.err:.2e}", f"{worst.tol:.0e}",
                  verdict(rs))
    console.print(t)
    for phase, g in report.argmax.items():
        differ = "" if g.gpu == g.ref else "  differ: a near-tie (reported)" if g.near else "  [red]DIFFER[/red]"
        console.print(f"{phase}: greedy token GPU {g.gpu}, reference {g.ref}{differ}")
    bad = report.first_bad
    if bad is not None:
        console.print(f"[red]FAIL[/red]: first op over tolerance: {bad.phase} {bad.name} "
                      f"(error {bad.err:.2e} > {bad.tol:.0e})")
    elif not report.passed:
        console.print("[red]FAIL[/red]: " + ("nothing compared" if not report.rows else "greedy tokens differ"))
    else:
        n = sum(1 for r in report.rows if checked(r.name))
        console.print(f"PASS: residual stream and logits within tolerance ({n} checks), greedy tokens agree")
