"""GPU buffers over Kompute tensors, UMA-aware.

On UMA devices (Strix Halo, lavapipe) every buffer is host-visible: uploads and reads are plain
memcpy into the mapped memory, no staging copy. On discrete devices buffers are device-local and
filled/read through a bounded host-visible staging ring with a compute-shader copy (much faster
than vkCmdCopyBuffer on the H200). A single buffer may not exceed the device's storage range:
larger tensors must be split by the caller (`check_size` says so).

A step graph's intermediates are *virtual* buffers (`Buffer.virtual`): a size and a name, no
memory, until the graph's allocator (gpu/alloc.py) places them in shared arena buffers.

A buffer's `nbytes` is what shaders may index; its memory backs the first `committed` bytes. Most
buffers commit everything at once; a growable one (a cache that fills as the context does) commits
a prefix and grows it (`Gpu.commit`), so the bytes it holds at depth t are an allocation, not a
hope about page backing. A `PlannedBuffer` (of a planning Gpu) has a size and no memory at all.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import kp
import numpy as np

from vkflash.errors import DeviceError, DoesNotFit

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.device import Capabilities

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
    committed: int = -1  # bytes backed by memory (a prefix of nbytes); -1: all of them

    def __post_init__(self) -> None:
        if self.committed < 0:
            self.committed = self.nbytes

    @classmethod
    def virtual(cls, nbytes: int, name: str) -> "Buffer":
        """An intermediate of a step graph: memory comes from the arena when the graph is recorded."""
        return cls(None, None, max(4, (nbytes + 3) // 4 * 4), False, name, committed=0)

    @property
    def is_virtual(self) -> bool:
        return self.gpu is None

    @property
    def words(self) -> int:
        return (self.nbytes + 3) // 4

    def _mapped(self) -> np.ndarray:
        """The mapped memory as bytes (host-visible buffers only)."""
        return self._real().data().view(np.uint8)

    def _real(self) -> "kp.Tensor":
        if self.tensor is None:
            raise ValueError(f"buffer {self.name!r} has no memory (a graph intermediate, or freed)")
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
        if offset < 0 or offset + raw.nbytes > self.committed:
            raise ValueError(f"write of {raw.nbytes} B at {offset} overflows buffer {self.name!r} "
                             f"({self.committed} of {self.nbytes} B committed)")
        if self.host_visible:
            self._mapped()[offset:offset + raw.nbytes] = raw
        else:
            self._real()
            self.gpu.staging.upload(self, raw, offset)

    def read(self, dtype: np.dtype | type = np.float32, count: int | None = None, offset: int = 0) -> np.ndarray:
        """A copy of `count` elements of `dtype` starting at byte `offset`."""
        dt = np.dtype(dtype)
        n = (self.committed - offset) // dt.itemsize if count is None else count
        if offset < 0 or offset + n * dt.itemsize > self.committed:
            raise ValueError(f"read past the end of buffer {self.name!r}")
        if self.host_visible:
            return self._mapped()[offset:offset + n * dt.itemsize].copy().view(dt)
        self._real()
        return self.gpu.staging.download(self, offset, n * dt.itemsize).view(dt)

    def fill(self, value: float | int, dtype: np.dtype | type = np.float32) -> None:
        """Set every element (of `dtype`) to `value`: used to poison outputs in tests."""
        dt = np.dtype(dtype)
        self.write(np.full(self.committed // dt.itemsize, value, dtype=dt))


@dataclass(eq=False)
class PlannedBuffer(Buffer):
    """A buffer of a planning Gpu (gpu/context.py PlanningGpu): sizes only. Writes are checked and
    dropped, reads give zeros, so the engine's allocation code runs unchanged to count bytes."""

    def write(self, data: np.ndarray, offset: int = 0) -> None:
        n = np.asarray(data).nbytes
        if offset < 0 or offset + n > self.committed:
            raise ValueError(f"write of {n} B at {offset} overflows buffer {self.name!r} of {self.committed} B")

    def read(self, dtype: np.dtype | type = np.float32, count: int | None = None, offset: int = 0) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.zeros((self.committed - offset) // dt.itemsize if count is None else count, dt)

    def fill(self, value: float | int, dtype: np.dtype | type = np.float32) -> None:
        return None


def buffer_limit(caps: "Capabilities") -> int:
    """Bytes of the largest buffer a shader can index whole here: the storage range and allocation
    limits (lavapipe reports 128 MiB but does not enforce it; real drivers do, 4 GiB on the H200),
    and below 4 GiB in any case (the shaders' byte offsets are 32-bit)."""
    limit = (1 << 32) - 4
    return limit if caps.device_type == "cpu" else min(limit, caps.max_storage_range, caps.max_allocation)


def check_size(gpu: "Gpu", nbytes: int, name: str) -> None:
    limit = buffer_limit(gpu.caps)
    if nbytes > limit:
        raise DeviceError(f"buffer {name!r} of {nbytes} B exceeds the largest buffer of this device ({limit} B); split it")


def words(nbytes: int) -> int:
    """nbytes rounded up to whole 32-bit words (at least one), in bytes."""
    return max(4, (nbytes + 3) // 4 * 4)


def backing(gpu: "Gpu", nbytes: int, visible: bool, name: str) -> "kp.Tensor":
    """A Kompute tensor of nbytes (whole words): host-visible and zeroed, or device-local."""
    ttype = kp.TensorTypes.host if visible else kp.TensorTypes.storage
    # np.empty does not touch its pages, so a device-only buffer costs no host memory here.
    init = np.zeros(nbytes // 4, np.uint32) if visible else np.empty(nbytes // 4, np.uint32)
    try:
        return gpu.mgr.tensor_t(init, tensor_type=ttype)
    except Exception as e:
        raise DeviceError(f"could not allocate {nbytes} B for {name!r}: {e}") from None


def allocate(gpu: "Gpu", nbytes: int, name: str = "", host: bool = False, commit: int | None = None) -> Buffer:
    """A new buffer; host-visible on UMA devices or when `host` (staging, step params). `commit`
    bytes (default: all) get memory now; the rest when the buffer grows (Gpu.commit)."""
    nbytes = words(nbytes)
    check_size(gpu, nbytes, name)
    visible = host or gpu.caps.uma
    held = nbytes if commit is None else min(nbytes, words(commit))
    return Buffer(gpu, backing(gpu, held, visible, name), nbytes, visible, name, committed=held)


def fmt_bytes(n: float) -> str:
    """Bytes for people: 512 B, 12.0 MiB, 1.50 GiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} B"


class Ledger:
    """A Gpu's live buffers and their committed bytes. `limit` (0: none) is the memory budget every
    allocation is checked against, in the pool it draws from: all memory on UMA, device-local memory
    on a discrete GPU (host-visible staging and step params live in host RAM there)."""

    def __init__(self, uma: bool) -> None:
        self.uma = uma
        self.limit = 0
        self.rebinds = 0  # bumped when a buffer's memory is replaced or freed: recorded graphs record again
        self._live: "weakref.WeakValueDictionary[int, Buffer]" = weakref.WeakValueDictionary()

    def add(self, buf: Buffer) -> None:
        self._live[buf.id] = buf

    def drop(self, buf: Buffer) -> None:
        self._live.pop(buf.id, None)
        self.rebinds += 1

    def counts(self, buf: Buffer) -> bool:
        """Whether buf draws from the budgeted pool."""
        return self.uma or not buf.host_visible

    def buffers(self) -> list[Buffer]:
        """Every live buffer."""
        return list(self._live.values())

    @property
    def total(self) -> int:
        """Committed bytes in the budgeted pool."""
        return sum(b.committed for b in self._live.values() if self.counts(b))

    @property
    def host(self) -> int:
        """Committed bytes outside it (discrete GPUs: host-visible buffers)."""
        return sum(b.committed for b in self._live.values() if not self.counts(b))

    def check(self, extra: int, what: str) -> None:
        """Raise DoesNotFit when `extra` more bytes would exceed the limit."""
        if self.limit and self.total + extra > self.limit:
            raise DoesNotFit(f"does not fit: {what} needs {fmt_bytes(extra)} more with {fmt_bytes(self.total)} of "
                             f"the {fmt_bytes(self.limit)} budget in use (VKFLASH_MEM_BUDGET, or the device's)")
