"""Graphs built with every fusion on, or with some off, to compare the fusion pass's rewrites."""

from __future__ import annotations

from vkflash.gpu.graph import Graph
from vkflash.gpu.options import Fusion, GpuOptions


def graph(gpu, name: str, fused: bool, *fusions: Fusion) -> Graph:
    """A graph whose ops get every fusion (fused) or all but `fusions` (not fused)."""
    opts = GpuOptions() if fused else GpuOptions().without(*fusions)
    return Graph(gpu, name, options=opts)
