"""GPU buffers over Kompute tensors, UMA-aware.

On UMA devices (Strix Halo, lavapipe) every buffer is host-visible: uploads and reads are plain
memcpy into the mapped memory, no staging copy. On discrete devices buffers are device-local and
filled/read through a bounded host-visible staging ring with a compute-shader copy (much faster
than vkCmdCopyBuffer on the H200). A single buffer may not exceed the device's storage range:
larger tensors must be split by the caller (`check_size` says so).

A step graph's intermediates are *virtual* buffers (`Buffer.virtual`): a size and a name, no
memory, until the graph's allocator (gpu/alloc.py) places them in shared arena buffers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import kp
import numpy as np

from vkflash.errors import DeviceError

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu

_ids = itertools.count()
STAGING_BYTES = 64 << 20


@dataclass(eq=False)
class Buffer:
    """A GPU storage buffer of `nbytes` (rounded up to 4), bound whole to shaders."""

    gpu: "Gpu | None"
    tensor: "kp.Tensor | None"
    nbytes: int
    host_visible: bool
    name: str = ""
    id: int = field(default_factory=lambda: next(_ids))

    @classmethod
    def virtual(cls, nbytes: int, name: str) -> "Buffer":
        """An intermediate of a step graph: memory comes from the arena when the graph is recorded."""
        return cls(None, None, max(4, (nbytes + 3) // 4 * 4), False, name)

    @property
    def is_virtual(self) -> bool:
        return self.tensor is None

    @property
    def words(self) -> int:
        return (self.nbytes + 3) // 4

    def _mapped(self) -> np.ndarray:
        """The mapped memory as bytes (host-visible buffers only)."""
        return self._real().data().view(np.uint8)

    def _real(self) -> "kp.Tensor":
        if self.tensor is None:
            raise ValueError(f"buffer {self.name!r} is a graph intermediate: it has no memory of its own")
        return self.tensor

    def view(self, dtype: np.dtype | type = np.uint32) -> np.ndarray:
        """A live view of a host-visible buffer's mapped memory (writes land without a copy call;
        valid while the buffer lives): for per-step values the host rewrites every replay."""
        if not self.host_visible:
            raise ValueError(f"buffer {self.name!r} is not host-visible")
        return self._mapped().view(dtype)

    def write(self, data: np.ndarray, offset: int = 0) -> None:
        """Copy `data` (any dtype, C-contiguous) into the buffer at byte `offset`."""
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if offset < 0 or offset + raw.nbytes > self.nbytes:
            raise ValueError(f"write of {raw.nbytes} B at {offset} overflows buffer {self.name!r} of {self.nbytes} B")
        if self.host_visible:
            self._mapped()[offset:offset + raw.nbytes] = raw
        else:
            self._real()
            self.gpu.staging.upload(self, raw, offset)

    def read(self, dtype: np.dtype | type = np.float32, count: int | None = None, offset: int = 0) -> np.ndarray:
        """A copy of `count` elements of `dtype` starting at byte `offset`."""
        dt = np.dtype(dtype)
        n = (self.nbytes - offset) // dt.itemsize if count is None else count
        if offset < 0 or offset + n * dt.itemsize > self.nbytes:
            raise ValueError(f"read past the end of buffer {self.name!r}")
        if self.host_visible:
            return self._mapped()[offset:offset + n * dt.itemsize].copy().view(dt)
        self._real()
        return self.gpu.staging.download(self, offset, n * dt.itemsize).view(dt)

    def fill(self, value: float | int, dtype: np.dtype | type = np.float32) -> None:
        """Set every element (of `dtype`) to `value`: used to poison outputs in tests."""
        dt = np.dtype(dtype)
        self.write(np.full(self.nbytes // dt.itemsize, value, dtype=dt))


def check_size(gpu: "Gpu", nbytes: int, name: str) -> None:
    limit = min(gpu.caps.max_storage_range, gpu.caps.max_allocation)
    # lavapipe reports 128 MiB but does not enforce it; real drivers do (4 GiB on the H200).
    if gpu.caps.device_type != "cpu" and nbytes > limit:
        raise DeviceError(f"buffer {name!r} of {nbytes} B exceeds the device's storage range {limit} B; split it")
    if nbytes >= 1 << 32:
        raise DeviceError(f"buffer {name!r} of {nbytes} B exceeds 4 GiB; split it")


def allocate(gpu: "Gpu", nbytes: int, name: str = "", host: bool = False) -> Buffer:
    """A new buffer; host-visible on UMA devices or when `host` (staging, step params)."""
    nbytes = max(4, (nbytes + 3) // 4 * 4)
    check_size(gpu, nbytes, name)
    visible = host or gpu.caps.uma
    ttype = kp.TensorTypes.host if visible else kp.TensorTypes.storage
    # np.empty does not touch its pages, so a device-only buffer costs no host memory here.
    init = np.zeros(nbytes // 4, np.uint32) if visible else np.empty(nbytes // 4, np.uint32)
    try:
        t = gpu.mgr.tensor_t(init, tensor_type=ttype)
    except Exception as e:
        raise DeviceError(f"could not allocate {nbytes} B for {name!r}: {e}") from None
    return Buffer(gpu, t, nbytes, visible, name)
