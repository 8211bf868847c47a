"""Op cost model: a dispatch's GPU time estimated from the bytes it moves and the flops it does,
against rates the device is assumed to sustain, so a prefill graph can be cut into submissions
that each stay under a GPU-time budget (VKFLASH_SUBMIT_BUDGET_MS: long submissions
at depth trip the driver's watchdog).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vkflash.gpu.device import Capabilities


@dataclass(frozen=True)
class Rates:
    """Throughputs a device is assumed to sustain: B bytes/s, F flop/s, and t₀ s per dispatch."""

    B: float
    F: float
    t0: float

    def seconds(self, nbytes: int, flops: int) -> float:
        """t = t₀ + max(nbytes / B, flops / F): the op's roofline time plus its launch."""
        return self.t0 + max(nbytes / self.B, flops / self.F)


# Deliberately low rates per device type: overestimating only cuts a prefill into a few more
# submissions (tens of µs each), underestimating risks a submission that outlives the watchdog.
ASSUMED: dict[str, Rates] = {
    "cpu": Rates(B=4e9, F=2e10, t0=20e-6),
    "integrated": Rates(B=5e10, F=1e12, t0=5e-6),
    "discrete": Rates(B=5e11, F=1e13, t0=5e-6),
}


def assumed_rates(caps: "Capabilities") -> Rates:
    """The rates assumed for this device's type (an unknown type is treated as integrated)."""
    return ASSUMED.get(caps.device_type, ASSUMED["integrated"])


def cut(costs: Sequence[float], budget: float, max_ops: int = 0) -> list[range]:
    """Op index runs, in order, covering every op: each run's summed cost is ≤ budget and it holds
    at most max_ops ops (0: no count limit); an op costlier than the budget gets a run of its own.
    Greedy (a run closes only when the next op would not fit), so the run count is the fewest
    possible. An empty op list is one empty run."""
    if budget <= 0:
        raise ValueError(f"submission budget must be positive, got {budget}")
    runs: list[range] = []
    start, total = 0, 0.0
    for i, c in enumerate(costs):
        full = max_ops and i - start >= max_ops
        if i > start and (full or total + c > budget):
            runs.append(range(start, i))
            start, total = i, 0.0
        total += c
    runs.append(range(start, len(costs)))
    return runs
