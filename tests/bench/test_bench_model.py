"""`vkflash bench model --quick` on a tiny random qwen2 (lavapipe): every row kind, the decode
graph's counts, host + GPU time adding up to the step, and the bytes-per-token model of the
roofline checked against the file. Speeds themselves are never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from typer.testing import CliRunner

from engine.qwen2_tiny import Geometry, write_qwen2
from vkflash import cli
from vkflash.bench.model import Plan, state_bytes_per_token, weight_bytes_per_token
from vkflash.engine.gpu_forward import GpuForward
from vkflash.engine.graphs.common import Head
from vkflash.formats.gguf_file import GGUFFile

pytestmark = pytest.mark.gpu

GEO = Geometry(d=64, H=2, H_kv=1, Dh=32, F=96, V=300, L=2)
UB = 16


def _model(tmp_path: Path, rng: np.random.Generator, tied: bool = False, n_ctx_train: int = 4096) -> Path:
    path = tmp_path / "m.gguf"
    write_qwen2(path, rng, GEO, Q.Q8_0, tied=tied, n_ctx_train=n_ctx_train)
    return path


def _bench(path: Path, *extra: str) -> dict:
    r = CliRunner().invoke(cli.app, ["bench", "model", str(path), "--quick", "--json", "--ub", str(UB), *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_quick_produces_every_row(gpu, tmp_path, rng):
    """pp at two sizes, tg, and per depth its window, pp and tg rows; decode cost consistent."""
    path = _model(tmp_path, rng)
    res = _bench(path)
    p = Plan.quick()
    want = [f"pp{n}" for n in p.pp] + [f"tg{p.tg}"]
    pos = 0
    for d in p.depths:
        if d > pos:
            want.append(f"window {pos}→{d}")
        want += [f"pp{p.window} @ d{d}", f"tg{p.tg} @ d{d + p.window}"]
        pos = d + p.window + p.tg
    rows = res["rows"]
    assert [r["name"] for r in rows] == want
    for r in rows:
        assert r["seconds"] > 0 and r["tok_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert (r["roofline"] is not None) == r["name"].startswith("tg")
        if r["roofline"] is not None:
            assert r["roofline"] > 0
        # the depth-0 rows and the windows prefilled at depth (after an untimed one) are timed p.reps times
        repeated = r["name"].startswith("pp") and (r["depth"] <= 1 or "@" in r["name"]) or r["name"] == f"tg{p.tg}"
        assert (r["spread"] is not None) == repeated, r["name"]
        if repeated:
            assert r["spread"][0] <= r["tok_per_s"] * (1 + 1e-9) and r["tok_per_s"] <= r["spread"][1] * (1 + 1e-9)
    assert 0 < res["longest_submission_ms"] and res["budget_ms"] == gpu.options.submit_budget_ms
    fwd = GpuForward(path, ctx=p.context(), ub=UB, gpu=gpu)
    g = fwd.graph(1, Head.LAST)
    dec = res["decode"]
    assert dec["dispatches"] == len(g.ops) and dec["submissions"] == 1
    assert 0 < dec["gpu_us"] <= dec["step_us"]
    assert dec["host_us"] == pytest.approx(dec["step_us"] - dec["gpu_us"])
    assert res["copy_gbps"] > 0 and res["weight_bytes"] == weight_bytes_per_token(fwd)


@pytest.mark.parametrize("tied", [False, True])
def test_bytes_per_decode_token(gpu, tmp_path, rng, tied):
    """Weights: every tensor of the file once, but only one row of an embedding table that is not the
    LM head. K/V at depth ℓ (f16): K and V rows of ℓ+1 cells in every layer; no recurrent state."""
    path = _model(tmp_path, rng, tied=tied)
    fwd = GpuForward(path, ctx=256, ub=UB, kv="f16", gpu=gpu)
    f = GGUFFile(path)
    emb = f.tensors["token_embd.weight"].data.nbytes
    others = sum(t.data.nbytes for n, t in f.tensors.items() if n != "token_embd.weight")
    assert weight_bytes_per_token(fwd) == others + (emb if tied else emb // GEO.V)
    depth = int(rng.integers(0, 255))
    assert state_bytes_per_token(fwd, depth) == GEO.L * 2 * (depth + 1) * GEO.H_kv * GEO.Dh * 2


def test_host_tables_are_not_uploaded_nor_counted(gpu, tmp_path, rng):
    """qwen4exp's PLE n-gram table stays in the file (its rows are gathered on the host): it is not on
    the GPU and not among the bytes a decode token reads."""
    from vkflash.model.make_model import make_model

    path = make_model("qwen4exp", "tiny", "F32", int(rng.integers(1 << 31)), tmp_path / "q4.gguf")[0]
    fwd = GpuForward(path, ctx=64, ub=UB, gpu=gpu)
    assert fwd.model.weights.get("per_layer_token_embd.weight") is None
    table = GGUFFile(path).tensors["per_layer_token_embd.weight"].data.nbytes
    assert weight_bytes_per_token(fwd) < sum(t.data.nbytes for t in GGUFFile(path).tensors.values()) - table


def test_profile_groups_the_decode_step(gpu, tmp_path, rng):
    """--profile: every decode dispatch counted once per token under its name without `blk.N.`; the
    same for one prefill step of the first pp row at depth 0 and of the window at the deepest depth
    (one step each: --ub 16, pp16, window 16), whose attention sees the keys it must."""
    path = _model(tmp_path, rng)
    res = _bench(path, "--profile", "--depth", "0,32")
    prof = res["profile"]
    assert sum(calls for calls, _ in prof.values()) == res["decode"]["dispatches"]
    assert set(res["prefill_profiles"]) == {"pp16", "pp16 @ d32"}, list(res["prefill_profiles"])
    for p in [prof, *res["prefill_profiles"].values()]:
        assert all(not name.startswith("blk.") and us >= 0 for name, (_, us) in p.items())
        assert p["attn_norm [norm]"][0] == GEO.L
        assert sum(us for _, us in p.values()) > 0
    assert {r["name"] for r in res["rows"]} >= {"pp16 @ d32", "tg8 @ d48"}


def test_depths_past_the_context_are_skipped(gpu, tmp_path, rng):
    """A depth whose rows would not fit the model's training context gives no rows."""
    path = _model(tmp_path, rng, n_ctx_train=128)
    names = [r["name"] for r in _bench(path, "--depth", "0,40,1000")["rows"]]
    assert "pp16 @ d40" in names and not any("d1000" in n for n in names)


def test_table_and_bad_depth(gpu, tmp_path, rng):
    """Without --json: the rates table and the per-token table; a malformed --depth is one error line."""
    path = _model(tmp_path, rng)
    r = CliRunner().invoke(cli.app, ["bench", "model", str(path), "--quick", "--ub", str(UB), "--depth", "0"])
    assert r.exit_code == 0, r.output
    for label in ("roofline", "tg8 @ d16", "dispatches", "host share of the step", "weight bytes read"):
        assert label in r.stdout, label
    bad = CliRunner().invoke(cli.app, ["bench", "model", str(path), "--quick", "--depth", "0,x"])
    assert bad.exit_code == 1 and bad.stderr.startswith("error: --depth")


def test_mtp_rows(gpu, tmp_path, rng):
    """--mtp --quick on a tiny qwen4exp with its MTP block: per depth a plain row and one row per
    agreement probability, one timed run each (the speculative output is checked against the plain one inside); with
    every draft agreeing, rounds carry more than one token; a bad --accept is one error line."""
    from vkflash.model.make_model import make_model

    path = make_model("qwen4exp", "tiny", "F32", int(rng.integers(1 << 31)), tmp_path / "q.gguf", mtp_block=True)[0]
    r = CliRunner().invoke(cli.app, ["bench", "model", str(path), "--quick", "--json", "--ub", str(UB), "--mtp",
                                     "--depth", "0,40", "--accept", "0,1"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert [(x["depth"], x["accept"]) for x in rows] == [(0, None), (0, 0.0), (0, 1.0), (40, None), (40, 0.0),
                                                         (40, 1.0)]
    assert all(x["tokens"] == Plan.quick().tg and len(x["rates"]) == 1 and x["tok_per_s"] == x["rates"][0] > 0
               for x in rows)
    full = [x for x in rows if x["accept"] == 1.0]
    assert all(x["accepted"] == x["drafted"] and x["rounds"] < x["tokens"] for x in full)
    bad = CliRunner().invoke(cli.app, ["bench", "model", str(path), "--quick", "--mtp", "--accept", "2"])
    assert bad.exit_code == 1 and bad.stderr.startswith("error: --accept")
