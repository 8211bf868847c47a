"""Raw Kompute replay cost: µs per eval() of one recorded sequence of n dispatches, and µs to
record it afresh. Runs against whichever `kp` is importable, so the same script measures stock
and patched Kompute (`vkflash bench kernels` runs it once per build, in a subprocess).

usage: python -m vkflash.gpu.replay_cost SPIRV_FILE [N ...]   → one JSON line per N
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import kp
import numpy as np

from vkflash.gpu.ops.copy import CopyPush


def measure(spirv: bytes, n: int, reps: int) -> dict[str, float]:
    """One sequence of n copy dispatches (copy.comp's SPIR-V): µs to record and run it, µs per replay."""
    mgr = kp.Manager(0)
    a = mgr.tensor_t(np.zeros(256, np.uint32), tensor_type=kp.TensorTypes.host)
    b = mgr.tensor_t(np.zeros(256, np.uint32), tensor_type=kp.TensorTypes.host)
    spec = np.array([64], np.uint32)
    push = np.array(CopyPush(src_off=0, dst_off=0, n=64, wide=0).words(), np.uint32)  # 64 words, one each
    algo = mgr.algorithm([a, b], spirv, [1, 1, 1], spec, push)
    t0 = time.perf_counter()
    seq = mgr.sequence()
    for _ in range(n):
        seq.record(kp.OpAlgoDispatch(algo, push))
    seq.eval()
    record_us = (time.perf_counter() - t0) * 1e6
    seq.eval()
    t0 = time.perf_counter()
    for _ in range(reps):
        seq.eval()
    replay_us = (time.perf_counter() - t0) / reps * 1e6
    return {"dispatches": n, "replay_us": replay_us, "record_and_run_us": record_us}


def main() -> int:
    spirv = Path(sys.argv[1]).read_bytes()
    for n in map(int, sys.argv[2:] or ["1", "100", "1000"]):
        print(json.dumps(measure(spirv, n, reps=max(5, 2000 // n))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
