"""The memory budget: how many bytes vkflash may hold, from the device and the system.

Discrete GPU: what VK_EXT_memory_budget says the device-local heaps give this process (heap size
without the extension). UMA (Strix Halo: the "VRAM" is host RAM mapped through GTT): the least of
the heaps' budgets, the kernel's GTT room (amdgpu's mem_info_gtt_total − mem_info_gtt_used) and
the system's MemAvailable. VKFLASH_MEM_BUDGET replaces all of it. Read once, at startup.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vkflash.gpu.device import Capabilities
from vkflash.gpu.memory import fmt_bytes


@dataclass(frozen=True)
class Budget:
    """Bytes vkflash may hold in the pool its buffers draw from, and where the number came from."""

    nbytes: int
    source: str

    def __str__(self) -> str:
        return f"{fmt_bytes(self.nbytes)} ({self.source})"


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable in bytes (0 when unknown)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gtt_free(drm: Path = Path("/sys/class/drm")) -> int:
    """GTT bytes the amdgpu kernel driver can still map (the least over its cards; 0 when none)."""
    room = []
    for dev in sorted(drm.glob("card[0-9]*/device")):
        try:
            total = int((dev / "mem_info_gtt_total").read_text())
            used = int((dev / "mem_info_gtt_used").read_text())
        except (OSError, ValueError):
            continue
        room.append(max(0, total - used))
    return min(room, default=0)


def detect(caps: Capabilities, override: int = 0, meminfo: Path = Path("/proc/meminfo"),
           drm: Path = Path("/sys/class/drm")) -> Budget:
    """The budget for buffers on this device (`override` > 0: VKFLASH_MEM_BUDGET)."""
    if override:
        return Budget(override, "VKFLASH_MEM_BUDGET")
    heaps = [h for h in caps.heaps if h.device_local or caps.uma]
    heap = sum(h.budget or h.size for h in heaps)
    ext = "VK_EXT_memory_budget" if all(h.budget for h in heaps) else "heap sizes"
    if not caps.uma:
        return Budget(heap, f"{ext}, device-local heaps")
    found = [(heap, ext), (gtt_free(drm), "GTT room"), (mem_available(meminfo), "MemAvailable")]
    n, src = min((x for x in found if x[0] > 0), key=lambda x: x[0])
    return Budget(n, f"{src}, UMA")
