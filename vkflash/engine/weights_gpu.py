"""Model weights on the GPU: every GGUF tensor in its own buffer, matrices as raw GGML blocks.

Matrices keep their file encoding (the matmul/embed shaders decode blocks on the fly), so the
host never dequantizes a weight matrix; 1-D tensors (norm gains, biases) are decoded to f32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.errors import ModelError
from vkflash.formats.gguf_file import GGUFFile, TensorInfo
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
    """One uploaded tensor: its buffer, GGML type and dims ne (ne0 contiguous)."""

    name: str
    buf: Buffer
    qtype: Q
    ne: tuple[int, ...]

    def matrix(self) -> QWeight:
        """W ∈ R^{n_out×k} for matmul: k = ne0, n_out = the product of the other dims."""
        try:
            return QWeight(self.buf, int(self.qtype), self.ne[0], math.prod(self.ne[1:]))
        except ValueError as e:
            raise ModelError(f"tensor {self.name}: {e}") from None

    def vector(self) -> Rows:
        """A 1-D f32 tensor as one row (a gain or a bias)."""
        if self.qtype is not Q.F32 or len(self.ne) != 1:
            raise ModelError(f"tensor {self.name} is {self.qtype.name} {self.ne}, expected a 1-D f32 vector")
        return Rows(self.buf, 1, self.ne[0])


@dataclass
class GpuWeights:
    """The uploaded tensors of one model file, by GGUF name."""

    hp: HParams
    file: GGUFFile
    tensors: dict[str, GpuTensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> GpuTensor:
        return self.tensors[name]

    def get(self, name: str) -> GpuTensor | None:
        return self.tensors.get(name)

    @property
    def nbytes(self) -> int:
        return sum(t.buf.nbytes for t in self.tensors.values())


def device_embeddable(qtype: int) -> bool:
    """Whether the embed kernel gathers rows of this table type on the device."""
    return Q(qtype) in embed_op.TABLE_TYPES


def host_row_gather(gf: GGUFFile, name: str) -> Callable[[np.ndarray], np.ndarray]:
    """Rows of a 2-D table decoded on the host from the mmapped file (tables the embed kernel
    cannot decode, the PLE table): ids → (n, ne0) float32. The reference's own row gather."""
    return GGUFSource(gf).rows(name)


@dataclass(frozen=True)
class Stored:
    """A tensor as it goes to the GPU: raw bytes (or f32 values), GGML type and dims ne."""

    data: np.ndarray
    qtype: Q
    ne: tuple[int, ...]


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


def upload_weights(gpu: "Gpu", gf: GGUFFile, hp: HParams, skip: Iterable[str] = (),
                   progress: Callable[[int, int], None] | None = None,
                   transforms: Mapping[str, Transform] | None = None) -> GpuWeights:
    """Validate the file against hp's tensor table and upload every tensor not in `skip` (re-laid
    by `transforms[name]` where an arch gives one); progress(done, total) after each tensor, in
    file bytes."""
    validate_tensors(hp, {n: t.ne for n, t in gf.tensors.items()})
    w = GpuWeights(hp, gf)
    skipped = frozenset(skip)
    todo = {n: info for n, info in gf.tensors.items() if n not in skipped}
    total, done = sum(info.data.nbytes for info in todo.values()), 0
    for name, info in todo.items():
        if transforms and name in transforms:
            st = transforms[name](info)
            _check_type(name, st.qtype, st.ne)
            w.tensors[name] = GpuTensor(name, gpu.upload(st.data, name), st.qtype, st.ne)
        elif len(info.ne) == 1:
            _check_type(name, info.ggml_type, info.ne)
            buf = gpu.upload(gf.tensor_f32(name), name)
            w.tensors[name] = GpuTensor(name, buf, Q.F32, info.ne)
        else:
            _check_type(name, info.ggml_type, info.ne)
            buf = gpu.upload(info.data, name)
            w.tensors[name] = GpuTensor(name, buf, info.ggml_type, info.ne)
        done += info.data.nbytes
        if progress is not None:
            progress(done, total)
    return w
