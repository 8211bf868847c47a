"""Selecting the cooperative-matrix flash-attention kernel in tests (tests/gpu and tests/engine): the
device's own attn_flash_cm_* kernels, or the CM_EMULATE build of the same shader (common/coopmat.glsl's
software matrices, with a scrambled component layout), which runs on any device (lavapipe in CI).

"device" skips unless the device can run the coopmat flash kernel. "emulated" registers
attn_flash_cmx_* kernels, points attention at them (attention.CM_KERNEL) and, on a device without
16×16×16 f16 matrices, pretends to offer them so the shape choice runs as on the target.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vkflash.gpu import registry
from vkflash.gpu.compile_shaders import cache_dir, have_compiler, variant_key
from vkflash.gpu.device import CoopmatShape
from vkflash.gpu.ops import attention as A
from vkflash.gpu.registry import Kernel

PATHS = ("device", "emulated")
SHAPE_16 = CoopmatShape(16, 16, 16, "f16", "f16", "f32", "f32")
EMULATED = "attn_flash_cmx"


def emulated_kernels() -> list[Kernel]:
    """The CM_EMULATE builds of the coopmat flash kernel, one per cache type."""
    return [Kernel(f"{EMULATED}_{c.value}", "attn_flash_cm.comp", 9, defines=((c.define, 1), ("CM_EMULATE", 1)),
                   local_size=A.CM_WG, push=A.FlashPush, spec=A.FlashCmSpec) for c in A.CacheType]


def select(path: str, gpu, monkeypatch, dim: int = 64) -> str:
    """Make `path` the coopmat flash kernel for this test (skipping where it cannot run at head dim
    `dim`); returns a label for messages."""
    caps = gpu.caps
    if path == "device":
        if not A.coopmat_flash_possible(caps, dim):
            pytest.skip(f"{caps.name} cannot run the coopmat flash kernel at head dim {dim}")
        return f"device coopmat {A.cm_tiles(caps, dim)}"
    missing = [k.name for k in emulated_kernels() if not have_compiler()
               and not (cache_dir() / f"{Path(k.shader).stem}-{variant_key(k.shader, dict(k.defines))}.spv").exists()]
    if missing:
        pytest.skip(f"no shader compiler here and no precompiled SPIR-V of {missing[0]} … (run "
                    "tests/gpu/test_attention_compile.py where glslang is installed and carry build/spv)")
    table = registry.table()
    for k in emulated_kernels():
        monkeypatch.setitem(table, k.name, k)
    monkeypatch.setattr(A, "CM_KERNEL", EMULATED)
    if not A.has_coopmat_16(caps):
        monkeypatch.setattr(gpu, "caps", replace(caps, coopmat=caps.coopmat + (SHAPE_16,)))
    if A.cm_tiles(gpu.caps, dim) is None:
        pytest.skip(f"no coopmat flash shape fits {caps.name}'s shared memory at head dim {dim}")
    return f"emulated coopmat {A.cm_tiles(gpu.caps, dim)}, subgroup {caps.subgroup_size}"
