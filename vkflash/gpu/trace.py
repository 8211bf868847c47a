"""GGML_VK-style tracing of submissions: job log, submit trace, perf logger, timeline file.

- VKFLASH_JOB_LOG=1: `job <id> <graph> ops=<n> barriers=<b> gpu=<ms> host=<ms>` per submission,
  and `note <line>` for events between them (the deep-context guard's steps).
- VKFLASH_SUBMIT_TRACE=1: each submission's op list, printed and flushed *before* it is sent,
  so a hang names its culprit.
- VKFLASH_PERF_LOGGER=1: per-op GPU time aggregated by name and shape, printed by `report()`
  (and at exit) as `NAME: count x avg us = total us (GFLOP/s)`.
- VKFLASH_TRACE_FILE=x.json: a Chrome/Perfetto timeline of submissions and ops.
All write to stderr so they never mix with generated text. The knobs are read once, into the
`Tracing` of a Gpu's options (gpu/options.py), when the Gpu is created.
"""

from __future__ import annotations

import atexit
import itertools
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from vkflash import settings

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph, Submission

_job_ids = itertools.count()
OUT: TextIO = sys.stderr


@dataclass(frozen=True)
class Tracing:
    """Which traces a Gpu's graphs write; `stamps` records GPU timestamps without printing them
    (`vkflash bench` reads them)."""

    job_log: bool = False
    submit_trace: bool = False
    perf_logger: bool = False
    file: str = ""
    stamps: bool = False

    @property
    def timestamps(self) -> bool:
        """GPU timestamps are recorded only when something reads them (they cost a little)."""
        return self.stamps or self.job_log or self.perf_logger or bool(self.file)

    @classmethod
    def from_settings(cls, s: settings.Settings) -> "Tracing":
        return cls(bool(s["VKFLASH_JOB_LOG"]), bool(s["VKFLASH_SUBMIT_TRACE"]), bool(s["VKFLASH_PERF_LOGGER"]),
                   str(s["VKFLASH_TRACE_FILE"]))


@dataclass
class _Perf:
    count: int = 0
    total_ns: float = 0.0
    flops: int = 0
    nbytes: int = 0


@dataclass
class _State:
    perf: dict[str, _Perf] = field(default_factory=lambda: defaultdict(_Perf))
    events: list[dict] = field(default_factory=list)
    file: str = ""  # where report() writes the timeline
    t0: float = field(default_factory=time.perf_counter)


STATE = _State()


def op_line(op) -> str:
    """`blk.12.attn_qkv mul_mat q4_K 2560x12288 n=2048` style description of a dispatch."""
    return f"{op.name} {op.kernel.name}" + (f" {op.desc}" if op.desc else "")


def before_submit(graph: "Graph", sub: "Submission") -> None:
    sub.job_id = next(_job_ids)
    if graph.options.tracing.submit_trace:
        OUT.write(f"submit {sub.job_id} {graph.name} ops={len(sub.ops)}\n")
        for op in sub.ops:
            OUT.write(f"  {op_line(op)}\n")
        OUT.flush()


def note(tracing: Tracing, line: str) -> None:
    """A line of the job log that is not a submission (the deep-context guard's steps)."""
    if tracing.job_log:
        OUT.write(f"note {line}\n")
        OUT.flush()


def submitted(graph: "Graph", sub: "Submission", t0: float) -> None:
    """sub was sent at perf_counter() t0 (the job log and timeline measure from there)."""
    sub.t_submit = t0


def finished(graph: "Graph", sub: "Submission") -> None:
    """sub's fence signalled: its job-log line, per-op times and timeline events, as the knobs ask."""
    if not sub.timestamps:  # decided when it was recorded, whatever the knobs say now
        return
    tr = graph.options.tracing
    if not (tr.job_log or tr.perf_logger or tr.file):
        return  # `stamps` only: the caller reads the timestamps itself, after its own timing
    ts = sub.seq.get_timestamps()
    period = graph.gpu.caps.timestamp_period_ns
    gpu_ms = (ts[sub.n_recorded] - ts[0]) * period / 1e6
    host_ms = (time.perf_counter() - sub.t_submit) * 1e3
    if tr.job_log:
        OUT.write(f"job {sub.job_id} {graph.name} ops={len(sub.ops)} barriers={sub.n_recorded - len(sub.ops) - 1} "
                  f"gpu={gpu_ms:.3f}ms host={host_ms:.3f}ms\n")
        OUT.flush()
    for op, slot in zip(sub.ops, sub.op_slots):
        ns = (ts[slot + 1] - ts[slot]) * period
        if tr.perf_logger:
            p = STATE.perf[op_line(op)]
            p.count += 1
            p.total_ns += ns
            p.flops += op.flops
            p.nbytes += op.nbytes
        if tr.file:
            start_us = (sub.t_submit - STATE.t0) * 1e6 + (ts[slot] - ts[0]) * period / 1e3
            STATE.events.append({"name": op.name, "cat": op.kernel.name, "ph": "X", "pid": 0, "tid": 0,
                                 "ts": start_us, "dur": ns / 1e3, "args": {"desc": op.desc}})
    if tr.file:
        STATE.file = tr.file
        STATE.events.append({"name": f"submit {sub.job_id} {graph.name}", "ph": "X", "pid": 0, "tid": 1,
                             "ts": (sub.t_submit - STATE.t0) * 1e6, "dur": host_ms * 1e3})


def report(out: TextIO | None = None) -> None:
    """Print the perf logger's table (largest total first) and write the timeline file."""
    out = out or OUT
    if STATE.perf:
        out.write("perf logger: per-op GPU time\n")
        for name, p in sorted(STATE.perf.items(), key=lambda kv: -kv[1].total_ns):
            avg_us = p.total_ns / p.count / 1e3
            rate = f" ({p.flops / p.total_ns:.2f} GFLOP/s)" if p.flops else (
                f" ({p.nbytes / p.total_ns:.2f} GB/s)" if p.nbytes else "")
            out.write(f"{name}: {p.count} x {avg_us:.2f} us = {p.total_ns / 1e3:.2f} us{rate}\n")
        out.flush()
        STATE.perf.clear()
    if STATE.file and STATE.events:
        with open(STATE.file, "w") as f:
            json.dump({"traceEvents": STATE.events}, f)


atexit.register(report)
