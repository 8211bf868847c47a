"""Selecting the cooperative-matrix flash-attention kernels in tests (tests/gpu and tests/engine): the
device's own attn_flash_cm_* and attn_flash_sg_* kernels, or the CM_EMULATE builds of the same shaders
(common/coopmat.glsl's software matrices, with a scrambled component layout), which run on any device
(lavapipe in CI).

"device" skips unless the device can run both coopmat flash kernels. "emulated" registers
attn_flash_cmx_* and attn_flash_sgx_* kernels, points attention at them (attention.CM_KERNEL,
attention.SG_KERNEL) and, on a device without 16×16×16 f16 matrices, pretends to offer them so the
shape choice runs as on the target.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vkflash.errors import DeviceError
from vkflash.gpu import registry
from vkflash.gpu.compile_shaders import _tool, cache_dir, variant_key
from vkflash.gpu.device import CoopmatShape
from vkflash.gpu.ops import attention as A
from vkflash.gpu.registry import Kernel

PATHS = ("device", "emulated")
SHAPE_16 = CoopmatShape(16, 16, 16, "f16", "f16", "f32", "f32")
EMULATED = "attn_flash_cmx"
EMULATED_SG = "attn_flash_sgx"
KINDS = (A.Flash.COOPMAT, A.Flash.ROWS)  # the matrix kernels
RUNS = [("scalar", A.Flash.SCALAR)] + [(p, k) for p in PATHS for k in KINDS]
"""(path, kernel) pairs of the tests that run every flash kernel: the scalar one, and each matrix kernel
on the device and emulated."""
RUN_IDS = [f"{p}-{k.value}" if p != "scalar" else p for p, k in RUNS]


def have_compiler() -> bool:
    """Whether compile_shaders finds glslangValidator and spirv-val (not on machines fed precompiled
    SPIR-V); the compile tests and the emulated kernels' skips ask."""
    try:
        for tool in ("glslangValidator", "spirv-val"):
            _tool(tool)
    except DeviceError:
        return False
    return True


def emulated_kernels() -> list[Kernel]:
    """The CM_EMULATE builds of both coopmat flash kernels, one per cache type."""
    return [Kernel(f"{EMULATED}_{c.value}", "attn_flash_cm.comp", 9, defines=((c.define, 1), ("CM_EMULATE", 1)),
                   local_size=A.CM_WG, push=A.FlashPush, spec=A.FlashCmSpec) for c in A.CacheType] + [
        Kernel(f"{EMULATED_SG}_{c.value}", "attn_flash_sg.comp", 9, defines=((c.define, 1), ("CM_EMULATE", 1)),
               local_size=A.SG_WG, push=A.FlashPush, spec=A.FlashSgSpec) for c in A.CacheType]


def select(path: str, gpu, monkeypatch, dim: int = 64) -> str:
    """Make `path` the coopmat flash kernels for this test (skipping where they cannot run at head dim
    `dim`); returns a label for messages."""
    caps = gpu.caps
    if path == "device":
        if not (A.coopmat_flash_possible(caps, dim) and A.rows_flash_possible(caps, dim)):
            pytest.skip(f"{caps.name} cannot run the coopmat flash kernels at head dim {dim}")
        return f"device coopmat {A.cm_tiles(caps, dim)} / {A.sg_tiles(caps, dim)}"
    if A.coopmat_flash_possible(caps, dim) and A.rows_flash_possible(caps, dim):
        pytest.skip(f"{caps.name} runs the coopmat flash kernels themselves (the device path); the software "
                    "matrices are for drivers without them")
    missing = [k.name for k in emulated_kernels() if not have_compiler()
               and not (cache_dir() / f"{Path(k.shader).stem}-{variant_key(k.shader, dict(k.defines))}.spv").exists()]
    if missing:
        pytest.skip(f"no shader compiler here and no precompiled SPIR-V of {missing[0]} … (run "
                    "tests/gpu/test_attention_compile.py where glslang is installed and carry build/spv)")
    table = registry.table()
    for k in emulated_kernels():
        monkeypatch.setitem(table, k.name, k)
    monkeypatch.setattr(A, "CM_KERNEL", EMULATED)
    monkeypatch.setattr(A, "SG_KERNEL", EMULATED_SG)
    if not A.has_coopmat_16(caps):
        monkeypatch.setattr(gpu, "caps", replace(caps, coopmat=caps.coopmat + (SHAPE_16,)))
    if A.cm_tiles(gpu.caps, dim) is None or A.sg_tiles(gpu.caps, dim) is None:
        pytest.skip(f"no coopmat flash shape fits {caps.name}'s shared memory at head dim {dim}")
    return (f"emulated coopmat {A.cm_tiles(gpu.caps, dim)} / {A.sg_tiles(gpu.caps, dim)}, "
            f"subgroup {caps.subgroup_size}")
