"""The GPU: one Kompute manager on the chosen device, its capabilities, buffers and pipelines.

`Gpu()` opens VKFLASH_DEVICE (alias GGML_VK_VISIBLE_DEVICES) with the `GpuOptions` the knob
table says (how its graphs are fused, split and submitted). Algorithms (pipeline + bound buffers)
are created once per distinct (kernel, buffers, workgroups, spec constants) and shared by every
dispatch that needs the same one. The arena holds every graph's intermediates (gpu/alloc.py); the
ledger counts every live buffer's committed bytes against the memory budget (gpu/memory.py).

A `PlanningGpu` has the same interface and runs nothing: its buffers are sizes only, so the engine's
own allocation code, run on it, counts what a real forward would allocate (engine/plan.py).
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
from vkflash.gpu.memory import STAGING_BYTES, Buffer, Ledger, PlannedBuffer, allocate, backing, fmt_bytes, words
from vkflash.gpu.options import GpuOptions

if TYPE_CHECKING:
    from vkflash.gpu.graph import Dispatch, Graph


class Gpu:
    """One Vulkan device driven through Kompute."""

    planning = False  # a PlanningGpu runs nothing

    def __init__(self, options: GpuOptions | None = None) -> None:
        self.index = settings.current()["VKFLASH_DEVICE"]
        self.options = options or GpuOptions.from_settings()
        self.caps: Capabilities = probe(self.index)
        try:
            self.mgr = kp.Manager(self.index)
        except Exception as e:
            raise DeviceError(f"could not open Vulkan device {self.index} ({self.caps.name}): {e}") from None
        self._algos: dict[tuple, "kp.Algorithm"] = {}
        self._spirv: dict[str, bytes] = {}
        self._staging: "Staging | None" = None
        self.ledger = Ledger(self.caps.uma)
        self.arena = Arena(self)
        self.in_flight: dict[int, "Graph"] = {}  # graphs with submissions not yet waited for (shared by every view)

    def with_options(self, options: GpuOptions, own_arena: bool = False) -> "Gpu":
        """The same device, buffers and pipelines (and arena, ledger and staging ring, unless
        `own_arena`: then fresh ones, to measure one configuration), building graphs with other options."""
        other = copy.copy(self)
        other.options = options
        if own_arena:
            other.ledger = Ledger(self.caps.uma)
            other.arena = Arena(other)
            other._staging = None
        return other

    # --- buffers --------------------------------------------------------------------------
    def buffer(self, nbytes: int, name: str = "", host: bool = False, commit: int | None = None) -> Buffer:
        """A new zero-initialised (UMA) or uninitialised (discrete) buffer; `commit`: bytes backed
        now (default all; a growable buffer commits more with `commit()`). Checked against the budget."""
        held = words(nbytes if commit is None else min(nbytes, commit))
        if self.ledger.uma or not (host or self.caps.uma):
            self.ledger.check(held, f"allocating {name!r}")
        b = allocate(self, nbytes, name, host, commit)
        self.ledger.add(b)
        return b

    def commit(self, buf: Buffer, nbytes: int, keep: int | None = None) -> None:
        """Back the first nbytes of buf (grow or shrink its memory), keeping the first `keep` bytes
        of its contents (default: all both sizes hold), copied on the GPU. The old memory is freed
        after the copy, so the peak is old + new for this one buffer (keep=0: freed first)."""
        n = words(min(nbytes, buf.nbytes))
        if n == buf.committed:
            return
        keep = min(buf.committed, n) if keep is None else min(words(keep) if keep else 0, buf.committed, n)
        if self.ledger.counts(buf):
            self.ledger.check(n if keep else n - buf.committed, f"resizing {buf.name!r} to {fmt_bytes(n)}")
        self._replace_backing(buf, n, keep)
        buf.committed = n
        self.ledger.rebinds += 1

    def _replace_backing(self, buf: Buffer, n: int, keep: int) -> None:
        """Swap buf's memory for n new bytes holding its first `keep` bytes; the old memory freed
        (before the new is allocated when nothing is kept)."""
        from vkflash.gpu.ops.copy import copy_words

        old = buf.tensor
        assert old is not None
        self.idle()
        self.retire(buf)
        if not keep:
            old.destroy()
        fresh = Buffer(self, backing(self, n, buf.host_visible, buf.name), n, buf.host_visible, buf.name)
        if keep:
            g = self.graph(f"commit.{buf.name}")
            copy_words(g, buf, 0, fresh, 0, keep // 4, name=f"commit.{buf.name}")
            g.run()
            self.retire(buf)
            old.destroy()
        self.retire(fresh)
        buf.tensor = fresh.tensor

    def free(self, buf: Buffer) -> None:
        """Release buf's memory now (graphs that bind it must be rebuilt)."""
        self.idle()
        self.retire(buf)
        if buf.tensor is not None:
            buf.tensor.destroy()
            buf.tensor = None
        buf.committed = 0
        self.ledger.drop(buf)

    def idle(self) -> None:
        """Wait for every submission still in flight: memory is freed or replaced only after this, as
        a graph submitted without a wait (the MTP catch-up) may still read it."""
        while self.in_flight:
            self.in_flight.popitem()[1].wait()

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

    def staged(self) -> list[Buffer]:
        """The staging ring's buffer, once made (a device-local buffer was filled or read)."""
        return [self._staging.host] if self._staging is not None else []

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
        wg = op.kernel.workgroup(self.caps)  # in the key: a test may swap a kernel for one of another local size
        key = (op.kernel.name, wg, tuple(b.id for b in buffers), op.groups, op.spec, len(op.push) or 1)
        algo = self._algos.get(key)
        if algo is None:
            spec = np.array((wg, *op.spec), np.uint32)
            push = np.zeros(len(op.push) or 1, np.uint32)
            algo = self.mgr.algorithm([b.tensor for b in buffers], self.spirv(op.kernel), list(op.groups),
                                      spec, push)
            self._algos[key] = algo
        return algo

    def retire(self, buf: Buffer) -> None:
        """Forget the algorithms bound to a buffer being replaced (the arena grows one)."""
        for key in [k for k in self._algos if buf.id in k[2]]:
            del self._algos[key]

    def graph(self, name: str, max_ops_per_submission: int = 0) -> "Graph":
        from vkflash.gpu.graph import Graph

        return Graph(self, name, max_ops_per_submission)


class PlanningGpu(Gpu):
    """A Gpu that runs nothing, for the memory planner: the same capabilities and options, buffers
    that are sizes only (PlannedBuffer), the same arena and ledger. A forward built on it allocates
    exactly what a real one would, without a device and without reading the weights' data."""

    planning = True

    def __init__(self, caps: Capabilities, options: GpuOptions | None = None) -> None:
        self.index = caps.index
        self.options = options or GpuOptions.from_settings()
        self.caps = caps
        self._algos = {}
        self._spirv = {}
        self._staging = None
        self.ledger = Ledger(caps.uma)
        self.arena = Arena(self)
        self.in_flight = {}
        if not caps.uma:
            self.staging  # a discrete GPU's ring exists once the weights are uploaded

    @property
    def mgr(self) -> "kp.Manager":
        raise DeviceError("a planning Gpu runs nothing")

    def buffer(self, nbytes: int, name: str = "", host: bool = False, commit: int | None = None) -> Buffer:
        """A planned buffer of nbytes (`commit` of them counted now), checked against the budget."""
        n = words(nbytes)
        held = n if commit is None else min(n, words(commit))
        visible = host or self.caps.uma
        if self.ledger.uma or not visible:
            self.ledger.check(held, f"allocating {name!r}")
        b = PlannedBuffer(self, None, n, visible, name, committed=held)
        self.ledger.add(b)
        return b

    def _replace_backing(self, buf: Buffer, n: int, keep: int) -> None:
        return None

    def free(self, buf: Buffer) -> None:
        buf.committed = 0
        self.ledger.drop(buf)

    def graph(self, name: str, max_ops_per_submission: int = 0) -> "Graph":
        """A graph whose run() only places its intermediates (the bytes count, nothing runs)."""
        from vkflash.gpu.graph import PlannedGraph

        return PlannedGraph(self, name, max_ops_per_submission)


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
