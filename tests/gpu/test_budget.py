"""The memory budget's sources: VKFLASH_MEM_BUDGET wins; a discrete GPU's device-local heap budget;
on UMA the least of the heaps' budget, the amdgpu GTT room and MemAvailable (files faked)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vkflash.gpu.budget import detect, gtt_free, mem_available
from vkflash.gpu.device import MemoryHeap

pytestmark = pytest.mark.gpu
G = 1 << 30


def _fake_system(tmp_path: Path, avail_kib: int, gtt: tuple[int, int] | None) -> tuple[Path, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 1 kB\nMemAvailable:   {avail_kib} kB\n")
    drm = tmp_path / "drm"
    (drm / "card0" / "device").mkdir(parents=True)
    if gtt is not None:
        (drm / "card0" / "device" / "mem_info_gtt_total").write_text(str(gtt[0]))
        (drm / "card0" / "device" / "mem_info_gtt_used").write_text(str(gtt[1]))
    return meminfo, drm


def test_budget_sources(gpu, tmp_path):
    heaps = (MemoryHeap(2 * G, True, G), MemoryHeap(100 * G, False, 90 * G))
    uma = replace(gpu.caps, uma=True, heaps=heaps)
    meminfo, drm = _fake_system(tmp_path, 80 * G // 1024, (124 * G, 4 * G))
    assert mem_available(meminfo) == 80 * G and gtt_free(drm) == 120 * G
    assert detect(uma, 5 * G, meminfo, drm).nbytes == 5 * G  # VKFLASH_MEM_BUDGET
    b = detect(uma, 0, meminfo, drm)
    assert b.nbytes == 80 * G and "MemAvailable" in b.source
    meminfo, drm = _fake_system(tmp_path / "x", 200 * G // 1024, (70 * G, 0))
    assert detect(uma, 0, meminfo, drm).nbytes == 70 * G
    meminfo, drm = _fake_system(tmp_path / "y", 200 * G // 1024, None)
    assert detect(uma, 0, meminfo, drm).nbytes == 91 * G  # both heaps' budgets
    discrete = replace(gpu.caps, uma=False, heaps=(MemoryHeap(140 * G, True, 130 * G), MemoryHeap(500 * G, False, 0)))
    b = detect(discrete, 0, meminfo, drm)
    assert b.nbytes == 130 * G and "device-local" in b.source
