"""Step graphs: the ops a step states, the fusion pass, the allocator, record once and replay.

A Graph is built as an ordered list of ops: typed `Node`s (the fusable ops of gpu/ops, e.g. a
matmul or a norm) and plain `Dispatch`es (kernel launches). On first use it is *lowered*: the
fusion pass (gpu/fuse.py, configured by the Gpu's `GpuOptions`) rewrites node patterns into fused
kernels, then every node emits its dispatches; `ops` is that final dispatch list. Intermediates
are virtual buffers (`tensor()`, `temp()`), placed by the liveness allocator (gpu/alloc.py) in the
Gpu's arena when the graph is recorded.

`record()` turns the dispatches into one or more submissions (kp sequences), with a
compute→compute barrier only where a dispatch depends on an earlier one (read-after-write,
write-after-read/write on the same physical buffer) and one at the start of each submission (it
orders against everything submitted before). A graph is cut, in op order, into submissions whose
estimated GPU time (gpu/cost.py) stays under the options' submission budget, unless it is built
with split=False (decode: always one submission). `run()` replays the recorded sequences: nothing
is re-recorded per step; per-step values (positions, token ids, lengths) live in a host-visible
step-params buffer the shaders read. Submissions are bounded in flight or serialized.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Sequence

import kp
import numpy as np

from vkflash.errors import DeviceError
from vkflash.gpu import cost, trace
from vkflash.gpu.interface import PushConstants, SpecConstants, pack
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.views import Rows

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.options import GpuOptions
    from vkflash.gpu.registry import Kernel

ROW_ALIGN = 4
"""Row strides of graph tensors are whole multiples of this many elements (16-byte vec4 loads)."""


class Node:
    """A fusable op not yet turned into dispatches: the fusion pass matches these by type."""

    name: str

    def inputs(self) -> tuple[Rows | Buffer, ...]:
        """Views (or whole buffers) the op reads."""
        raise NotImplementedError

    def outputs(self) -> tuple[Rows | Buffer, ...]:
        """Views (or whole buffers) the op writes."""
        raise NotImplementedError

    def lower(self, g: "Graph") -> None:
        """Emit the op's dispatches into g (g.dispatch)."""
        raise NotImplementedError

    def named(self) -> tuple[tuple[str, Rows], ...]:
        """Values final right after this op, by name (verify's taps): its first output by default."""
        outs = self.outputs()
        return ((self.name, outs[0]),) if outs and isinstance(outs[0], Rows) else ()


@dataclass
class Dispatch:
    """One kernel launch: what it runs, on which buffers, and which of them it writes."""

    name: str
    kernel: "Kernel"
    buffers: tuple[Buffer, ...]
    groups: tuple[int, int, int]
    push: tuple[int, ...]
    spec: tuple[int, ...]
    written: frozenset[int]  # indices into buffers
    desc: str = ""
    nbytes: int = 0  # bytes the op moves (for GB/s in the perf logger)
    flops: int = 0

    def inputs(self) -> tuple[Buffer, ...]:
        return tuple(b for i, b in enumerate(self.buffers) if i not in self.written)

    def outputs(self) -> tuple[Buffer, ...]:
        return tuple(self.buffers[i] for i in sorted(self.written))

    def lower(self, g: "Graph") -> None:
        g.emit(self)


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
    job_id: int = -1  # the job log's number for it (trace.before_submit)
    t_submit: float = 0.0  # perf_counter() when it was sent (trace.submitted)


class Graph:
    """The ops of one step (e.g. decode, or prefill of one ubatch bucket).

    split=False records one submission whatever its cost; otherwise submissions are bounded by the
    GPU-time budget under `rates` (the device's assumed ones) and by max_ops_per_submission (0: any).
    `options` default to the Gpu's.
    """

    records: ClassVar[int] = 0
    """Recordings made by all graphs so far: a caller timing replays can tell one happened."""

    def __init__(self, gpu: "Gpu", name: str, max_ops_per_submission: int = 0, split: bool = True,
                 options: "GpuOptions | None" = None) -> None:
        if not split and max_ops_per_submission:
            raise ValueError(f"{name}: an unsplit graph cannot have an op limit per submission")
        self.gpu = gpu
        self.name = name
        self.options = options or gpu.options
        self.nodes: list[Node | Dispatch] = []
        self.max_ops = max_ops_per_submission
        self.split = split
        self.rates: cost.Rates = cost.assumed_rates(gpu.caps)
        self.submissions: list[Submission] = []
        self.owned: list[Buffer] = []  # buffers the graph's kernels keep between replays
        self.temp_bytes = 0  # arena bytes this graph's intermediates need (set when placed)
        self._ops: list[Dispatch] | None = None
        self._sink: list[Dispatch] | None = None  # where dispatches go while lowering
        self._slot_of: dict[int, int] = {}  # arena slot of each intermediate (by id)
        self._epoch = -1  # the arena epoch the placement belongs to
        self._phys: dict[int, Buffer] = {}
        self._generation: tuple[int, int] = (-1, -1)  # (arena generation, ledger rebinds) when recorded
        self._pending: list[Submission] = []
        # where a named value lives: name -> (the dispatch after which it is final, buffer, element
        # offset, rows, columns, row stride), for `vkflash verify`'s taps
        self.views: dict[str, View] = {}

    # --- building -------------------------------------------------------------------------
    def add(self, node: Node) -> None:
        """Append a fusable op (while lowering: emit it at once)."""
        if self._sink is not None:
            node.lower(self)
            return
        self.nodes.append(node)
        self._changed()

    def dispatch(self, kernel: str, buffers: Sequence[Buffer], groups: Sequence[int],
                 push: PushConstants | Sequence[int] = (), spec: SpecConstants | Sequence[int] = (), name: str = "",
                 writes: Sequence[int] | None = None, desc: str = "", nbytes: int = 0, flops: int = 0) -> Dispatch:
        """Append a dispatch. push / spec are the kernel's declared typed constants (left empty where
        the declaration has no fields); `writes` are indices into `buffers` (default: the last one)."""
        from vkflash.gpu.registry import kernel as lookup

        k = lookup(kernel)
        if len(buffers) != k.n_buffers:
            raise ValueError(f"{kernel}: expected {k.n_buffers} buffers, got {len(buffers)}")
        g = tuple(int(x) for x in groups) + (1,) * (3 - len(groups))
        lim = self.gpu.caps.max_workgroup_count
        if any(x < 1 or x > m for x, m in zip(g, lim)):
            raise ValueError(f"{kernel}: workgroup count {g} outside 1..{lim}")
        w = {len(buffers) - 1} if writes is None else set(writes)
        op = Dispatch(name=name or kernel, kernel=k, buffers=tuple(buffers), groups=g,
                      push=pack(kernel, k.push, push), spec=pack(kernel, k.spec, spec),
                      written=frozenset(w), desc=desc, nbytes=nbytes, flops=flops)
        if self._sink is not None:
            self._sink.append(op)
        else:
            self.nodes.append(op)
            self._changed()
        return op

    def emit(self, op: Dispatch) -> None:
        """A built dispatch into the lowered list (Dispatch.lower)."""
        assert self._sink is not None, "emit() is for lowering"
        self._sink.append(op)

    def tensor(self, n_rows: int, n_cols: int, name: str) -> Rows:
        """A new intermediate of n_rows × n_cols f32 (row stride rounded up to ROW_ALIGN), tappable
        as `name` after the last dispatch of that name."""
        stride = -(-n_cols // ROW_ALIGN) * ROW_ALIGN
        rows = Rows(self.temp(4 * n_rows * stride, name), n_rows, n_cols, 0, stride)
        self.views.setdefault(name, View(name, rows.buf, 0, n_rows, n_cols, stride))
        return rows

    def temp(self, nbytes: int, name: str) -> Buffer:
        """A new intermediate buffer: memory from the arena, valid only within one replay."""
        return Buffer.virtual(nbytes, name)

    def own(self, nbytes: int, name: str) -> Buffer:
        """A zeroed buffer of this graph's kernels that keeps its contents between replays."""
        b = self.gpu.buffer(nbytes, name)
        b.fill(0, np.uint32)
        self.owned.append(b)
        return b

    def release(self) -> None:
        """Free the buffers this graph owns, when it is dropped: the device's algorithm cache would
        otherwise keep their memory alive, uncounted."""
        for b in self.owned:
            self.gpu.free(b)
        self.owned = []

    def expose(self, name: str, buf: Buffer, off: int, n_rows: int, n_cols: int, stride: int,
               after: str | None = None) -> None:
        """Declare that the value `name` is the (n_rows × n_cols, row stride) block at element
        `off` of `buf`, final after the last dispatch named `after` (default: `name`)."""
        self.views[name] = View(after or name, buf, off, n_rows, n_cols, stride)

    def _changed(self) -> None:
        self._ops = None
        self._epoch = -1
        self.submissions = []  # a changed graph must be lowered, placed and recorded again

    # --- lowering -------------------------------------------------------------------------
    @property
    def ops(self) -> list[Dispatch]:
        """The dispatches the graph runs: its nodes after the fusion pass, lowered (once)."""
        if self._ops is None:
            from vkflash.gpu.fuse import fuse

            self._sink = []
            try:
                for node in fuse(self):
                    node.lower(self)
                    if isinstance(node, Node):
                        for name, v in node.named():
                            self.views.setdefault(name, View(node.name, v.buf, v.off, v.n_rows, v.n_cols, v.stride))
                self._ops = self._sink
            finally:
                self._sink = None
        return self._ops

    @property
    def nbytes(self) -> int:
        """Memory of this graph: its intermediates' arena share and the buffers it owns."""
        return self.temp_bytes + sum(b.nbytes for b in self.owned)

    # --- recording ------------------------------------------------------------------------
    def estimates(self) -> list[float]:
        """Each dispatch's estimated GPU seconds under the graph's rates."""
        return [self.rates.seconds(op.nbytes, op.flops) for op in self.ops]

    def _split(self) -> list[list[Dispatch]]:
        """The op list cut into submissions, in order (one when split=False)."""
        if not self.split:
            return [list(self.ops)]
        budget = self.options.submit_budget_ms / 1e3
        return [self.ops[r.start:r.stop] for r in cost.cut(self.estimates(), budget, self.max_ops)]

    def physical(self, b: Buffer) -> Buffer:
        """The buffer a dispatch really binds for b (an intermediate's arena buffer once recorded)."""
        return self._phys.get(b.id, b) if b.is_virtual else b

    def place(self) -> None:
        """Give the intermediates their arena slots (once per arena epoch; growing the arena where
        they do not fit). The memory planner places graphs without recording them."""
        arena = self.gpu.arena
        if self._epoch != arena.epoch:
            self._slot_of, self.temp_bytes = arena.place(self.ops)
            self._epoch = arena.epoch

    @property
    def _bound(self) -> tuple[int, int]:
        """What a recording depends on: the arena's buffers and every buffer's memory."""
        return self.gpu.arena.generation, self.gpu.ledger.rebinds

    def record(self) -> None:
        """Place the intermediates and record every submission once (barriers only on real
        dependencies); the budget and rates in effect now decide the cuts."""
        Graph.records += 1
        timestamps = self.options.tracing.timestamps
        self.place()
        slots = self.gpu.arena.slots
        self._phys = {vid: slots[i] for vid, i in self._slot_of.items()}
        self._generation = self._bound
        self.submissions = []
        every = not self.options.dep_barriers
        for run in self._split():
            n_kp = 2 + 2 * len(run)  # upper bound: a barrier before every op, one to the host
            seq = self.gpu.mgr.sequence(0, n_kp + 1 if timestamps else 0)
            seq.set_spin_wait(self.gpu.spin_wait)
            sub = Submission(run, seq, timestamps=timestamps)
            seq.record(kp.OpBarrier())
            sub.n_recorded = 1
            written: set[int] = set()
            read: set[int] = set()
            for op in run:
                bufs = [self.physical(b) for b in op.buffers]
                writes = {bufs[i].id for i in op.written}
                reads = {b.id for i, b in enumerate(bufs) if i not in op.written}
                if every or reads & written or writes & (written | read):
                    seq.record(kp.OpBarrier())
                    sub.n_recorded += 1
                    written, read = set(), set()
                # Host writes are visible at submit and every dependency gets an OpBarrier, so the
                # stock per-tensor transfer barrier would only cost time.
                seq.record(kp.OpAlgoDispatch(self.gpu.algorithm(op, bufs), np.array(op.push or (0,), np.uint32),
                                             transfer_barrier=False))
                sub.op_slots.append(sub.n_recorded)
                sub.n_recorded += 1
                written |= writes
                read |= reads
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
        """Replay without waiting for the last submission (at most max_inflight in flight); records
        first when never recorded or when a buffer it may bind got new memory."""
        if not self.submissions or self._generation != self._bound:
            self.record()
        limit = 1 if self.options.serialize else self.options.max_inflight
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
            self.gpu.in_flight[id(self)] = self
            trace.submitted(self, sub, sub_t0)

    @property
    def in_flight(self) -> int:
        """Submissions sent and not yet waited for."""
        return len(self._pending)

    def wait(self) -> None:
        """Wait for every submission still in flight."""
        while self._pending:
            self._finish(self._pending.pop(0))
        self.gpu.in_flight.pop(id(self), None)

    def _finish(self, sub: Submission) -> None:
        try:
            sub.seq.eval_await()
        except RuntimeError as e:
            self._pending.clear()
            self.gpu.in_flight.pop(id(self), None)
            raise DeviceError(f"{self.name}: the GPU failed while running it: {e}") from e
        trace.finished(self, sub)


class PlannedGraph(Graph):
    """A graph of a planning Gpu (gpu/context.py): running it places its intermediates in the arena
    (what the memory planner counts) and dispatches nothing."""

    def run(self) -> None:
        self.place()
