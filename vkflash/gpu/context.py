"""The GPU: one Kompute manager on the chosen device, its capabilities, buffers and pipelines.

`Gpu()` opens VKFLASH_DEVICE (alias GGML_VK_VISIBLE_DEVICES) with the `GpuOptions` the knob
table says (how its graphs are fused, split and submitted). Algorithms (pipeline + bound buffers)
are created once per distinct (kernel, buffers, workgroups, spec constants) and shared by every
dispatch that needs the same one. The arena holds every graph's intermediates (gpu/alloc.py).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Sequence

import kp
import numpy as np

from vkflash import settings
from vkflash.errors import DeviceError
from vkflash.gpu.alloc import Arena
from vkflash.gpu.compile_shaders import compile_variant
from vkflash.gpu.device import Capabilities, probe
from vkflash.gpu.memory import STAGING_BYTES, Buffer, allocate
from vkflash.gpu.options import GpuOptions

if TYPE_CHECKING:
    from vkflash.gpu.graph import Dispatch, Graph


class Gpu:
    """One Vulkan device driven through Kompute."""

    def __init__(self, index: int | None = None, options: GpuOptions | None = None) -> None:
        self.index = settings.current()["VKFLASH_DEVICE"] if index is None else index
        self.options = options or GpuOptions.from_settings()
        self.caps: Capabilities = probe(self.index)
        try:
            self.mgr = kp.Manager(self.index)
        except Exception as e:
            raise DeviceError(f"could not open Vulkan device {self.index} ({self.caps.name}): {e}") from None
        self._algos: dict[tuple, "kp.Algorithm"] = {}
        self._spirv: dict[str, bytes] = {}
        self._staging: "Staging | None" = None
        self.arena = Arena(self)

    def with_options(self, options: GpuOptions, own_arena: bool = False) -> "Gpu":
        """The same device, buffers and pipelines (and arena, unless `own_arena`), building graphs
        with other options."""
        other = copy.copy(self)
        other.options = options
        if own_arena:
            other.arena = Arena(other)
        return other

    # --- buffers --------------------------------------------------------------------------
    def buffer(self, nbytes: int, name: str = "", host: bool = False) -> Buffer:
        """A new zero-initialised (UMA) or uninitialised (discrete) buffer."""
        return allocate(self, nbytes, name, host)

    def upload(self, data: np.ndarray, name: str = "") -> Buffer:
        """A new buffer holding a copy of `data`."""
        b = self.buffer(data.nbytes, name)
        b.write(data)
        return b

    @property
    def spin_wait(self) -> bool:
        """Whether submissions poll their fence (VKFLASH_SPIN_WAIT; auto: not on CPU drivers, where
        the polling core is one the driver computes on)."""
        v = self.options.spin_wait
        return v == "1" or (v == "auto" and self.caps.device_type != "cpu")

    @property
    def staging(self) -> "Staging":
        if self._staging is None:
            self._staging = Staging(self)
        return self._staging

    # --- pipelines ------------------------------------------------------------------------
    def spirv(self, kernel) -> bytes:
        if kernel.name not in self._spirv:
            self._spirv[kernel.name] = compile_variant(kernel.shader, dict(kernel.defines))
        return self._spirv[kernel.name]

    def algorithm(self, op: "Dispatch", buffers: Sequence[Buffer]) -> "kp.Algorithm":
        """The shared kp.Algorithm for this dispatch's kernel, (physical) buffers, workgroups and constants."""
        key = (op.kernel.name, tuple(b.id for b in buffers), op.groups, op.spec, len(op.push) or 1)
        algo = self._algos.get(key)
        if algo is None:
            spec = np.array((op.kernel.workgroup(self.caps), *op.spec), np.uint32)
            push = np.zeros(len(op.push) or 1, np.uint32)
            algo = self.mgr.algorithm([b.tensor for b in buffers], self.spirv(op.kernel), list(op.groups),
                                      spec, push)
            self._algos[key] = algo
        return algo

    def retire(self, buf: Buffer) -> None:
        """Forget the algorithms bound to a buffer being replaced (the arena grows one)."""
        for key in [k for k in self._algos if buf.id in k[1]]:
            del self._algos[key]

    def graph(self, name: str, max_ops_per_submission: int = 0) -> "Graph":
        from vkflash.gpu.graph import Graph

        return Graph(self, name, max_ops_per_submission)


class Staging:
    """Bounded host-visible ring for filling and reading device-local buffers (discrete GPUs)."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.host = gpu.buffer(STAGING_BYTES, "staging", host=True)

    def _copy(self, src: Buffer, src_off: int, dst: Buffer, dst_off: int, nbytes: int) -> None:
        from vkflash.gpu.ops.copy import copy_words

        g = self.gpu.graph("staging")
        copy_words(g, src, src_off // 4, dst, dst_off // 4, nbytes // 4)
        g.run()

    def upload(self, dst: Buffer, raw: np.ndarray, offset: int) -> None:
        lo, hi = offset // 4 * 4, (offset + raw.nbytes + 3) // 4 * 4
        if (lo, hi) != (offset, offset + raw.nbytes):  # unaligned edges: read-modify-write the words
            words = self.download(dst, lo, hi - lo)
            words[offset - lo:offset - lo + raw.nbytes] = raw
            raw, offset = words, lo
        for start in range(0, raw.nbytes, STAGING_BYTES):
            chunk = raw[start:start + STAGING_BYTES]
            self.host.write(chunk)
            self._copy(self.host, 0, dst, offset + start, chunk.nbytes)

    def download(self, src: Buffer, offset: int, nbytes: int) -> np.ndarray:
        lo, hi = offset // 4 * 4, (offset + nbytes + 3) // 4 * 4
        out = np.empty(hi - lo, np.uint8)
        for start in range(0, hi - lo, STAGING_BYTES):
            n = min(STAGING_BYTES, hi - lo - start)
            self._copy(src, lo + start, self.host, 0, n)
            out[start:start + n] = self.host.read(np.uint8, n)
        return out[offset - lo:offset - lo + nbytes]
