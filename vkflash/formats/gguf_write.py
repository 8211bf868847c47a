"""Write GGUF files through gguf.GGUFWriter: typed metadata and float or pre-encoded tensors.

The one GGUF writer of vkflash (tests, `vkflash make-model`). Tensors are encoded and written
one at a time, optionally produced lazily and in chunks, so files larger than memory — the
random-weight performance models — can be written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from vkflash.errors import FormatError
from vkflash.formats.quant_blocks import as_qtype, row_bytes
from vkflash.formats.quants import quantize

V = GGUFValueType


@dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF type; for a sequence, `vtype` is the element type."""

    value: Any
    vtype: GGUFValueType


@dataclass(frozen=True)
class FloatTensor:
    """Float values (NumPy shape = reversed(ne)) to be stored as `qtype`."""

    values: np.ndarray
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32


RawBytes = np.ndarray | bytes


@dataclass(frozen=True)
class RawTensor:
    """Already-encoded bytes of type `qtype` and dims `ne`; `raw` may be a callable that makes
    them at write time, whole or as consecutive chunks (so huge files never sit in memory whole)."""

    raw: RawBytes | Callable[[], RawBytes | Iterable[RawBytes]]
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]


TensorSpec = np.ndarray | FloatTensor | RawTensor

_NP_TO_GGUF: dict[np.dtype, GGUFValueType] = {
    np.dtype(np.uint8): V.UINT8, np.dtype(np.int8): V.INT8,
    np.dtype(np.uint16): V.UINT16, np.dtype(np.int16): V.INT16,
    np.dtype(np.uint32): V.UINT32, np.dtype(np.int32): V.INT32,
    np.dtype(np.uint64): V.UINT64, np.dtype(np.int64): V.INT64,
    np.dtype(np.float32): V.FLOAT32, np.dtype(np.float64): V.FLOAT64,
    np.dtype(np.bool_): V.BOOL,
}


def _scalar_type(key: str, v: Any) -> GGUFValueType:
    """GGUF type inferred for a scalar: bool, int -> u32, float -> f32, str, NumPy scalars as typed."""
    if isinstance(v, np.generic) and v.dtype in _NP_TO_GGUF:
        return _NP_TO_GGUF[v.dtype]
    if isinstance(v, bool):
        return V.BOOL
    if isinstance(v, int):
        return V.UINT32
    if isinstance(v, float):
        return V.FLOAT32
    if isinstance(v, str):
        return V.STRING
    raise FormatError(f"metadata key {key}: cannot store a {type(v).__name__}")


_INT_RANGE: dict[GGUFValueType, tuple[int, int]] = {
    t: (int(np.iinfo(d).min), int(np.iinfo(d).max)) for d, t in _NP_TO_GGUF.items() if d.kind in "iu"
}


def _check_range(key: str, values: Sequence[Any], vtype: GGUFValueType) -> None:
    """Refuse integers that do not fit the GGUF integer type they are stored as."""
    if vtype not in _INT_RANGE:
        return
    lo, hi = _INT_RANGE[vtype]
    bad = [x for x in values if not lo <= x <= hi]
    if bad:
        raise FormatError(f"metadata key {key}: {bad[0]} does not fit {vtype.name} (use Typed for another type)")


def _plain(key: str, value: Any) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    """(value for GGUFWriter, type, element type) for one metadata entry."""
    explicit = value.vtype if isinstance(value, Typed) else None
    v = value.value if isinstance(value, Typed) else value
    if not isinstance(v, (np.ndarray, Sequence)) or isinstance(v, (str, bytes)):
        vtype = explicit if explicit is not None else _scalar_type(key, v)
        v = v.item() if isinstance(v, np.generic) else v
        _check_range(key, [v], vtype)
        return v, vtype, None
    if len(v) == 0:
        raise FormatError(f"metadata key {key}: empty arrays cannot be written")
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.dtype not in _NP_TO_GGUF:
            raise FormatError(f"metadata key {key}: arrays must be 1-D of a GGUF scalar dtype, got {v.dtype}{v.shape}")
        item = explicit if explicit is not None else _NP_TO_GGUF[v.dtype]
        items = v.tolist()
    else:
        item = explicit if explicit is not None else _scalar_type(key, v[0])
        if explicit is None and any(_scalar_type(key, e) != item for e in v):
            raise FormatError(f"metadata key {key}: array items have mixed types")
        items = [e.item() if isinstance(e, np.generic) else e for e in v]
    _check_range(key, items, item)
    return items, V.ARRAY, item


def _encode(spec: TensorSpec) -> tuple[GGMLQuantizationType, tuple[int, ...], Callable[[], Iterator[np.ndarray]]]:
    """(type, ne, maker of the encoded bytes as uint8 chunks) for one tensor."""
    if isinstance(spec, np.ndarray):
        spec = FloatTensor(spec)
    if isinstance(spec, FloatTensor):
        values = np.asarray(spec.values)
        qtype = as_qtype(spec.qtype)
        return qtype, tuple(reversed(values.shape)), lambda: iter([quantize(values, qtype)])
    qtype, ne, raw = as_qtype(spec.qtype), tuple(int(n) for n in spec.ne), spec.raw
    return qtype, ne, lambda: _byte_chunks(raw() if callable(raw) else raw)


def _byte_chunks(raw: RawBytes | Iterable[RawBytes]) -> Iterator[np.ndarray]:
    """Encoded data, whole or in chunks, as flat uint8 arrays (an ndarray's bytes in C order)."""
    for chunk in [raw] if isinstance(raw, (np.ndarray, bytes, bytearray, memoryview)) else raw:
        if isinstance(chunk, np.ndarray):
            yield np.ascontiguousarray(chunk).view(np.uint8).reshape(-1)
        else:
            yield np.frombuffer(chunk, dtype=np.uint8)


def write_gguf(
    path: str | os.PathLike[str],
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, TensorSpec],
    alignment: int | None = None,
    sparse: bool = False,
) -> None:
    """Write a GGUF (v3) with general.architecture = arch, the given metadata and tensors in order.

    Metadata: bool, int (u32), float (f32), str, lists of those, 1-D NumPy arrays in their dtype
    (u64 stays u64), NumPy scalars, or Typed(value, type) for anything else.
    Tensors: float arrays (stored F32), FloatTensor(values, qtype) or RawTensor(bytes, qtype, ne),
    where the bytes may come from a callable, whole or as consecutive chunks. sparse: the header and
    tensor table only, the data region a hole that reads as zeros (for tools that read no data).
    """
    if "general.architecture" in metadata:
        raise FormatError("pass the architecture as `arch`, not as general.architecture metadata")
    writer = GGUFWriter(path, arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value in metadata.items():
        v, vtype, item = _plain(key, value)
        writer.add_key_value(key, v, vtype, sub_type=item)
    makers = []
    for name, spec in tensors.items():
        qtype, ne, make = _encode(spec)
        if not 1 <= len(ne) <= 4:
            raise FormatError(f"tensor '{name}': {len(ne)} dims (1 to 4 allowed)")
        try:
            nbytes = row_bytes(qtype, ne[0]) * math.prod(ne[1:])
        except FormatError as e:
            raise FormatError(f"tensor '{name}': {e}") from None
        writer.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), nbytes, raw_dtype=qtype)
        makers.append((name, nbytes, make))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]  # the data is streamed here, chunk by chunk, between the alignment pads
        for name, nbytes, make in makers:
            writer.write_padding(fout, fout.tell())
            if sparse:
                fout.seek(nbytes, 1)
                writer.write_padding(fout, nbytes)
                continue
            written = 0
            for chunk in make():
                chunk.tofile(fout)
                written += chunk.size
            if written != nbytes:
                raise FormatError(f"tensor '{name}': expected {nbytes} encoded bytes, got {written}")
            writer.write_padding(fout, nbytes)
        fout.truncate()  # a sparse file ending in a hole still has its full length
    except BaseException:
        writer.close()
        Path(path).unlink(missing_ok=True)  # never leave a half-written GGUF behind
        raise
    writer.close()
