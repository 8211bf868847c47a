"""Step graphs per architecture: each arch module has an `ArchGraph` (engine/graphs/common.py)
that states its forward as plain GPU ops, names its weight layout and allocates its state."""

from __future__ import annotations

from vkflash.engine.graphs.common import ArchGraph
from vkflash.engine.graphs.qwen2 import Qwen2Graph
from vkflash.engine.graphs.qwen3next import Qwen3NextGraph
from vkflash.engine.graphs.qwen4exp import Qwen4ExpGraph
from vkflash.errors import ModelError

ARCHS: dict[str, ArchGraph] = {"qwen2": Qwen2Graph(), "qwen3next": Qwen3NextGraph(), "qwen4exp": Qwen4ExpGraph()}


def for_arch(arch: str) -> ArchGraph:
    """The step graphs of `arch`; ModelError when the GPU forward does not have it yet."""
    try:
        return ARCHS[arch]
    except KeyError:
        raise ModelError(f"the GPU forward does not support arch {arch!r} yet (has: {', '.join(ARCHS)})") from None
