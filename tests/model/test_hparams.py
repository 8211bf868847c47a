"""hparams_from_metadata / validate_tensors: §3 and §4 rules, each failure one line naming the key."""

from __future__ import annotations

import numpy as np
import pytest

from tiny_models import tiny_arrays, tiny_meta
from vkflash.errors import ModelError
from vkflash.model.hparams import hparams_from_gguf, hparams_from_metadata
from vkflash.model.tensors import tensor_table, validate_tensors
from vkflash.model.weights import ArraySource, GGUFSource, load_model, load_weights


def test_tiny_qwen4exp_values():
    hp = hparams_from_metadata(tiny_meta("qwen4exp"))
    assert (hp.d, hp.V, hp.L, hp.H, hp.H_kv, hp.Dh, hp.n_rot) == (128, 512, 8, 6, 2, 64, 16)
    assert [i for i in range(8) if not hp.is_gdn[i]] == [3, 7]
    assert (hp.n_k, hp.n_v, hp.S, hp.rho, hp.C) == (2, 6, 32, 3, 2 * 2 * 32 + 6 * 32)
    assert hp.r == (0, 0, 0, 4, 0, 0, 0, 4) and hp.kb(3) == 8 and hp.W(3) == 35
    assert hp.ple_layer == 1 and hp.n_p == 4 and hp.ple_image == 3 and len(hp.ple_mult) == 3


def test_mtp_block_counts_and_is_never_gdn():
    hp = hparams_from_metadata(tiny_meta("qwen4exp", mtp=True))
    assert (hp.L_all, hp.L, hp.n_mtp) == (9, 8, 1)
    assert not hp.is_gdn[8] and hp.r[8] == 0


def test_recurrent_layers_replace_interval():
    mask = np.array([True, False, True, True, True, True, False, True])
    hp = hparams_from_metadata(tiny_meta("qwen3next", over={"attention.recurrent_layers": ("arr[bool]", mask)}))
    assert hp.is_gdn == tuple(bool(m) for m in mask)


def test_per_layer_expert_ff_array():
    arr = np.full(8, 64, np.uint32)
    hp = hparams_from_metadata(tiny_meta("qwen4exp", over={"expert_feed_forward_length": ("arr[u32]", arr)}))
    assert hp.F == 64


@pytest.mark.parametrize("arch,suffix", [
    ("qwen4exp", "embedding_length"), ("qwen4exp", "attention.layer_norm_rms_epsilon"),
    ("qwen4exp", "rope.dimension_sections"), ("qwen4exp", "hyper_connection.low_rank"),
    ("qwen4exp", "attention.indexer.top_k"), ("qwen4exp", "ple.ngram_size"), ("qwen4exp", "ple.layer_multipliers"),
    ("qwen3next", "ssm.state_size"), ("qwen3next", "attention.head_count"), ("qwen2", "feed_forward_length"),
])
def test_missing_required_key(arch, suffix):
    with pytest.raises(ModelError, match=f"missing required key {arch}.{suffix}"):
        hparams_from_metadata(tiny_meta(arch, drop=(suffix,)))


@pytest.mark.parametrize("suffix", ["ssm.conv_kernel", "hyper_connection.count", "attention.indexer.head_count",
                                    "full_attention_interval", "ple.conv_kernel"])
def test_nz_key_zero(suffix):
    with pytest.raises(ModelError, match=f"qwen4exp.{suffix}"):
        hparams_from_metadata(tiny_meta("qwen4exp", over={suffix: ("u32", 0)}))


@pytest.mark.parametrize("suffix,value,pattern", [
    ("attention.compress_ratios", ("arr[i32]", np.zeros(7, np.int32)), "7 entries, expected exactly 8"),
    ("expert_feed_forward_length", ("arr[u32]", np.full(9, 64, np.uint32)), "9 entries, expected exactly 8"),
    ("expert_feed_forward_length", ("arr[u32]", np.array([64] * 7 + [32], np.uint32)), "unequal"),
    ("rope.dimension_sections", ("arr[i32]", np.array([3, 3, 2], np.int32)), "expected exactly 4"),
    ("ple.head_offsets", ("arr[i64]", np.array([0, 1009, 2022, 3041], np.int64)), "array of u64"),
    ("embedding_length", ("i32", 128), "must be u32"),
    ("rope.scaling.type", ("str", "yarn"), "rope scaling"),
    ("rope.scaling.factor", ("f32", 4.0), "rope scaling"),
    ("hyper_connection.count", ("u32", 1), "must be > 1"),
    ("ple.layers", ("arr[i32]", np.array([3], np.int32)), "GDN layer"),
    ("ple.layers", ("arr[i32]", np.array([1, 2], np.int32)), "exactly one"),
    ("ple.ngram_size", ("u32", 9), "2..8"),
    ("embedding_length_per_layer_input", ("u32", 16), "must equal embedding_length"),
    ("attention.value_length", ("u32", 32), "must equal attention.key_length"),
    ("nextn_predict_layers", ("u32", 8), "must be < block_count"),
    ("attention.compress_ratios", ("u32", 128), "≤ 64"),
    ("block_count", ("u32", 513), "513 is more than 512"),
    ("block_count", ("u32", 2**32 - 1), "is more than 512"),  # not a 4-billion-entry tuple per layer key
    ("attention.layer_norm_rms_epsilon", ("f32", float("nan")), "= nan must be finite and > 0"),
    ("attention.layer_norm_rms_epsilon", ("f32", 0.0), "must be finite and > 0"),
    ("rope.freq_base", ("f32", -1e6), "must be finite and > 0"),
    ("rope.scaling.factor", ("str", "x"), "rope scaling"),  # not a float() ValueError
    ("rope.scaling.type", ("u32", 1), "rope scaling"),
    ("rope.dimension_count", ("u32", 0), "must be even, ≥ 2"),  # kernels rotate 2..Dh dims
    ("rope.dimension_count", ("u32", 48), "must be ≤ qwen4exp.attention.indexer.key_length = 32"),
    ("attention.indexer.top_k", ("u32", 30), "must be a multiple of qwen4exp.attention.compress_ratios"),
])
def test_invalid_values(suffix, value, pattern):
    with pytest.raises(ModelError, match=pattern) as info:
        hparams_from_metadata(tiny_meta("qwen4exp", over={suffix: value}))
    assert "\n" not in str(info.value)


def test_vocabulary_must_be_strings():
    """Without vocab_size, V comes from tokenizer.ggml.tokens, which must then be an array of str."""
    meta = tiny_meta("qwen2", drop=("vocab_size",))
    kv = dict(meta.kv, **{"tokenizer.ggml.tokens": ("u32", 7)})
    with pytest.raises(ModelError, match="tokenizer.ggml.tokens must be an array of str, found u32"):
        hparams_from_metadata(type(meta)(arch=meta.arch, kv=kv))
    kv["tokenizer.ggml.tokens"] = ("arr[str]", ["a", "b"])
    assert hparams_from_metadata(type(meta)(arch=meta.arch, kv=kv)).V == 2


def test_qwen3next_expert_count_zero():
    with pytest.raises(ModelError, match="qwen3next.expert_count"):
        hparams_from_metadata(tiny_meta("qwen3next", over={"expert_count": ("u32", 0)}))


def test_unknown_arch():
    meta = tiny_meta("qwen4exp")
    meta = type(meta)(arch="llama", kv=meta.kv)
    with pytest.raises(ModelError, match="'llama'.*qwen4exp, qwen3next, qwen2"):
        hparams_from_metadata(meta)


# ------------------------------------------------------------------------ tensor tables


@pytest.mark.parametrize("arch", ["qwen4exp", "qwen3next", "qwen2"])
def test_table_accepts_builder_and_rejects_damage(arch, rng):
    hp = hparams_from_metadata(tiny_meta(arch))
    arrays = tiny_arrays(hp, rng)
    validate_tensors(hp, ArraySource(arrays).shapes)
    table = tensor_table(hp, frozenset(arrays))[0]
    names = sorted(n for n in arrays if table[n].required)  # output.weight may go: the embedding is tied then
    victim = names[rng.integers(len(names))]
    broken = dict(arrays)
    del broken[victim]
    with pytest.raises(ModelError, match=f"missing tensor {victim}"):
        validate_tensors(hp, ArraySource(broken).shapes)
    broken = dict(arrays)
    broken[victim] = np.zeros(arrays[victim].shape[:-1] + (arrays[victim].shape[-1] + 1,), np.float32)
    with pytest.raises(ModelError, match=f"tensor {victim} has ne"):
        validate_tensors(hp, ArraySource(broken).shapes)
    broken = dict(arrays)
    broken["blk.0.something_else.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ModelError, match="unexpected tensor blk.0.something_else"):
        validate_tensors(hp, ArraySource(broken).shapes)


def test_alternative_forms(rng):
    hp = hparams_from_metadata(tiny_meta("qwen3next"))
    fused = frozenset({"blk.3.attn_qkv.weight", "blk.0.ssm_in.weight", "blk.1.ffn_gate_up_exps.weight"})
    arrays = tiny_arrays(hp, rng, names=fused)
    assert "blk.0.ssm_in.weight" in arrays and "blk.0.attn_qkv.weight" not in arrays
    assert "blk.3.attn_qkv.weight" in arrays and "blk.3.attn_q.weight" not in arrays
    assert "blk.1.ffn_gate_up_exps.weight" in arrays and "blk.1.ffn_up_exps.weight" not in arrays
    validate_tensors(hp, ArraySource(arrays).shapes)
    hp4 = hparams_from_metadata(tiny_meta("qwen4exp"))
    arrays = tiny_arrays(hp4, rng, names=frozenset({"blk.3.attn_qkv.weight"}))
    arrays["blk.3.attn_qkv.weight"] = np.zeros((2 * 6 * 64 + 2 * 2 * 64, 128), np.float32)
    with pytest.raises(ModelError, match="blk.3.attn_qkv"):  # qwen4exp cannot run a fused attention qkv
        validate_tensors(hp4, ArraySource(arrays).shapes)


def test_hc_norm_both_shapes(rng):
    hp = hparams_from_metadata(tiny_meta("qwen4exp"))
    arrays = tiny_arrays(hp, rng)
    flat = arrays["blk.2.hc_ffn_norm.weight"]
    arrays["blk.2.hc_ffn_norm.weight"] = flat.reshape(hp.hc, hp.d)  # {d, hc}
    w = load_weights(hp, ArraySource(arrays))
    assert np.array_equal(w.blocks[2].hc_ffn.norm, flat)


def test_mtp_split_file_and_tied_output(rng):
    hp = hparams_from_metadata(tiny_meta("qwen4exp", mtp=True))
    full = tiny_arrays(hp, rng, mtp_block=True)
    trunk = {n: a for n, a in full.items() if not n.startswith("blk.8.")}
    del trunk["output.weight"]
    w = load_weights(hp, ArraySource(trunk))
    assert w.mtp is None and w.output is w.token_embd and len(w.blocks) == hp.L
    mtp_only = {n: a for n, a in full.items() if n.startswith("blk.8.")}
    w = load_weights(hp, ArraySource(mtp_only))
    assert w.mtp is not None and w.mtp.embed is None and w.blocks == []
    partial = dict(mtp_only)
    del partial["blk.8.nextn.eh_proj.weight"]
    with pytest.raises(ModelError, match="missing tensor blk.8.nextn.eh_proj.weight"):
        load_weights(hp, ArraySource(partial))


def test_gguf_roundtrip(tmp_path, rng):
    """Metadata types and tensors survive a real GGUF file written by gguf.GGUFWriter."""
    import gguf

    meta = tiny_meta("qwen4exp")
    hp = hparams_from_metadata(meta)
    arrays = tiny_arrays(hp, rng)
    path = tmp_path / "tiny.gguf"
    wr = gguf.GGUFWriter(str(path), "qwen4exp")
    vt = gguf.GGUFValueType
    types = {"u32": vt.UINT32, "f32": vt.FLOAT32, "i32": vt.INT32, "u64": vt.UINT64}
    for key, (typ, value) in meta.kv.items():
        if key == "general.architecture":
            continue
        if typ.startswith("arr["):
            wr.add_key_value(key, list(value), vt.ARRAY, types[typ[4:-1]])
        else:
            wr.add_key_value(key, value, types[typ])
    for name, arr in arrays.items():
        wr.add_tensor(name, arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    hp2 = hparams_from_gguf(path)
    assert hp2 == hp
    src = GGUFSource(path)
    name = "blk.1.ple_conv1d.weight"
    assert np.array_equal(src.load(name), arrays[name])
    rows = np.array([5, 4000, 17])
    assert np.array_equal(src.rows("per_layer_token_embd.weight")(rows), arrays["per_layer_token_embd.weight"][rows])
    w = load_model(path)
    assert np.array_equal(w.output, arrays["output.weight"])
