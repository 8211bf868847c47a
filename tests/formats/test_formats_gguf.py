"""GGUF write -> read round trips, the shape rule, and FormatErrors for malformed files."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf import GGUFValueType as V

from vkflash.errors import FormatError
from vkflash.formats.gguf_file import GGUFFile
from vkflash.formats.gguf_write import FloatTensor, RawTensor, Typed, write_gguf
from vkflash.formats.quants import BLOCK, dequantize, quantize, random_blocks

SCALARS = {
    V.UINT8: np.uint8, V.INT8: np.int8, V.UINT16: np.uint16, V.INT16: np.int16,
    V.UINT32: np.uint32, V.INT32: np.int32, V.UINT64: np.uint64, V.INT64: np.int64,
    V.FLOAT32: np.float32, V.FLOAT64: np.float64,
}


def random_ints(rng: np.random.Generator, dtype: type, n: int) -> np.ndarray:
    """n values over the full range of an integer dtype (floats: normal values)."""
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(n).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)


def random_text(rng: np.random.Generator, n: int) -> list[str]:
    """n strings of random length (including empty) mixing ASCII, Latin-1, CJK and emoji."""
    alphabet = list("abcxyz <|>Ġ\n\t") + ["é", "ß", "中", "文", "🙂", "\u0120"]
    return ["".join(rng.choice(alphabet, size=int(rng.integers(0, 12)))) for _ in range(n)]


def test_metadata_roundtrip(tmp_path: Path, rng: np.random.Generator) -> None:
    n_vocab = int(rng.integers(50, 400))
    tokens = random_text(rng, n_vocab)
    merges = [f"{a} {b}" for a, b in zip(random_text(rng, 40), random_text(rng, 40), strict=True)]
    token_type = rng.integers(1, 7, size=n_vocab, dtype=np.int32)
    u64 = rng.integers(2**63, 2**64 - 1, size=5, dtype=np.uint64, endpoint=True)
    md: dict[str, object] = {
        "a.u32": int(rng.integers(0, 2**32)),
        "a.f32": float(np.float32(rng.standard_normal())),
        "a.str": "".join(random_text(rng, 3)) + "é",
        "a.empty_str": "",
        "a.bool": bool(rng.integers(0, 2)),
        "a.u32_list": [int(v) for v in rng.integers(0, 2**32, size=7)],
        "a.f32_list": [float(np.float32(v)) for v in rng.standard_normal(3)],
        "a.bool_list": [bool(v) for v in rng.integers(0, 2, size=9)],
        "a.u64_arr": u64,
        "a.bool_arr": rng.integers(0, 2, size=11).astype(bool),
        "a.i32_typed_list": Typed([int(v) for v in rng.integers(-(2**31), 2**31, size=4)], V.INT32),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": token_type,
    }
    for vt, dt in SCALARS.items():
        v = random_ints(rng, dt, 6)
        md[f"s.{vt.name}"] = Typed(v[0].item(), vt)
        md[f"arr.{vt.name}"] = v
    write_gguf(tmp_path / "m.gguf", "qwen4exp", md, {"t": rng.standard_normal(32).astype(np.float32)})
    f = GGUFFile(tmp_path / "m.gguf")

    assert f.arch == "qwen4exp" and f.metadata["general.architecture"] == "qwen4exp"
    assert set(f.metadata) == set(md) | {"general.architecture"}
    inferred = {"a.u32": V.UINT32, "a.f32": V.FLOAT32, "a.str": V.STRING, "a.empty_str": V.STRING, "a.bool": V.BOOL}
    for key, vt in inferred.items():
        assert f.key_type(key) == vt and f.metadata.get(key) == md[key] and type(f.metadata[key]) is type(md[key])
    for key, item, dtype in [("a.u32_list", V.UINT32, np.uint32), ("a.f32_list", V.FLOAT32, np.float32),
                             ("a.bool_list", V.BOOL, np.bool_), ("a.i32_typed_list", V.INT32, np.int32)]:
        v = f.metadata[key]
        expected = md[key].value if isinstance(md[key], Typed) else md[key]
        assert f.key_type(key) == V.ARRAY and f.metadata.array_type(key) == item
        assert v.dtype == dtype and v.tolist() == expected
    got_u64 = f.metadata["a.u64_arr"]
    assert got_u64.dtype == np.uint64 and np.array_equal(got_u64, u64)
    assert f.metadata["a.bool_arr"].dtype == np.bool_ and np.array_equal(f.metadata["a.bool_arr"], md["a.bool_arr"])
    assert f.metadata["tokenizer.ggml.tokens"] == tokens and f.metadata["tokenizer.ggml.merges"] == merges
    tt = f.metadata["tokenizer.ggml.token_type"]
    assert tt.dtype == np.int32 and np.array_equal(tt, token_type)
    assert f.metadata.array_type("tokenizer.ggml.tokens") == V.STRING
    for vt, dt in SCALARS.items():
        scalar, arr = f.metadata[f"s.{vt.name}"], f.metadata[f"arr.{vt.name}"]
        assert f.key_type(f"s.{vt.name}") == vt and scalar == md[f"s.{vt.name}"].value
        assert isinstance(scalar, float if vt in (V.FLOAT32, V.FLOAT64) else int)
        assert f.metadata.array_type(f"arr.{vt.name}") == vt
        assert arr.dtype == dt and np.array_equal(arr, md[f"arr.{vt.name}"])
    assert f.metadata.get("absent", 17) == 17 and f.key_type("absent") is None
    assert f.metadata.array_type("a.u32") is None


def test_metadata_matches_gguf_reader(tmp_path: Path, rng: np.random.Generator) -> None:
    """Our decoded values equal what the stock reader decodes from the same file."""
    md = {"x.tokens": random_text(rng, 30), "x.ids": rng.integers(0, 99, size=12, dtype=np.int32),
          "x.u64": rng.integers(0, 2**64 - 1, size=3, dtype=np.uint64), "x.s": "ab"}
    write_gguf(tmp_path / "m.gguf", "qwen2", md, {})
    ours, stock = GGUFFile(tmp_path / "m.gguf").metadata, GGUFReader(tmp_path / "m.gguf").fields
    for key in md:
        assert np.array_equal(np.asarray(ours[key], dtype=object), np.asarray(stock[key].contents(), dtype=object))


@pytest.mark.parametrize(
    "value, match",
    [(2**32, "does not fit UINT32"), (-1, "does not fit UINT32"), (Typed(300, V.UINT8), "does not fit UINT8"),
     ([1, "a"], "mixed types"), ([], "empty arrays"), (b"raw", "cannot store"), (np.zeros((2, 2)), "1-D")],
)
def test_unstorable_metadata_raises(tmp_path: Path, value: object, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        write_gguf(tmp_path / "m.gguf", "qwen2", {"k": value}, {})


def ragged_ne(rng: np.random.Generator, epb: int) -> tuple[int, ...]:
    """Random non-square dims with 1 to 4 entries; ne0 a whole number of blocks."""
    ndim = int(rng.integers(1, 5))
    ne0 = epb * int(rng.integers(1, 4)) if epb > 1 else int(rng.integers(1, 40))
    return (ne0, *(int(v) for v in rng.integers(1, 6, size=ndim - 1)))


def in_chunks(raw: np.ndarray, n: int) -> Callable[[], Iterator[np.ndarray]]:
    """A maker of raw's bytes as n consecutive chunks."""
    return lambda: iter(np.array_split(raw, n))


def test_tensor_roundtrip_and_shape_rule(tmp_path: Path, rng: np.random.Generator) -> None:
    specs, expected = {}, {}
    for q in BLOCK:
        ne = ragged_ne(rng, BLOCK[q][0])
        x = rng.standard_normal(tuple(reversed(ne))).astype(np.float32)
        raw = random_blocks(q, int(np.prod(ne)), rng)
        specs[f"float.{q.name}"] = FloatTensor(x, q)
        expected[f"float.{q.name}"] = (q, ne, quantize(x, q))
        maker = [raw, lambda r=raw: r, in_chunks(raw, int(rng.integers(1, 5)))][q.value % 3]  # eager, lazy, chunked
        specs[f"raw.{q.name}"] = RawTensor(maker, q, ne)
        expected[f"raw.{q.name}"] = (q, ne, raw)
    plain = rng.standard_normal((3, 5, 7)).astype(np.float32)
    specs["plain"], expected["plain"] = plain, (Q.F32, (7, 5, 3), plain.reshape(-1).view(np.uint8))
    write_gguf(tmp_path / "t.gguf", "qwen4exp", {}, specs)

    f = GGUFFile(tmp_path / "t.gguf")
    stock = {t.name: t for t in GGUFReader(tmp_path / "t.gguf").tensors}
    assert list(f.tensors) == list(specs)
    for name, (q, ne, raw) in expected.items():
        info = f.tensors[name]
        assert f.has(name) and info.ggml_type == q and info.ne == ne and info.nbytes == raw.size
        assert np.array_equal(info.data, raw)
        assert info.offset % f.alignment == 0 and not info.data.flags.owndata and not info.data.flags.writeable
        assert tuple(int(v) for v in stock[name].shape) == ne  # the stock reader agrees on ne
        y = f.tensor_f32(name)
        assert y.dtype == np.float32 and y.shape == tuple(reversed(ne))
        ref = gguf.quants.dequantize(np.asarray(stock[name].data), q).reshape(tuple(reversed(ne)))
        assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))
    assert np.array_equal(f.tensor_f32("plain"), plain)
    assert not f.has("absent")
    with pytest.raises(FormatError, match="no tensor named 'absent'"):
        f.tensor_f32("absent")


def test_linear_weight_orientation(tmp_path: Path, rng: np.random.Generator) -> None:
    """MODEL.md §2: a linear weight {in, out} reads as W (out × in) with y = W @ x; check it on
    a Q8_0 tensor against an element addressed by ne0 fastest-varying in the raw file."""
    n_in, n_out = 64, 3
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    write_gguf(tmp_path / "w.gguf", "qwen2", {}, {"w": FloatTensor(w, Q.Q8_0)})
    f = GGUFFile(tmp_path / "w.gguf")
    assert f.tensors["w"].ne == (n_in, n_out)
    flat = dequantize(f.tensors["w"].data, Q.Q8_0, n_in * n_out)
    o, i = int(rng.integers(n_out)), int(rng.integers(n_in))
    assert f.tensor_f32("w")[o, i] == flat[o * n_in + i]
    assert np.abs(f.tensor_f32("w") - w).max() < 0.02 * np.abs(w).max()


def test_custom_alignment(tmp_path: Path, rng: np.random.Generator) -> None:
    tensors = {f"t{i}": rng.standard_normal(int(rng.integers(1, 50))).astype(np.float32) for i in range(4)}
    write_gguf(tmp_path / "a.gguf", "qwen2", {}, tensors, alignment=64)
    f = GGUFFile(tmp_path / "a.gguf")
    assert f.alignment == 64 and f.key_type("general.alignment") == V.UINT32
    for name, x in tensors.items():
        assert f.tensors[name].offset % 64 == 0 and np.array_equal(f.tensor_f32(name), x)


# ---- malformed files -----------------------------------------------------------------------

@pytest.fixture
def good_file(tmp_path: Path, rng: np.random.Generator) -> Path:
    """A small valid GGUF with a vocabulary and two quantized tensors."""
    path = tmp_path / "good.gguf"
    md = {"tokenizer.ggml.tokens": random_text(rng, 20), "a.n": 3}
    tensors = {
        "wa": FloatTensor(rng.standard_normal((3, 64)).astype(np.float32), Q.Q8_0),
        "wb": FloatTensor(rng.standard_normal((2, 256)).astype(np.float32), Q.Q4_K),
    }
    write_gguf(path, "qwen4exp", md, tensors)
    return path


def patched(path: Path, offset: int, data: bytes) -> Path:
    """A copy of `path` with `data` written at `offset`."""
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    out = path.with_name("patched.gguf")
    out.write_bytes(bytes(raw))
    return out


def tensor_info_offsets(path: Path, name: str) -> tuple[int, int]:
    """Byte offsets of the type id and the data offset in tensor `name`'s info (stock reader)."""
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    type_at = t.field.offset + 8 + len(name.encode()) + 4 + 8 * len(t.shape)
    return type_at, type_at + 4


def test_truncated_everywhere(good_file: Path, rng: np.random.Generator) -> None:
    raw = good_file.read_bytes()
    f = GGUFFile(good_file)
    data_start = min(t.offset for t in f.tensors.values())
    cuts = {0, 3, 10, 23, 40, data_start - 1, data_start + 1, len(raw) - 1}
    cuts |= {int(c) for c in rng.integers(24, len(raw), size=12)}
    for cut in sorted(cuts):
        short = good_file.with_name("short.gguf")
        short.write_bytes(raw[:cut])
        with pytest.raises(FormatError, match="truncated") as e:
            GGUFFile(short)
        assert "\n" not in str(e.value)


def test_truncated_header_says_where(good_file: Path) -> None:
    """A cut (or a damaged length) in the header names the last field read whole."""
    raw = good_file.read_bytes()
    short = good_file.with_name("short.gguf")
    short.write_bytes(raw[: raw.index(b"a.n") + 2])
    with pytest.raises(FormatError, match=f"the header needs {raw.index(b'a.n') + 3} bytes, the file has "
                                          f"{raw.index(b'a.n') + 2} \\(cut or damaged after key 'tokenizer.ggml.tokens'\\)$"):
        GGUFFile(short)
    short.write_bytes(raw[:30])
    with pytest.raises(FormatError, match="after the header's counts"):
        GGUFFile(short)


def test_truncated_tensor_names_the_tensor(good_file: Path) -> None:
    raw = good_file.read_bytes()
    short = good_file.with_name("short.gguf")
    wb = GGUFFile(good_file).tensors["wb"]
    short.write_bytes(raw[: wb.offset + 5])
    with pytest.raises(FormatError, match=f"truncated GGUF: tensor 'wb' needs {wb.nbytes} bytes at offset {wb.offset}, "
                                          f"the file has {wb.offset + 5}$"):
        GGUFFile(short)


@pytest.mark.parametrize("count", [21, 2**40, 2**63])
def test_oversized_array_count(good_file: Path, count: int) -> None:
    """An array claiming more items than the file holds is truncation, not a huge allocation."""
    key = b"tokenizer.ggml.tokens"
    count_at = good_file.read_bytes().index(key) + len(key) + 4 + 4
    with pytest.raises(FormatError, match="truncated"):
        GGUFFile(patched(good_file, count_at, count.to_bytes(8, "little")))


@pytest.mark.parametrize("length", [2**40, 2**63, 2**64 - 1])
def test_oversized_string_length_in_array(good_file: Path, length: int) -> None:
    """A string in a string array claiming more bytes than the file holds is truncation."""
    key = b"tokenizer.ggml.tokens"
    first_at = good_file.read_bytes().index(key) + len(key) + 4 + 4 + 8
    with pytest.raises(FormatError, match="truncated"):
        GGUFFile(patched(good_file, first_at, length.to_bytes(8, "little")))


def test_unknown_value_types(good_file: Path) -> None:
    """A key's value type, or an array's item type, that GGUF does not define is named with its place."""
    raw = good_file.read_bytes()
    type_at = raw.index(b"a.n") + 3
    with pytest.raises(FormatError, match=f"unknown metadata value type 22 \\(for the value at byte {type_at + 4}\\)"):
        GGUFFile(patched(good_file, type_at, (22).to_bytes(4, "little")))
    item_at = raw.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4
    with pytest.raises(FormatError, match=f"unknown metadata value type 4126537205 \\(for the value at byte {item_at + 12}"):
        GGUFFile(patched(good_file, item_at, b"\xf5" * 4))


def test_element_count_past_int64(good_file: Path) -> None:
    """Dims whose product passes ggml's int64 limit are refused as such, not as a truncation."""
    t = next(t for t in GGUFReader(good_file).tensors if t.name == "wa")
    ne1_at = t.field.offset + 8 + 2 + 4 + 8
    with pytest.raises(FormatError, match="tensor 'wa': ne \\[64, 2305843009213693952\\] has more than 2\\^63 - 1"):
        GGUFFile(patched(good_file, ne1_at, (2**61).to_bytes(8, "little")))


def test_wrong_magic(good_file: Path) -> None:
    with pytest.raises(FormatError, match="not a GGUF file"):
        GGUFFile(patched(good_file, 0, b"GGML"))


@pytest.mark.parametrize("version", [1, 4, 0x7FFF])
def test_unsupported_version(good_file: Path, version: int) -> None:
    with pytest.raises(FormatError, match=f"GGUF version {version} is not supported"):
        GGUFFile(patched(good_file, 4, version.to_bytes(4, "little")))


def test_big_endian_rejected(good_file: Path) -> None:
    with pytest.raises(FormatError, match="big-endian"):
        GGUFFile(patched(good_file, 4, (3).to_bytes(4, "big")))


@pytest.mark.parametrize("type_id, shown", [(999, "unknown type id 999"), (int(Q.Q8_1), "Q8_1"),
                                             (int(Q.IQ2_XXS), "IQ2_XXS")])
def test_unsupported_tensor_type_names_tensor_and_type(good_file: Path, type_id: int, shown: str) -> None:
    type_at, _ = tensor_info_offsets(good_file, "wb")
    with pytest.raises(FormatError, match=f"tensor 'wb' has unsupported type {shown}"):
        GGUFFile(patched(good_file, type_at, type_id.to_bytes(4, "little")))


def test_misaligned_and_out_of_range_offsets(good_file: Path) -> None:
    _, offset_at = tensor_info_offsets(good_file, "wb")
    rel = int.from_bytes(good_file.read_bytes()[offset_at : offset_at + 8], "little")
    with pytest.raises(FormatError, match="tensor 'wb': data offset .* is not 32-aligned"):
        GGUFFile(patched(good_file, offset_at, (rel + 1).to_bytes(8, "little")))
    with pytest.raises(FormatError, match="truncated GGUF: tensor 'wb' needs"):
        GGUFFile(patched(good_file, offset_at, (rel + 2**20).to_bytes(8, "little")))


def test_offset_out_of_table_order(good_file: Path) -> None:
    """An aligned, in-range offset that is not where the tensor before it ends is a damaged table
    (ggml refuses it too), not silently shifted weights."""
    _, offset_at = tensor_info_offsets(good_file, "wb")
    with pytest.raises(FormatError, match=r"tensor 'wb': data offset 0, expected \d+"):
        GGUFFile(patched(good_file, offset_at, (0).to_bytes(8, "little")))


def test_key_not_utf8(good_file: Path) -> None:
    at = good_file.read_bytes().index(b"a.n")
    with pytest.raises(FormatError, match="a metadata key or tensor name is not valid UTF-8"):
        GGUFFile(patched(good_file, at, b"\xf5"))


def test_deeply_nested_array_is_malformed(tmp_path: Path) -> None:
    """Arrays nested past MAX_ARRAY_DEPTH are refused while parsing (not a RecursionError)."""
    from vkflash.formats.gguf_file import MAX_ARRAY_DEPTH

    ok: object = [1]
    for _ in range(MAX_ARRAY_DEPTH):
        ok = [ok]
    write_gguf(tmp_path / "ok.gguf", "qwen2", {"x.deep": Typed(ok, V.ARRAY)}, {})
    assert GGUFFile(tmp_path / "ok.gguf").key_type("x.deep") == V.ARRAY
    write_gguf(tmp_path / "deep.gguf", "qwen2", {"x.deep": Typed([ok], V.ARRAY)}, {})
    with pytest.raises(FormatError, match=f"nested more than {MAX_ARRAY_DEPTH} deep"):
        GGUFFile(tmp_path / "deep.gguf")


def test_partial_block_row(good_file: Path) -> None:
    t = next(t for t in GGUFReader(good_file).tensors if t.name == "wa")
    ne0_at = t.field.offset + 8 + 2 + 4
    with pytest.raises(FormatError, match="tensor 'wa': ne0 = 48 is not a multiple of the Q8_0 block"):
        GGUFFile(patched(good_file, ne0_at, (48).to_bytes(8, "little")))


def test_duplicate_tensor_and_missing_architecture(good_file: Path) -> None:
    t = next(t for t in GGUFReader(good_file).tensors if t.name == "wb")
    with pytest.raises(FormatError, match="tensor 'wa' appears twice"):
        GGUFFile(patched(good_file, t.field.offset + 8, b"wa"))
    at = good_file.read_bytes().index(b"general.architecture")
    with pytest.raises(FormatError, match="general.architecture is missing"):
        GGUFFile(patched(good_file, at, b"general.architecturX"))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")
    with pytest.raises(FormatError, match="not a regular file"):
        GGUFFile(tmp_path)


@pytest.mark.parametrize(
    "spec, match",
    [(RawTensor(np.zeros(33, np.uint8), Q.Q8_0, (32,)), "tensor 't': expected 34 encoded bytes, got 33"),
     (RawTensor(lambda: iter([b"x" * 34, b"y"]), Q.Q8_0, (32,)), "tensor 't': expected 34 encoded bytes, got 35"),
     (RawTensor(b"", Q.Q8_0, ()), "tensor 't': 0 dims"),
     (np.zeros((1, 1, 1, 1, 2), np.float32), "tensor 't': 5 dims"),
     (FloatTensor(np.zeros((2, 48), np.float32), Q.Q8_0), "tensor 't': Q8_0 needs a multiple of 32 elements, got 48"),
     (FloatTensor(np.zeros(32, np.float32), Q.Q8_1), "unsupported tensor type: Q8_1")],
)
def test_unwritable_tensors_raise(tmp_path: Path, spec: object, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        write_gguf(tmp_path / "x.gguf", "qwen2", {}, {"t": spec})
    assert not (tmp_path / "x.gguf").exists()


def test_version_2_reads_like_3(good_file: Path) -> None:
    v3 = GGUFFile(good_file)
    v2 = GGUFFile(patched(good_file, 4, (2).to_bytes(4, "little")))
    assert v2.version == 2 and list(v2.tensors) == list(v3.tensors)
    assert np.array_equal(v2.tensor_f32("wb"), v3.tensor_f32("wb"))


def test_nested_array_is_refused_only_when_read(tmp_path: Path) -> None:
    write_gguf(tmp_path / "n.gguf", "qwen2", {"x.nested": Typed([[1, 2], [3]], V.ARRAY), "x.n": 4}, {})
    f = GGUFFile(tmp_path / "n.gguf")
    assert f.key_type("x.nested") == V.ARRAY and f.metadata.array_type("x.nested") == V.ARRAY
    assert f.metadata["x.n"] == 4
    with pytest.raises(FormatError, match="x.nested: nested arrays are not supported"):
        f.metadata.get("x.nested")
