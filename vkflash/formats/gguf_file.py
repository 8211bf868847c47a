"""Read a GGUF file through gguf.GGUFReader, memory-mapped, with one-line FormatErrors.

Metadata comes back as Python scalars / str / list[str] and numeric arrays as NumPy arrays in
their stored dtype; tensors are uint8 views of the mapped file, decoded on request with the
MODEL.md §2 shape rule (NumPy shape = reversed(ne)).
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

from vkflash.errors import FormatError, one_line
from vkflash.formats.quant_blocks import BLOCK, as_qtype, qtype_name
from vkflash.formats.quants import dequantize

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4
_INT64_MAX = 2**63 - 1
_HEADER_BYTES = 24  # magic, version, tensor count, kv count
_READER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")
MAX_ARRAY_DEPTH = 8  # arrays of arrays nest at most this deep (deeper: malformed, not a RecursionError)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: ggml type, dims ne (ne0 fastest-varying) and its bytes mapped from the file."""

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]
    nbytes: int
    data: np.ndarray
    """uint8 view of the file (no copy)."""
    offset: int
    """Absolute byte offset of the data in the file."""

    @property
    def n_elements(self) -> int:
        """Number of values in the tensor."""
        return math.prod(self.ne)

    @property
    def shape(self) -> tuple[int, ...]:
        """The NumPy shape of the decoded tensor: reversed(ne)."""
        return tuple(reversed(self.ne))


class _Truncated(Exception):
    """Raised by _BoundedReader when a header read runs past the end of the file."""

    def __init__(self, end: int, after: str) -> None:
        super().__init__(end)
        self.end = end
        self.after = after


class _BoundedReader(GGUFReader):
    """GGUFReader that refuses reads past the end of the file, parses arrays in one step each
    (gguf's element-by-element parse takes seconds on a 150k-token vocabulary) and leaves
    tensors to GGUFFile.

    An array field's data index points at one part: all values (numeric arrays), or the
    payload bytes followed by two parts holding each string's start and end in it.
    """

    tensor_fields: list[ReaderField]
    _depth = 0  # arrays of arrays being parsed (MAX_ARRAY_DEPTH)
    _plain: np.ndarray | None = None  # the map as a plain ndarray, made on the first read
    _last = "the header's counts"  # the last field read whole: where a damaged or cut file goes wrong

    def _push_field(self, field: ReaderField, skip_sum: bool = False) -> int:
        size = super()._push_field(field, skip_sum)
        self._last = "the header's counts" if field.name in _READER_FIELDS else f"key {field.name!r}"
        return size

    def _get_tensor_info_field(self, orig_offs: int) -> ReaderField:
        field = super()._get_tensor_info_field(orig_offs)
        self._last = f"the table entry of tensor {field.name!r}"
        return field

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        """gguf's _get, bounded, on a plain-ndarray view of the map (a memmap slice costs ~5x more,
        and a tensor table takes thousands of reads)."""
        dt = np.dtype(dtype)
        start, count = int(offset), int(count)
        end = start + dt.itemsize * count
        if end > self.data.size:
            raise _Truncated(end, self._last)
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        order = self.byte_order if override_order is None else override_order
        return self._plain[start:end].view(dt.newbyteorder(order))

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        if _value_type(int(raw_type), orig_offs) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item = _value_type(int(item_type[0]), orig_offs + 12)
        head = int(item_type.nbytes + count.nbytes)
        if item == GGUFValueType.STRING:
            parts = self._string_array(orig_offs + head, int(count[0]))
        elif item in self.gguf_scalar_to_np:
            parts = [self._get(orig_offs + head, self.gguf_scalar_to_np[item], int(count[0]))]
        else:
            return self._nested(orig_offs, raw_type)
        size = head + int(parts[0].nbytes)
        return size, [item_type, count, *parts], [2], [GGUFValueType.ARRAY, item]

    def _nested(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        """An array of arrays through gguf's generic parse, refused past MAX_ARRAY_DEPTH levels."""
        if self._depth >= MAX_ARRAY_DEPTH:
            raise ValueError(f"metadata arrays nested more than {MAX_ARRAY_DEPTH} deep at byte {orig_offs}")
        self._depth += 1
        try:
            return super()._get_field_parts(orig_offs, raw_type)
        finally:
            self._depth -= 1

    def _string_array(self, offs: int, count: int) -> list[np.ndarray]:
        """[payload bytes, starts, ends] of `count` length-prefixed strings at `offs`."""
        size, pos = int(self.data.size), offs
        if offs + 8 * count > size:  # each string has at least its 8-byte length
            raise _Truncated(offs + 8 * count, self._last)
        starts, ends = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        for i in range(count):
            if pos + 8 > size:
                raise _Truncated(pos + 8, self._last)
            (n,) = struct.unpack_from("<Q", self.data, pos)
            starts[i], pos = pos + 8 - offs, pos + 8 + n
            if pos > size:  # before it is stored: a huge n does not fit an int64
                raise _Truncated(pos, self._last)
            ends[i] = pos - offs
        return [self.data[offs:pos], starts, ends]

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        self.tensor_fields = fields


def _value_type(raw: int, value_at: int) -> GGUFValueType:
    """The GGUF value type `raw` of the value at byte `value_at`; ValueError naming both if unknown."""
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ValueError(f"unknown metadata value type {raw} (for the value at byte {value_at})") from None


def _decode(key: str, field: ReaderField) -> Any:
    """A metadata value as Python scalar, str, list[str] or NumPy array of the stored dtype."""
    kind = field.types[0]
    try:
        if kind == GGUFValueType.STRING:
            return bytes(field.parts[-1]).decode("utf-8")
        if kind != GGUFValueType.ARRAY:
            return field.parts[-1][0].item()
        item, i = GGUFValueType(int(field.parts[3][0])), field.data[0]
        if item == GGUFValueType.STRING:
            blob, starts, ends = bytes(field.parts[i]), field.parts[i + 1], field.parts[i + 2]
            return [blob[a:b].decode("utf-8") for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        if item not in GGUFReader.gguf_scalar_to_np:
            raise FormatError(f"metadata key {key}: nested arrays are not supported")
        return np.array(field.parts[i], dtype=GGUFReader.gguf_scalar_to_np[item])
    except UnicodeDecodeError:
        raise FormatError(f"metadata key {key}: string is not valid UTF-8") from None


class Metadata(Mapping[str, Any]):
    """Read-only view of a GGUF's key/value pairs, decoded on first access."""

    def __init__(self, fields: Mapping[str, ReaderField]) -> None:
        self._fields = {k: f for k, f in fields.items() if k not in _READER_FIELDS}
        self._cache: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._cache:
            self._cache[key] = _decode(key, self._fields[key])
        return self._cache[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def key_type(self, key: str) -> GGUFValueType | None:
        """The stored GGUF type of `key` (ARRAY for arrays), or None when absent."""
        field = self._fields.get(key)
        return None if field is None else field.types[0]

    def array_type(self, key: str) -> GGUFValueType | None:
        """The element type of array `key`, or None when absent or not an array."""
        if self.key_type(key) != GGUFValueType.ARRAY:
            return None
        return GGUFValueType(int(self._fields[key].parts[3][0]))


def _check_header(path: Path, size: int) -> None:
    """Reject non-GGUF, truncated, byte-swapped or unsupported-version files before parsing."""
    with path.open("rb") as f:
        head = f.read(8)
    if len(head) >= 4 and head[:4] != GGUF_MAGIC:
        raise FormatError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC!r})")
    if size < _HEADER_BYTES:
        raise FormatError(f"{path}: truncated GGUF: {size} bytes, the header alone needs {_HEADER_BYTES}")
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0 and version != 0:
        raise FormatError(f"{path}: big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise FormatError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")


class GGUFFile:
    """An open GGUF: architecture, metadata and tensors, all backed by one read-only memory map."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FormatError(f"{self.path}: no such file")
        if not self.path.is_file():
            raise FormatError(f"{self.path}: not a regular file")
        try:
            size = self.path.stat().st_size
            _check_header(self.path, size)
            reader = _BoundedReader(self.path, "r")
        except OSError as e:  # unreadable: permissions, an I/O error
            raise FormatError(f"{self.path}: cannot read: {e.strerror or e}") from None
        except _Truncated as e:
            raise FormatError(
                f"{self.path}: truncated GGUF: the header needs {e.end} bytes, the file has {size} (cut or damaged "
                f"after {one_line(e.after)})"
            ) from None
        except UnicodeDecodeError:  # gguf decodes every key and tensor name while parsing
            raise FormatError(f"{self.path}: malformed GGUF: a metadata key or tensor name is not valid UTF-8") from None
        except (ValueError, KeyError, OverflowError) as e:
            raise FormatError(f"{self.path}: malformed GGUF: {one_line(str(e.args[0] if e.args else e))}") from None
        self.version = int(reader.fields["GGUF.version"].parts[0][0])
        self.alignment = int(reader.alignment)
        self.data_offset = int(reader.data_offset)
        self.metadata = Metadata(reader.fields)
        self.tensors = self._tensor_infos(reader, size)
        self.arch = self._architecture()

    def _architecture(self) -> str:
        """general.architecture, which every GGUF model must carry as a string."""
        if self.metadata.key_type("general.architecture") != GGUFValueType.STRING:
            raise FormatError(f"{self.path}: general.architecture is missing or not a string")
        return str(self.metadata["general.architecture"])

    def _tensor_infos(self, reader: _BoundedReader, size: int) -> dict[str, TensorInfo]:
        """Validate every tensor (type, dims, alignment, bounds, layout) and map its bytes.

        Like ggml's reader, the data must lie in table order, each tensor at the end of the one
        before padded to the alignment: an offset that points anywhere else is a damaged table.
        """
        infos: dict[str, TensorInfo] = {}
        expected = 0  # the next tensor's offset relative to data_offset
        for field in reader.tensor_fields:
            _, name_data, _, dims, raw_type, rel_offset = field.parts
            name = bytes(name_data).decode("utf-8")  # gguf's parse already refused invalid UTF-8
            where = f"{self.path}: tensor {name!r}"
            if name in infos:
                raise FormatError(f"{where} appears twice")
            ne = tuple(int(v) for v in dims)
            if len(ne) > MAX_DIMS:
                raise FormatError(f"{where} has {len(ne)} dims (at most {MAX_DIMS})")
            if math.prod(ne) > _INT64_MAX:
                raise FormatError(f"{where}: ne {list(ne)} has more than 2^63 - 1 elements (ggml's limit)")
            try:
                qtype = as_qtype(int(raw_type[0]))
            except FormatError:
                raise FormatError(f"{where} has unsupported type {qtype_name(int(raw_type[0]))}") from None
            epb, bpb = BLOCK[qtype]
            if ne and ne[0] % epb:
                raise FormatError(f"{where}: ne0 = {ne[0]} is not a multiple of the {qtype.name} block ({epb})")
            nbytes = math.prod(ne) // epb * bpb
            rel = int(rel_offset[0])
            start = self.data_offset + rel
            if rel % self.alignment:
                raise FormatError(f"{where}: data offset {rel} is not {self.alignment}-aligned")
            if start + nbytes > size:
                raise FormatError(f"{self.path}: truncated GGUF: tensor {name!r} needs {nbytes} bytes at offset "
                                  f"{start}, the file has {size}")
            if rel != expected:
                raise FormatError(f"{where}: data offset {rel}, expected {expected} (the end of the tensor before "
                                  f"it, padded to {self.alignment})")
            expected += -(-nbytes // self.alignment) * self.alignment
            data = np.asarray(reader.data[start : start + nbytes])
            infos[name] = TensorInfo(name, qtype, ne, nbytes, data, start)
        return infos

    def key_type(self, key: str) -> GGUFValueType | None:
        """The stored GGUF type of metadata `key` (ARRAY for arrays), or None when absent."""
        return self.metadata.key_type(key)

    def has(self, name: str) -> bool:
        """Whether the file holds a tensor called `name`."""
        return name in self.tensors

    def tensor_f32(self, name: str) -> np.ndarray:
        """Tensor `name` decoded to a new float32 array of NumPy shape reversed(ne)."""
        info = self.tensors.get(name)
        if info is None:
            raise FormatError(f"{self.path}: no tensor named {name!r}")
        return dequantize(info.data, info.ggml_type, info.n_elements).reshape(info.shape)
