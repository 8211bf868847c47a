"""The raw Kompute replay-cost script (`vkflash bench kernels` runs it per kp build) launches the copy
kernel with the push constants copy.comp declares, not a word list of its own that drifts from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vkflash.gpu import replay_cost
from vkflash.gpu.interface import layout
from vkflash.gpu.ops.copy import CopyPush


@dataclass
class _Recorder:
    """Stands in for `kp`: keeps the push and spec words of every algorithm and dispatch."""

    pushes: list[np.ndarray] = field(default_factory=list)
    specs: list[np.ndarray] = field(default_factory=list)

    class TensorTypes:
        host = "host"

    def Manager(self, device: int) -> "_Recorder":
        return self

    def tensor_t(self, data: np.ndarray, tensor_type: str) -> np.ndarray:
        return data

    def algorithm(self, tensors: list, spirv: bytes, groups: list[int], spec: np.ndarray, push: np.ndarray) -> str:
        self.specs.append(spec)
        self.pushes.append(push)
        return "algo"

    def sequence(self) -> "_Recorder":
        return self

    def record(self, op: object) -> None:
        pass

    def eval(self) -> None:
        pass

    def OpAlgoDispatch(self, algo: str, push: np.ndarray) -> None:
        self.pushes.append(push)


def test_replay_cost_pushes_copy_constants(monkeypatch, rng):
    fake = _Recorder()
    monkeypatch.setattr(replay_cost, "kp", fake)
    n = int(rng.integers(1, 5))
    row = replay_cost.measure(b"", n, reps=1)
    assert row["dispatches"] == n and len(fake.pushes) == n + 1
    for push in fake.pushes:
        assert push.dtype == np.uint32 and len(push) == len(layout(CopyPush))
