"""The memory plan (engine/plan.py) against what the GPU layer really allocates: the planner builds
the forward on a planning Gpu without the weights' data, the test builds the real one and runs a
prompt; per part and in total the bytes agree (within 1%) at boot and at depth, on the tiny archs
and (given VKFLASH_SHAPE_MODEL, on a big GPU) a shape config; nothing is held outside the parts.
A sparse file (header only) plans like the real one; `vkflash plan` prints and says what fits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fakes import ByteCodec
from qwen2_tiny import Geometry, write_qwen2
from vkflash.cli import app
from vkflash.engine.api import SamplingParams
from vkflash.engine.generate import generate
from vkflash.engine.gpu_forward import GpuForward
from vkflash.engine.guard import GuardConfig, Kind
from vkflash.engine.plan import DraftFiles, Part, Usage, make_plan, usage
from vkflash.engine.speculate import Speculator
from vkflash.formats.gguf_file import GGUFFile
from vkflash.errors import ConfigError
from vkflash.gpu.budget import Budget
from vkflash.gpu.memory import buffer_limit
from vkflash.model.make_model import make_model

pytestmark = pytest.mark.gpu
NO_GUARD = GuardConfig(enabled=True, budget=Budget(0, "none"))


def _tiny(arch: str, tmp_path: Path, rng: np.random.Generator) -> Path:
    if arch == "qwen2":
        path = tmp_path / "qwen2.gguf"
        write_qwen2(path, rng, Geometry(d=96, H=3, H_kv=1, Dh=32, F=160, V=301, L=2))
        return path
    return make_model(arch, "tiny", "F32", int(rng.integers(1 << 31)), tmp_path / f"{arch}.gguf")[0]


def _close(plan: Usage, real: Usage, what: str) -> None:
    """Every part and the total within 1% (they are the same code: equal in practice)."""
    for p in Part:
        a, b = plan.parts[p], real.parts[p]
        assert abs(a - b) <= 0.01 * max(a, b), f"{what}: {p.value} planned {a} B, allocated {b} B"
    assert abs(plan.total - real.total) <= 0.01 * real.total, f"{what}: total {plan.total} vs {real.total}"
    assert real.unaccounted == 0, f"{what}: {real.unaccounted} B held outside every part"


def _compare(gpu, path: Path, ctx: int, ub: int, depth: int, vocab: int) -> None:
    """Plan at 0 and `depth`; the real forward after reserve() and after a prompt of `depth` tokens."""
    plan = make_plan(path, ctx=ctx, ub=ub, kv="f16", guard=NO_GUARD, depths=(0, depth), options=gpu.options)
    row = next(r for r in plan.rows if r.depth == depth)
    fresh = gpu.with_options(gpu.options, own_arena=True)
    fwd = GpuForward(path, ctx=ctx, ub=ub, kv="f16", gpu=fresh, guard=NO_GUARD)
    fwd.reserve()
    _close(plan.boot.usage, usage(fwd), "boot")
    fwd.prefill(np.random.default_rng().integers(0, vocab, depth))
    assert fwd.guard.held == row.held
    _close(row.usage, usage(fwd), f"depth {depth}")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3next", "qwen4exp"])
def test_plan_equals_allocation_on_tiny_archs(gpu, rng, tmp_path, arch):
    """A 130-token prompt (caches grown over two chunks), ubatch 32: every part as planned."""
    path = _tiny(arch, tmp_path, rng)
    _compare(gpu, path, 512, 32, 130, 301 if arch == "qwen2" else 512)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("VKFLASH_SHAPE_MODEL"), reason="set VKFLASH_SHAPE_MODEL to a shape-8L file")
def test_plan_equals_allocation_on_a_shape_config(gpu):
    """The real shapes (`make-model --config shape-8L`), 32k context, UB 2048: boot and 4096 tokens."""
    path = Path(os.environ["VKFLASH_SHAPE_MODEL"])
    _compare(gpu, path, 32768, 2048, 4096, GGUFFile(path).tensors["token_embd.weight"].ne[1])


def test_sparse_file_plans_without_data(tmp_path):
    """A shape-8L file written as a header with a hole for its data plans completely: the weights
    are the header's bytes as uploaded (1-D as f32), the PLE table is mmapped, the rows grow."""
    path = make_model("qwen4exp", "shape-8L", None, 1, tmp_path / "s8.gguf", sparse=True)[0]
    assert os.stat(path).st_blocks * 512 < 64 << 20, "the data should be a hole"
    plan = make_plan(path, ctx=65536, ub=512, guard=NO_GUARD, suggest=False)
    gf = GGUFFile(path)
    ple = gf.tensors["per_layer_token_embd.weight"].nbytes
    stored = sum(4 * t.n_elements if len(t.ne) == 1 else t.nbytes for t in gf.tensors.values()) - ple
    assert plan.mmapped == ple
    assert abs(plan.boot.usage.parts[Part.WEIGHTS] - stored) <= 0.001 * stored
    kv = [r.usage.parts[Part.KV] for r in plan.rows]
    assert plan.fill_fits and kv == sorted(kv) and kv[-1] == 2 * 2 * 65536 * 2 * 256 * 2  # 2 layers, K+V, f16


def test_ctx_past_the_largest_buffer_is_one_clear_error(gpu, tmp_path):
    """A CTX whose K/V cache of one layer would not fit one buffer the device can index is a
    ConfigError naming the largest CTX that does (planning builds the caches the boot would); that
    CTX itself plans (how deep it fills is the memory budget's business)."""
    path = make_model("qwen4exp", "shape-8L", None, 1, tmp_path / "s8.gguf", sparse=True)[0]
    most = buffer_limit(gpu.caps) // (2 * 256 * 2)  # H_kv 2 × Dh 256 × f16 per position
    with pytest.raises(ConfigError, match=f"CTX {most + 1}: the cache 'blk.3.cache_k' .* CTX {most} at most here"):
        make_plan(path, ctx=most + 1, ub=512, guard=NO_GUARD, suggest=False)
    assert make_plan(path, ctx=most, ub=512, guard=NO_GUARD, suggest=False).rows


def test_plan_command(rng, tmp_path):
    """`vkflash plan` prints the table and the fit lines; --json has every row; a budget below the
    weights does not boot and names what would fit (nothing here: the summary says so)."""
    path = _tiny("qwen2", tmp_path, rng)
    runner = CliRunner()
    r = runner.invoke(app, ["plan", str(path), "--ctx", "1024", "--ub", "64"])
    assert r.exit_code == 0, r.output
    assert "boot-fit: yes" in r.output and "fill-fit: yes" in r.output and "memory plan:" in r.output
    r = runner.invoke(app, ["plan", str(path), "--ctx", "1024", "--ub", "64", "--json"])
    data = json.loads(r.output)
    assert data["fill_fits"] and [row["depth"] for row in data["rows"]] == [0, 1024]
    r = runner.invoke(app, ["plan", str(path), "--ctx", "1024", "--mem", "64K"])
    assert r.exit_code == 0 and "boot-fit: NO" in r.output and "does NOT fit" in r.output


def test_plan_with_an_mtp_draft_equals_allocation(gpu, rng, tmp_path):
    """`make_plan(draft=…)` builds the speculator's forward and the real draft head (the model's own
    MTP block, MODEL_DRAFT_SMALL its Q8_0 quant) on the planning Gpu. GUARD_DRAFT=64 and GUARD_UB=96
    with context 512, UB 32: a 130-token prompt (steps of 32: whole ubatches pending when UB halves)
    then greedy speculation; at boot, after the prompt and after the rounds every part is as
    planned, the draft's weights its smaller quant's, and the guard took the same steps."""
    seed = int(rng.integers(1 << 31))
    path = make_model("qwen4exp", "tiny", "F32", seed, tmp_path / "m.gguf", mtp_block=True)[0]
    small = make_model("qwen4exp", "tiny", "Q8_0", seed, tmp_path / "q.gguf", mtp_separate=True)[1]
    cfg = GuardConfig(when={Kind.DRAFT: 64, Kind.KV: "off", Kind.UB: 96}, budget=Budget(0, "none"))
    plan = make_plan(path, ctx=512, ub=32, kv="f16", guard=cfg, draft=DraftFiles(None, small), depths=(0, 130, 192),
                     options=gpu.options)
    sp = Speculator.open(path, None, small, ctx=512, ub=32, kv="f16", gpu=gpu.with_options(gpu.options, own_arena=True),
                         guard=cfg)
    sp.fwd.reserve()
    _close(plan.boot.usage, usage(sp.fwd), "boot")
    prompt = [int(t) for t in rng.integers(0, 512, 130)]
    sp.prefill(prompt)
    assert sp.fwd.guard.held == 192 and [e.kind for e in sp.fwd.guard.events] == [Kind.DRAFT, Kind.UB]
    row = next(r for r in plan.rows if r.depth == 192)
    _close(row.usage, usage(sp.fwd), "after the prompt")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    list(generate(sp, ByteCodec(eog=-1), prompt, params, ubatch=32))
    assert sp.drafted > 0 and sp.fwd.n_past < 192
    _close(row.usage, usage(sp.fwd), "after speculation")
    assert [e.kind for e in plan.events] == [Kind.DRAFT, Kind.UB] and sp.drafter.shrunk
