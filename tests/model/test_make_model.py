"""Synthetic model generator: metadata types (MODEL.md §3), tensor tables (§4), init rules and
variants (§9), shape-8L sizes, and that llama.cpp loads the files and reads layouts as meant."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType as VT
from gguf.quants import dequantize

from vkflash.errors import ConfigError
from vkflash.formats.gguf_file import GGUFFile
from vkflash.model import make_model as mm
from vkflash.model import ple_hash

SEED = int(np.random.default_rng().integers(0, 2**31))


def _tensors(path) -> dict:
    """name → ReaderTensor."""
    return {t.name: t for t in GGUFReader(path).tensors}


def _values(t) -> np.ndarray:
    """Dequantized float32 values in NumPy shape."""
    return dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))


@pytest.fixture(scope="module")
def q4e(tmp_path_factory):
    """Default tiny qwen4exp with its MTP-only file."""
    return mm.make_model("qwen4exp", "tiny", None, SEED, tmp_path_factory.mktemp("m") / "q4e.gguf", mtp_separate=True)


def test_qwen4exp_metadata_types(q4e):
    """Keys exist with the exact types of §3 and the PLE constants of the HF derivation."""
    f = GGUFReader(q4e[0]).fields
    A = "qwen4exp."
    for k in ("context_length", "embedding_length", "block_count", "vocab_size", "expert_count",
              "attention.head_count", "attention.key_length", "ssm.time_step_rank", "hyper_connection.count",
              "attention.indexer.top_k", "ple.ngram_size", "ple.eos_token_id", "embedding_length_per_layer_input"):
        assert f[A + k].types == [VT.UINT32], k
    assert f[A + "block_count"].contents() == 8 and A + "nextn_predict_layers" not in f
    assert f[A + "attention.compress_ratios"].types == [VT.ARRAY, VT.INT32]
    assert f[A + "attention.compress_ratios"].contents() == [0, 0, 0, 4, 0, 0, 0, 4]
    assert f[A + "ple.layers"].types == [VT.ARRAY, VT.INT32] and f[A + "ple.layers"].contents() == [1]
    hp = ple_hash.make_params(512, 3, 2, 2, 1009)
    for key, want in (("layer_multipliers", hp.multipliers), ("head_offsets", hp.head_offsets),
                      ("head_vocab_sizes", hp.head_vocab_sizes)):
        assert f[A + "ple." + key].types == [VT.ARRAY, VT.UINT64]
        assert f[A + "ple." + key].contents() == [int(x) for x in want]
    assert f[A + "attention.layer_norm_rms_epsilon"].types == [VT.FLOAT32]
    assert f["tokenizer.ggml.model"].contents() == "gpt2" and len(f["tokenizer.ggml.tokens"].contents()) == 512
    assert "enable_thinking" in f["tokenizer.chat_template"].contents()


def test_qwen4exp_tensor_table(q4e):
    """§4 shapes; GDN at layers 0–2, 4–6; PLE at layer 1; table rows cover every head; MTP file alone."""
    g = mm.GEOMETRIES[("qwen4exp", "tiny")]
    ts = _tensors(q4e[0])
    sh = {n: [int(x) for x in t.shape] for n, t in ts.items()}
    assert sh["token_embd.weight"] == [g.d, g.V] and sh["output.weight"] == [g.d, g.V]
    assert sh["blk.0.attn_qkv.weight"] == [g.d, g.C] and sh["blk.3.attn_q.weight"] == [g.d, 2 * g.H * g.Dh]
    assert sh["blk.7.indexer.q_proj.weight"] == [g.d, g.n_I * g.D_I]
    assert sh["blk.2.ffn_down_exps.weight"] == [g.F, g.d, g.E]
    assert sh["blk.1.ple_key.weight"] == [g.d, g.hc * g.d] and sh["blk.1.ple_conv1d.weight"] == [g.K_p, g.hc * g.d]
    assert {n.split(".")[1] for n in ts if "ple_" in n} == {"1"}
    assert {int(n.split(".")[1]) for n in ts if ".ssm_a" in n} == {0, 1, 2, 4, 5, 6}
    rows = sh["per_layer_token_embd.weight"][1]
    assert rows % 128 == 0 and rows >= 3041 + 1021
    mtp = GGUFReader(q4e[1])
    assert mtp.fields["qwen4exp.block_count"].contents() == 9
    assert mtp.fields["qwen4exp.nextn_predict_layers"].contents() == 1
    assert "qwen4exp.ple.layers" not in mtp.fields
    assert all(t.name.startswith("blk.8.") for t in mtp.tensors)
    assert {"blk.8.nextn.eh_proj.weight", "blk.8.hc_attn_inject.weight", "blk.8.indexer.k_proj.weight"} <= {
        t.name for t in mtp.tensors}


def test_mtp_block_in_the_model_file(q4e, tmp_path):
    """--mtp: block_count 9 and nextn_predict_layers 1 with the PLE keys kept, the trunk and the MTP
    block both in the file, the same tensors (bytes) as the trunk file plus the MTP-only file."""
    path = mm.make_model("qwen4exp", "tiny", None, SEED, tmp_path / "in.gguf", mtp_block=True)[0]
    f = GGUFReader(path)
    assert f.fields["qwen4exp.block_count"].contents() == 9
    assert f.fields["qwen4exp.nextn_predict_layers"].contents() == 1
    assert f.fields["qwen4exp.ple.layers"].contents() == [1]
    both = {**_tensors(q4e[0]), **_tensors(q4e[1])}
    mine = _tensors(path)
    assert mine.keys() == both.keys()
    assert all(np.array_equal(mine[n].data, both[n].data) for n in mine)
    with pytest.raises(ConfigError, match="no HC, PLE, QSA or MTP"):
        mm.make_model("qwen3next", "tiny", None, SEED, tmp_path / "n.gguf", mtp_block=True)


def test_init_rules(q4e):
    """§9 init: folded gains 1±0.1, ssm_norm, ssm_a, dt_bias, ple_conv std 0.3, router ×4, matrices 1/√fan_in."""
    ts = _tensors(q4e[0])
    gain = _values(ts["blk.3.attn_q_norm.weight"])
    assert np.all(np.abs(gain - 1) <= 0.1) and gain.std() > 0.03
    assert np.all((_values(ts["blk.0.ssm_norm.weight"]) >= 0.9) & (_values(ts["blk.0.ssm_norm.weight"]) <= 1.1))
    a = _values(ts["blk.0.ssm_a"])
    assert np.all((a <= -0.05) & (a >= -1))
    dt = _values(ts["blk.0.ssm_dt.bias"])
    assert np.all((dt >= 0.5) & (dt <= 1.5))
    assert abs(_values(ts["blk.1.ple_conv1d.weight"]).std() - 0.3) < 0.03
    w = _values(ts["blk.0.ssm_out.weight"])
    assert abs(w.std() * np.sqrt(w.shape[1]) - 1) < 0.1
    r = _values(ts["blk.0.ffn_gate_inp.weight"])
    assert abs(r.std() * np.sqrt(r.shape[1]) - 4) < 0.4


def test_indexer_rank1_trick(q4e, tmp_path):
    """Embeddings share a 6·b component; W_Ik has a 0.5·a·bᵀ term on un-rotated dims; tie_stress has none."""
    g = mm.GEOMETRIES[("qwen4exp", "tiny")]
    emb = _values(_tensors(q4e[0])["token_embd.weight"])
    r1 = mm.Rank1.make(SEED, g)
    assert np.all(r1.a[:g.n_rot] == 0) and abs(np.linalg.norm(r1.a) - 1) < 1e-12
    assert np.linalg.norm(emb.mean(axis=0) - 6 * r1.b) < 1.0  # rows are 6·b + N(0, 1/d) noise
    wk = _values(_tensors(q4e[0])["blk.3.indexer.k_proj.weight"])
    assert abs(r1.a @ wk @ r1.b - 0.5) < 0.4  # noise std of aᵀWb is 1/√d ≈ 0.09
    assert abs((wk - 0.5 * np.outer(r1.a, r1.b)).std() * np.sqrt(g.d) - 1) < 0.1
    p = mm.make_model("qwen4exp", "tiny", None, SEED, tmp_path / "ts.gguf", variant="tie_stress")[0]
    assert np.linalg.norm(_values(_tensors(p)["token_embd.weight"]).mean(axis=0)) < 1


def test_deterministic_per_seed(tmp_path):
    """Same seed → identical file; another seed → other weights."""
    a = mm.make_model("qwen3next", "tiny", None, SEED, tmp_path / "a.gguf")[0].read_bytes()
    b = mm.make_model("qwen3next", "tiny", None, SEED, tmp_path / "b.gguf")[0].read_bytes()
    c = mm.make_model("qwen3next", "tiny", None, SEED + 1, tmp_path / "c.gguf")[0].read_bytes()
    assert a == b and a != c and len(a) == len(c)


def test_variants_and_quants(q4e, tmp_path):
    """Variants change only what they name; quant options pick the documented types."""
    p = mm.make_model("qwen4exp", "tiny", "Q8_0", SEED, tmp_path / "v.gguf",
                      variant="tied,f_array,hc_norm_2d,ple_conv_f16,dense")[0]
    r = GGUFReader(p)
    ts = {t.name: t for t in r.tensors}
    assert "output.weight" not in ts
    assert r.fields["qwen4exp.expert_feed_forward_length"].contents() == [64] * 8
    assert r.fields["qwen4exp.attention.compress_ratios"].contents() == [0] * 8
    assert [int(x) for x in ts["blk.0.hc_attn_norm.weight"].shape] == [128, 4]
    assert ts["blk.1.ple_conv1d.weight"].tensor_type == QT.F16
    assert ts["blk.0.attn_qkv.weight"].tensor_type == QT.Q8_0 and ts["blk.0.ssm_a"].tensor_type == QT.F32
    base = _tensors(q4e[0])
    np.testing.assert_array_equal(np.asarray(ts["blk.0.hc_attn_norm.weight"].data).ravel(),
                                  np.asarray(base["blk.0.hc_attn_norm.weight"].data).ravel())
    mix = _tensors(mm.make_model("qwen4exp", "tiny", "mix", SEED, tmp_path / "m.gguf")[0])
    assert mix["blk.0.ffn_gate_exps.weight"].tensor_type == QT.Q4_0
    assert mix["blk.0.ffn_down_exps.weight"].tensor_type == QT.Q5_0
    assert mix["token_embd.weight"].tensor_type == QT.F16
    assert mix["blk.0.hc_attn_up.weight"].tensor_type == QT.F32  # ne0 = 16 is not a block multiple
    with pytest.raises(ConfigError):
        mm.make_model("qwen4exp", "tiny", "Q4_K", SEED, tmp_path / "x.gguf")
    with pytest.raises(ConfigError):
        mm.make_model("qwen3next", "tiny", None, SEED, tmp_path / "x.gguf", variant="hc_norm_2d")


def test_ssm_in_and_ba_layouts_are_the_same_weights(tmp_path):
    """Legacy ssm_in regroups attn_qkv/attn_gate rows per K-head group; ssm_ba interleaves β/α per group."""
    g = mm.GEOMETRIES[("qwen3next", "tiny")]
    new = _tensors(mm.make_model("qwen3next", "tiny", None, SEED, tmp_path / "n.gguf")[0])
    old = _tensors(mm.make_model("qwen3next", "tiny", None, SEED, tmp_path / "o.gguf", variant="ssm_in")[0])
    qkv, z = _values(new["blk.0.attn_qkv.weight"]), _values(new["blk.0.attn_gate.weight"])
    fused = _values(old["blk.0.ssm_in.weight"]).reshape(g.n_k, -1, g.d)
    rho, S = g.n_v // g.n_k, g.S
    j = int(np.random.default_rng().integers(0, g.n_k))
    np.testing.assert_array_equal(fused[j, :S], qkv[j * S:(j + 1) * S])
    np.testing.assert_array_equal(fused[j, S:2 * S], qkv[g.n_k * S + j * S:g.n_k * S + (j + 1) * S])
    np.testing.assert_array_equal(fused[j, 2 * S:2 * S + rho * S], qkv[2 * g.n_k * S + j * rho * S:][:rho * S])
    np.testing.assert_array_equal(fused[j, 2 * S + rho * S:], z[j * rho * S:(j + 1) * rho * S])
    assert "blk.0.attn_qkv.weight" not in old


@pytest.mark.oracle
def test_llama_cpp_loads_and_reads_layouts_alike(tmp_path, llama_oracle):
    """llama.cpp loads tiny F32 files of both archs; equivalent layouts give identical greedy ids and
    top-5 logprobs over 4 steps (prompt ids below 500 are ordinary BPE tokens; the specials sit at 507+)."""
    prompt = [int(x) for x in np.random.default_rng().integers(0, 500, 12)]
    why = f"seed {SEED}, prompt {prompt}"

    def run(path):
        with llama_oracle(path) as o:
            try:
                steps = o.complete(prompt, 4)
            except AssertionError as e:
                raise AssertionError(f"{path.name}, {why}\n{e}") from None
        assert len(steps) == 4, why
        return steps

    def same(x, y):
        """Same ids everywhere and logprobs within 1e-4 (they come out bit-identical; a tolerance
        rather than rounding, which would split two values lying either side of a rounding boundary)."""
        (ix, lx), (iy, ly) = ([[[s["id"]] + [t["id"] for t in s["top_logprobs"]] for s in st],
                               [[t["logprob"] for t in s["top_logprobs"]] for s in st]] for st in (x, y))
        return ix == iy and np.allclose(lx, ly, rtol=0, atol=1e-4)

    a = run(mm.make_model("qwen3next", "tiny", None, SEED, tmp_path / "n.gguf")[0])
    b = run(mm.make_model("qwen3next", "tiny", None, SEED, tmp_path / "o.gguf", variant="ssm_in")[0])
    assert same(a, b), (why, a, b)
    c = run(mm.make_model("qwen4exp", "tiny", None, SEED, tmp_path / "f.gguf")[0])
    d = run(mm.make_model("qwen4exp", "tiny", None, SEED, tmp_path / "w.gguf", variant="hc_norm_2d,f_array")[0])
    assert same(c, d), (why, c, d)


def test_shape8l_sizes_and_types():
    """§9 shape-8L: ≈ 27.2 B parameters and ≈ 16.5 GB (trunk + MTP file) with the §8 type
    assumption; 16,001,920 PLE rows."""
    g = mm.GEOMETRIES[("qwen4exp", "shape-8L")]
    spec = mm.trunk_spec("qwen4exp", g, frozenset())
    spec.tensors += mm.mtp_spec(g, frozenset()).tensors
    types = {t.name: mm.shape8l_type(t) for t in spec.tensors}
    n = sum(t.n for t in spec.tensors)
    size = sum(mm.replace(t, qtype=types[t.name]).nbytes for t in spec.tensors)
    assert abs(n / 27.2e9 - 1) < 0.01 and abs(size / 16.5e9 - 1) < 0.03
    assert [t.ne for t in spec.tensors if t.name == "per_layer_token_embd.weight"] == [(160, 16001920)]
    assert types["blk.0.ffn_gate_exps.weight"] == QT.Q4_K and types["blk.0.ffn_down_exps.weight"] == QT.Q5_0
    assert types["blk.0.attn_qkv.weight"] == QT.Q5_K and types["blk.3.attn_v.weight"] == QT.Q6_K
    assert types["blk.0.hc_ffn_up.weight"] == QT.Q5_0 and types["blk.0.ffn_gate_inp.weight"] == QT.F32
    assert types["output.weight"] == QT.Q6_K and types["per_layer_token_embd.weight"] == QT.Q4_0


@pytest.mark.parametrize("qt", [QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K])
def test_random_blocks_have_the_target_scale(qt):
    """Random codes with fixed scales dequantize to std ≈ 1/√ne0 and a small mean (Q4_0/Q5_0
    codes are asymmetric, −0.1·std), and chunk exactly."""
    ne0 = 256 * int(np.random.default_rng().integers(1, 12))
    t = mm.Tensor("blk.0.x.weight", (ne0, 300), "mat", qtype=qt)
    chunks = list(mm.random_block_chunks(t, SEED))
    raw = np.concatenate([c.ravel() for c in chunks])
    assert raw.nbytes == t.nbytes
    w = dequantize(raw, qt).astype(np.float64)
    assert np.all(np.isfinite(w))
    assert abs(w.std() * np.sqrt(ne0) - 1) < 0.05 and abs(w.mean()) * np.sqrt(ne0) < 0.12


def test_shape48l_is_the_real_geometry_and_writes_sparse(tmp_path):
    """shape-48L: MODEL.md §8's 176.944 B trunk and 2.607 B MTP parameters, the real 320,001,536 PLE
    rows; --quant Q8_0 makes every quantized tensor Q8_0; a sparse file has the full length, reads
    back its header and stores almost nothing."""
    g = mm.GEOMETRIES[("qwen4exp", "shape-48L")]
    trunk, mtp = mm.trunk_spec("qwen4exp", g, frozenset()), mm.mtp_spec(g, frozenset())
    assert abs(sum(t.n for t in trunk.tensors) / 176.944e9 - 1) < 1e-4
    assert abs(sum(t.n for t in mtp.tensors) / 2.607e9 - 1) < 1e-3
    assert [t.ne for t in trunk.tensors if t.name == "per_layer_token_embd.weight"] == [(160, 320001536)]
    q8 = {mm.shape8l_type(t, "Q8_0") for t in mtp.tensors}
    assert q8 == {QT.Q8_0, QT.F32}
    paths = mm.make_model("qwen4exp", "shape-8L", "Q8_0", SEED, tmp_path / "s.gguf", mtp_separate=True, sparse=True)
    for p in paths:
        f = GGUFFile(p)
        end = max(t.offset + t.nbytes for t in f.tensors.values())
        assert p.stat().st_size >= end and p.stat().st_blocks * 512 < 64 << 20
    assert {t.ggml_type for t in GGUFFile(paths[1]).tensors.values()} == {QT.Q8_0, QT.F32}
    with pytest.raises(ConfigError, match="--quant"):
        mm.make_model("qwen4exp", "shape-8L", "mix", SEED, tmp_path / "x.gguf", sparse=True)
