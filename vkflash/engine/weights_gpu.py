"""Model weights on the GPU: every GGUF tensor in its own buffer, matrices as raw GGML blocks.

Matrices keep their file encoding (the matmul/embed shaders decode blocks on the fly), so the
host never dequantizes a weight matrix; 1-D tensors (norm gains, biases) are decoded to f32.
An arch may name *stacks*: projections of one type and row length that read the same input go
into one buffer, rows of each member one after the other (per expert for expert stacks), so one
matmul computes them all; every member stays addressable as rows of that buffer
(VKFLASH_STACK_WEIGHTS=0 uploads them apart).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.errors import ModelError
from vkflash.formats.gguf_file import GGUFFile, TensorInfo
from vkflash.formats.quant_blocks import row_bytes
from vkflash.formats.quants import dequantize
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops import embed as embed_op
from vkflash.gpu.ops.matmul import TYPES as MATMUL_TYPES
from vkflash.gpu.ops.matmul import QWeight
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams
from vkflash.model.tensors import validate_tensors
from vkflash.model.weights import GGUFSource

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu


@dataclass(frozen=True)
class GpuTensor:
    """One uploaded tensor: its buffer, GGML type and dims ne (ne0 contiguous). A stack member
    starts at row `row0` of the shared buffer, and its experts (ne2) are `expert_rows` apart."""

    name: str
    buf: Buffer
    qtype: Q
    ne: tuple[int, ...]
    row0: int = 0  # a vector's first element
    expert_rows: int = -1  # -1: ne1 (the tensor's own rows, not a stack)

    @property
    def nbytes(self) -> int:
        """The tensor's own bytes (a stack member: its rows, not the shared buffer)."""
        return row_bytes(self.qtype, self.ne[0]) * math.prod(self.ne[1:])

    def matrix(self) -> QWeight:
        """W ∈ R^{n_out×k} for matmul: k = ne0, n_out = the product of the other dims."""
        if len(self.ne) > 2 and self.expert_rows not in (-1, self.ne[1]):
            raise ModelError(f"tensor {self.name}: its experts are interleaved in a stack; address them per expert")
        try:
            return QWeight(self.buf, int(self.qtype), self.ne[0], math.prod(self.ne[1:]), self.row0)
        except ValueError as e:
            raise ModelError(f"tensor {self.name}: {e}") from None

    def vector(self) -> Rows:
        """A 1-D f32 tensor as one row (a gain or a bias; a stack member from element row0)."""
        if self.qtype is not Q.F32 or len(self.ne) != 1:
            raise ModelError(f"tensor {self.name} is {self.qtype.name} {self.ne}, expected a 1-D f32 vector")
        return Rows(self.buf, 1, self.ne[0], self.row0)


@dataclass
class GpuWeights:
    """The uploaded tensors of one model file, by GGUF name."""

    hp: HParams
    file: GGUFFile
    tensors: dict[str, GpuTensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> GpuTensor:
        return self.tensors[name]

    def stacked(self, *names: str) -> QWeight | None:
        """The matrices `names` as one weight when they are consecutive rows of one stacked buffer
        (in this order), else None."""
        first = self.tensors[names[0]].matrix()
        n_out = first.n_out
        for name in names[1:]:
            t = self.tensors[name]
            w = t.matrix()
            if t.buf is not first.buf or w.row0 != first.row0 + n_out:
                return None
            n_out += w.n_out
        return QWeight(first.buf, first.qtype, first.k, n_out, first.row0)

    def get(self, name: str) -> GpuTensor | None:
        return self.tensors.get(name)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def device_embeddable(qtype: int) -> bool:
    """Whether the embed kernel gathers rows of this table type on the device."""
    return Q(qtype) in embed_op.TABLE_TYPES


def host_row_gather(gf: GGUFFile, name: str) -> Callable[[np.ndarray], np.ndarray]:
    """Rows of a 2-D table decoded on the host from the mmapped file (tables the embed kernel
    cannot decode, the PLE table): ids → (n, ne0) float32. The reference's own row gather."""
    return GGUFSource(gf).rows(name)


def raw_row_gather(gf: GGUFFile, name: str) -> Callable[[np.ndarray], np.ndarray]:
    """Rows of a 2-D table as stored in the mmapped file: ids → the rows' bytes, in order, as flat
    32-bit words (the rows of a step are a whole number of words). Each row is one opaque item, so
    the gather copies rows, not bytes (several times faster than indexing a byte matrix)."""
    info = gf.tensors[name]
    u8 = np.asarray(info.data).view(np.uint8).reshape(info.ne[1], -1)
    rows = u8.view(np.dtype((np.void, u8.shape[1]))).reshape(-1)
    return lambda idx: np.take(rows, np.asarray(idx).reshape(-1)).view(np.uint8).view(np.uint32)


@dataclass(frozen=True)
class Stored:
    """A tensor as it goes to the GPU: raw bytes (or f32 values), GGML type and dims ne."""

    data: np.ndarray
    qtype: Q
    ne: tuple[int, ...]


@dataclass(frozen=True)
class Stack:
    """Tensors uploaded as one buffer `name` (members in order; see the module docstring)."""

    name: str
    members: tuple[str, ...]


Transform = Callable[[TensorInfo], Stored]
"""Re-lays a file tensor for an arch's graph at upload (row permutations of raw blocks, f32 casts)."""


def permute_rows(info: TensorInfo, order: np.ndarray) -> Stored:
    """The tensor with its rows (ne0 elements each, any block type) in `order`: raw bytes moved,
    nothing dequantized."""
    n_rows = math.prod(info.ne[1:])
    rows = info.data.reshape(n_rows, -1)
    return Stored(np.ascontiguousarray(rows[np.asarray(order)]), info.ggml_type, info.ne)


def as_f32(info: TensorInfo) -> Stored:
    """The tensor decoded to f32 (small tensors a kernel reads as plain floats)."""
    vals = dequantize(info.data, info.ggml_type, info.n_elements)
    return Stored(vals, Q.F32, info.ne)


def _check_type(name: str, qtype: Q, ne: tuple[int, ...]) -> None:
    if len(ne) > 1 and qtype not in MATMUL_TYPES and not device_embeddable(qtype):
        raise ModelError(f"tensor {name} has type {qtype.name}, which the GPU kernels cannot decode "
                         f"(supported: {', '.join(t.name for t in MATMUL_TYPES)})")


def _stored(gf: GGUFFile, name: str, transforms: Mapping[str, Transform] | None) -> Stored:
    """A file tensor as it goes to the GPU: re-laid, 1-D decoded to f32, else raw."""
    info = gf.tensors[name]
    if transforms and name in transforms:
        st = transforms[name](info)
    elif len(info.ne) == 1:
        st = Stored(gf.tensor_f32(name), Q.F32, info.ne)
    else:
        st = Stored(info.data, info.ggml_type, info.ne)
    _check_type(name, st.qtype, st.ne)
    return st


def _rows(st: Stored) -> tuple[int, int]:
    """(rows per expert, experts) of a stored tensor {ne0, rows[, experts]}."""
    return (st.ne[1] if len(st.ne) > 1 else 1), (st.ne[2] if len(st.ne) > 2 else 1)


def _stackable(parts: Sequence[Stored]) -> bool:
    """Same type and row length, the same expert count, at most 3-D, and raw bytes of whole rows;
    or all f32 vectors (biases), which are concatenated."""
    first = parts[0]
    if all(len(p.ne) == 1 and p.qtype is Q.F32 for p in parts):
        return True
    return all(p.qtype == first.qtype and p.ne[0] == first.ne[0] and _rows(p)[1] == _rows(first)[1]
               and len(p.ne) <= 3 for p in parts)  # a vector among matrices is one row


def _upload_made(gpu: "Gpu", nbytes: int, make: Callable[[], np.ndarray], name: str) -> Buffer:
    """A buffer holding make()'s nbytes; a planning Gpu counts it without making (reading) them."""
    buf = gpu.buffer(nbytes, name)
    if not gpu.planning:
        buf.write(make())
    return buf


def _upload_stack(gpu: "Gpu", w: GpuWeights, stack: Stack, parts: Sequence[Stored]) -> None:
    """One buffer holding the members' rows per expert in order (vectors: their values in order);
    each member registered as its rows (vectors: row0 counts elements)."""
    if len(parts[0].ne) == 1:
        vecs = [np.asarray(p.data, np.float32).reshape(-1) for p in parts]
        buf = _upload_made(gpu, sum(v.nbytes for v in vecs), lambda: np.concatenate(vecs), stack.name)
        off = 0
        for name, p in zip(stack.members, parts):
            w.tensors[name] = GpuTensor(name, buf, Q.F32, p.ne, off)
            off += p.ne[0]
        return
    E = _rows(parts[0])[1]
    blocks = [np.ascontiguousarray(p.data).view(np.uint8).reshape(E, _rows(p)[0], -1) for p in parts]
    total = sum(b.shape[1] for b in blocks)
    buf = _upload_made(gpu, sum(b.nbytes for b in blocks), lambda: np.concatenate(blocks, axis=1), stack.name)
    row0 = 0
    for name, p, b in zip(stack.members, parts, blocks):
        w.tensors[name] = GpuTensor(name, buf, p.qtype, p.ne, row0, total)
        row0 += b.shape[1]


def upload_weights(gpu: "Gpu", gf: GGUFFile, hp: HParams, skip: Iterable[str] = (),
                   progress: Callable[[int, int], None] | None = None,
                   transforms: Mapping[str, Transform] | None = None,
                   stacks: Sequence[Stack] = ()) -> GpuWeights:
    """Validate the file against hp's tensor table and upload every tensor not in `skip` (re-laid
    by `transforms[name]` where an arch gives one; members of a `stacks` entry that are all present
    and stackable go into one buffer); progress(done, total) after each tensor, in file bytes."""
    validate_tensors(hp, {n: t.ne for n, t in gf.tensors.items()})
    w = GpuWeights(hp, gf)
    skipped = frozenset(skip)
    todo = {n: info for n, info in gf.tensors.items() if n not in skipped}
    total, done = sum(info.data.nbytes for info in todo.values()), 0
    stacked: set[str] = set()
    prepared: dict[str, Stored] = {}  # each tensor re-laid once, also when a stack it was tried for fails

    def stored(name: str) -> Stored:
        if name not in prepared:
            prepared[name] = _stored(gf, name, transforms)
        return prepared[name]

    for stack in stacks:
        if not all(m in todo and m not in stacked for m in stack.members):
            continue
        parts = [stored(m) for m in stack.members]
        if not _stackable(parts):
            continue
        _upload_stack(gpu, w, stack, parts)
        stacked.update(stack.members)
        for m in stack.members:
            del prepared[m]
        done += sum(todo[m].data.nbytes for m in stack.members)
        if progress is not None:
            progress(done, total)
    for name, info in todo.items():
        if name in stacked:
            continue
        st = prepared.pop(name, None) or _stored(gf, name, transforms)
        w.tensors[name] = GpuTensor(name, gpu.upload(st.data, name), st.qtype, st.ne)
        done += info.data.nbytes
        if progress is not None:
            progress(done, total)
    return w
