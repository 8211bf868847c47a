"""Selecting the cooperative-matrix GEMM path in tests: the device's own coopmat kernels, or the
CM_EMULATE build of the same shaders (common/mm_cm.glsl), which runs on any device (lavapipe in CI).

"device" skips unless the device offers an f16×f16→f32 coopmat shape the GEMMs can use. "emulated"
registers mul_mat_cmx_* / mul_mat_id_cmx_* kernels (CM_EMULATE), points matmul / moe at them and,
on a device without coopmat, pretends to offer 16×16×16 so the Python tile choice runs as on the
target. Emulation needs the subgroup size fixed (it spreads an accumulator over SG_MAX lanes), so
it skips where the driver may pick among several sizes.
"""

from __future__ import annotations

from dataclasses import replace

from pathlib import Path

import pytest

from flash_cm import have_compiler
import vkflash.gpu.ops.matmul as mm
import vkflash.gpu.ops.moe as moe
from vkflash.gpu import registry
from vkflash.gpu.compile_shaders import cache_dir, variant_key
from vkflash.gpu.device import CoopmatShape
from vkflash.gpu.registry import Kernel, kernel

U16 = 2.0**-11  # unit roundoff of f16 (coopmat inputs)
PATHS = ("device", "emulated")
SHAPE_16 = CoopmatShape(16, 16, 16, "f16", "f16", "f32", "f32")


def device_has_coopmat(caps) -> bool:
    return (mm.cm_shape(caps) is not None and kernel("mul_mat_cm_f16").usable(caps)
            and mm.cm_tile(caps, 1, 1) is not None)


def emulated_kernels() -> list[Kernel]:
    """The CM_EMULATE builds of the dense and expert coopmat GEMMs, one per weight type."""
    out = []
    for t in mm.COOPMAT_TYPES:
        for fam, shader, n_buf, push, spec in (
                ("mul_mat_cmx", "mul_mat_cm.comp", 6, mm.MatMulSplitPush, mm.MatMulCmSpec),
                ("mul_mat_id_cmx", "mul_mat_id_cm.comp", 5, moe.ExpertGemmPush, moe.ExpertGemmCmSpec)):
            out.append(Kernel(f"{fam}_{t.name.lower()}", shader, n_buf, (("QTYPE", int(t)), ("CM_EMULATE", 1)),
                              local_size=mm.CM_WG, push=push, spec=spec))
    return out


def select(path: str, gpu, monkeypatch) -> str:
    """Make `path` the coopmat path of matmul / expert_gemm for this test; returns a label for messages."""
    caps = gpu.caps
    if path == "device":
        if not device_has_coopmat(caps):
            pytest.skip(f"{caps.name} offers no f16×f16→f32 cooperative matrix the coopmat GEMMs can use")
        return f"device coopmat {mm.cm_shape(caps)}"
    if caps.subgroup_min != caps.subgroup_max:
        pytest.skip(f"emulated coopmat needs a fixed subgroup size ({caps.name}: {caps.subgroup_min}..{caps.subgroup_max})")
    missing = [k.name for k in emulated_kernels() if not have_compiler()
               and not (cache_dir() / f"{Path(k.shader).stem}-{variant_key(k.shader, dict(k.defines))}.spv").exists()]
    if missing:
        pytest.skip(f"no shader compiler here and no precompiled SPIR-V of {missing[0]} … (run "
                    "tests/gpu/test_matmul_compile.py where glslang is installed and carry build/spv)")
    table = registry.table()
    for k in emulated_kernels():
        monkeypatch.setitem(table, k.name, k)
    monkeypatch.setattr(mm, "CM_KERNEL", "mul_mat_cmx")
    monkeypatch.setattr(moe, "CM_KERNEL", "mul_mat_id_cmx")
    if not device_has_coopmat(caps):
        monkeypatch.setattr(gpu, "caps", replace(caps, coopmat=(SHAPE_16,)))
    return f"emulated coopmat {mm.cm_shape(gpu.caps)} subgroup {gpu.caps.subgroup_size}"


def narrow_workgroup(gpu, monkeypatch) -> int:
    """Run the coopmat GEMMs with 4 subgroups per workgroup (CM_WG = 4 × the subgroup size) instead of
    8: the 8 warp tiles of every tile are then owned two per subgroup (the shaders' PER_SG = 2), as
    on a device whose driver may pick subgroups twice as wide as it does (RADV: wave64 of 32..64).
    Call after select(); returns the workgroup size."""
    wg = 4 * gpu.caps.subgroup_size
    monkeypatch.setattr(mm, "CM_WG", wg)
    monkeypatch.setattr(moe, "CM_WG", wg)
    table = registry.table()
    for name, k in list(table.items()):
        if "_cm_" in name or "_cmx_" in name:
            monkeypatch.setitem(table, name, replace(k, local_size=wg))
    return wg

