"""Record once, replay: a step graph of dispatches recorded into Kompute sequences.

A Graph is an ordered list of dispatches. `record()` turns it into one or more submissions
(kp sequences), with a compute→compute barrier only where a dispatch depends on an earlier one
(read-after-write, write-after-read/write on the same buffer) and one at the start of each
submission (it orders against everything submitted before). A graph is cut, in op order, into
submissions whose estimated GPU time (gpu/cost.py) stays under VKFLASH_SUBMIT_BUDGET_MS, unless it
is built with split=False (decode: always one submission). `run()` replays the recorded sequences: nothing is re-recorded per step; per-step values (positions, token ids, lengths)
live in a host-visible step-params buffer the shaders read. Submissions are bounded in flight
(VKFLASH_MAX_INFLIGHT) or serialized (VKFLASH_SERIALIZE_SUBMISSIONS=1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import kp
import numpy as np

from vkflash import settings
from vkflash.errors import DeviceError
from vkflash.gpu import cost, trace
from vkflash.gpu.interface import PushConstants, SpecConstants, pack
from vkflash.gpu.memory import Buffer

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.registry import Kernel


@dataclass
class Dispatch:
    """One kernel launch: what it runs, on which buffers, and what it reads and writes."""

    name: str
    kernel: "Kernel"
    buffers: tuple[Buffer, ...]
    groups: tuple[int, int, int]
    push: tuple[int, ...]
    spec: tuple[int, ...]
    reads: frozenset[int]
    writes: frozenset[int]
    desc: str = ""
    nbytes: int = 0  # bytes the op moves (for GB/s in the perf logger)
    flops: int = 0


@dataclass(frozen=True)
class View:
    """Where a named value lives (Graph.expose)."""

    after: str
    buf: Buffer
    off: int
    n_rows: int
    n_cols: int
    stride: int


@dataclass
class Submission:
    """A contiguous run of dispatches recorded into one kp sequence."""

    ops: list[Dispatch]
    seq: "kp.Sequence | None" = None
    n_recorded: int = 0  # kp ops incl. barriers (timestamps are per kp op)
    op_slots: list[int] = field(default_factory=list)  # kp op index of each dispatch
    timestamps: bool = False  # recorded with a timestamp after every kp op


class Graph:
    """Dispatches of one step (e.g. decode, or prefill of one ubatch bucket).

    split=False records one submission whatever its cost; otherwise submissions are bounded by the
    GPU-time budget under `rates` (the device's assumed ones) and by max_ops_per_submission (0: any).
    """

    def __init__(self, gpu: "Gpu", name: str, max_ops_per_submission: int = 0, split: bool = True) -> None:
        if not split and max_ops_per_submission:
            raise ValueError(f"{name}: an unsplit graph cannot have an op limit per submission")
        self.gpu = gpu
        self.name = name
        self.ops: list[Dispatch] = []
        self.max_ops = max_ops_per_submission
        self.split = split
        self.rates: cost.Rates = cost.assumed_rates(gpu.caps)
        self.submissions: list[Submission] = []
        self._pending: list[Submission] = []
        # where a named value lives when it is not the leading rows of its op's output buffer:
        # name -> (the dispatch after which it is final, buffer, element offset, rows, columns,
        # row stride), for `vkflash verify`'s taps
        self.views: dict[str, View] = {}

    # --- building -------------------------------------------------------------------------
    def dispatch(self, kernel: str, buffers: Sequence[Buffer], groups: Sequence[int],
                 push: PushConstants | Sequence[int] = (), spec: SpecConstants | Sequence[int] = (), name: str = "",
                 writes: Sequence[int] | None = None, desc: str = "", nbytes: int = 0, flops: int = 0) -> Dispatch:
        """Append a dispatch. push / spec are the kernel's declared typed constants (plain word lists
        for a kernel that declares none); `writes` are indices into `buffers` (default: the last one)."""
        from vkflash.gpu.registry import kernel as lookup

        k = lookup(kernel)
        if len(buffers) != k.n_buffers:
            raise ValueError(f"{kernel}: expected {k.n_buffers} buffers, got {len(buffers)}")
        g = tuple(int(x) for x in groups) + (1,) * (3 - len(groups))
        lim = self.gpu.caps.max_workgroup_count
        if any(x < 1 or x > m for x, m in zip(g, lim)):
            raise ValueError(f"{kernel}: workgroup count {g} outside 1..{lim}")
        w = {len(buffers) - 1} if writes is None else set(writes)
        op = Dispatch(
            name=name or kernel, kernel=k, buffers=tuple(buffers), groups=g,
            push=pack(kernel, k.push, push), spec=pack(kernel, k.spec, spec),
            reads=frozenset(b.id for i, b in enumerate(buffers) if i not in w),
            writes=frozenset(buffers[i].id for i in w), desc=desc, nbytes=nbytes, flops=flops)
        self.ops.append(op)
        self.submissions = []  # a changed graph must be recorded again
        return op

    def expose(self, name: str, buf: Buffer, off: int, n_rows: int, n_cols: int, stride: int,
               after: str | None = None) -> None:
        """Declare that the value `name` is the (n_rows × n_cols, row stride) block at element
        `off` of `buf`, final after the last dispatch named `after` (default: `name`)."""
        self.views[name] = View(after or name, buf, off, n_rows, n_cols, stride)

    # --- recording ------------------------------------------------------------------------
    def estimates(self) -> list[float]:
        """Each dispatch's estimated GPU seconds under the graph's rates."""
        return [self.rates.seconds(op.nbytes, op.flops) for op in self.ops]

    def _split(self) -> list[list[Dispatch]]:
        """The op list cut into submissions, in order (one when split=False)."""
        if not self.split:
            return [list(self.ops)]
        budget = settings.current()["VKFLASH_SUBMIT_BUDGET_MS"] / 1e3
        return [self.ops[r.start:r.stop] for r in cost.cut(self.estimates(), budget, self.max_ops)]

    def record(self) -> None:
        """Record every submission once (barriers only on real dependencies); the budget and rates
        in effect now decide the cuts, so record again after changing them."""
        timestamps = trace.wants_timestamps()
        self.submissions = []
        for ops in self._split():
            n_kp = 2 + 2 * len(ops)  # upper bound: a barrier before every op, one to the host
            seq = self.gpu.mgr.sequence(0, n_kp + 1 if timestamps else 0)
            seq.set_spin_wait(self.gpu.spin_wait)
            sub = Submission(ops, seq, timestamps=timestamps)
            seq.record(kp.OpBarrier())
            sub.n_recorded = 1
            written: set[int] = set()
            read: set[int] = set()
            every = not settings.current()["VKFLASH_DEP_BARRIERS"]
            for op in ops:
                if every or op.reads & written or op.writes & (written | read):
                    seq.record(kp.OpBarrier())
                    sub.n_recorded += 1
                    written, read = set(), set()
                # Host writes are visible at submit and every dependency gets an OpBarrier, so the
                # stock per-tensor transfer barrier would only cost time.
                seq.record(kp.OpAlgoDispatch(self.gpu.algorithm(op), np.array(op.push or (0,), np.uint32),
                                             transfer_barrier=False))
                sub.op_slots.append(sub.n_recorded)
                sub.n_recorded += 1
                written |= op.writes
                read |= op.reads
            # The fence alone does not make shader writes visible to host reads of mapped memory.
            seq.record(kp.OpBarrier(kp.STAGE_COMPUTE, kp.STAGE_HOST, kp.ACCESS_SHADER_WRITE, kp.ACCESS_HOST_READ))
            sub.n_recorded += 1
            self.submissions.append(sub)

    @property
    def barriers(self) -> int:
        """Compute→compute barriers recorded (the closing compute→host barrier not counted)."""
        return sum(s.n_recorded - len(s.ops) - 1 for s in self.submissions)

    # --- replay ---------------------------------------------------------------------------
    def run(self) -> None:
        """Replay the recorded graph and wait for it."""
        self.submit()
        self.wait()

    def submit(self) -> None:
        """Replay without waiting for the last submission (at most MAX_INFLIGHT in flight)."""
        if not self.submissions:
            self.record()
        s = settings.current()
        limit = 1 if s["VKFLASH_SERIALIZE_SUBMISSIONS"] else s["VKFLASH_MAX_INFLIGHT"]
        for sub in self.submissions:
            while len(self._pending) >= limit:
                self._finish(self._pending.pop(0))
            trace.before_submit(self, sub)
            sub_t0 = time.perf_counter()
            try:
                sub.seq.eval_async()
            except RuntimeError as e:  # kp's form of VK_ERROR_DEVICE_LOST, out of memory, …
                raise DeviceError(f"{self.name}: submission failed: {e}") from e
            self._pending.append(sub)
            trace.submitted(self, sub, sub_t0)

    @property
    def in_flight(self) -> int:
        """Submissions sent and not yet waited for."""
        return len(self._pending)

    def wait(self) -> None:
        """Wait for every submission still in flight."""
        while self._pending:
            self._finish(self._pending.pop(0))

    def _finish(self, sub: Submission) -> None:
        t0 = time.perf_counter()
        try:
            sub.seq.eval_await()
        except RuntimeError as e:
            self._pending.clear()
            raise DeviceError(f"{self.name}: the GPU failed while running it: {e}") from e
        trace.finished(self, sub, t0)
