"""Every matmul variant (GEMV, scalar GEMM, cooperative-matrix GEMM × weight type) compiles and
passes spirv-val: the coopmat kernels cannot run on lavapipe, so this is their CI check.

The coopmat GEMMs (dense and expert) are also specialized with the constants vkflash picks for the
two devices that matter (the lent H200 and RADV on Strix Halo: shapes, shared memory, subgroup
sizes from their reports) and validated again, and their folded shared-memory size must be what
CmTile.smem says (the Python check that keeps tiles within the device's limit)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from cm_util import emulated_kernels
from flash_cm import have_compiler
from vkflash.gpu.compile_shaders import _tool, compile_variant
from vkflash.gpu.device import Capabilities, CoopmatShape
from vkflash.gpu.ops import moe
from vkflash.gpu.ops.matmul import CM_WG, COOPMAT_TYPES, EP_BIAS, EP_MUL, EP_RES, EP_SCALE, EP_SILU, KERNELS
from vkflash.gpu.ops.matmul import cm_shape, cm_spec, cm_tile

needs_compiler = pytest.mark.skipif(not have_compiler(), reason="no shader compiler here (precompiled SPIR-V only)")


@needs_compiler
@pytest.mark.parametrize("k", KERNELS + [k for k in moe.KERNELS if "_cm_" in k.name], ids=lambda k: k.name)
def test_compiles_and_validates(k):
    spv = compile_variant(k.shader, dict(k.defines), validate=True)
    assert spv[:4] == b"\x03\x02\x23\x07", "not a SPIR-V module"


@needs_compiler
@pytest.mark.parametrize("k", emulated_kernels(), ids=lambda k: k.name)
def test_emulated_compiles(k):
    """The CM_EMULATE builds the coopmat tests run on devices without coopmat (cm_util); compiling
    them here also leaves their SPIR-V in build/spv for devices that have no compiler."""
    compile_variant(k.shader, dict(k.defines), validate=True)


def _caps(name: str, shared: int, sg: tuple[int, int, int], shapes: tuple[tuple[int, int, int], ...]) -> Capabilities:
    return Capabilities(
        index=0, name=name, driver="", driver_info="", api_version="1.3", device_type="discrete", uma=False,
        subgroup_size=sg[0], subgroup_min=sg[1], subgroup_max=sg[2], subgroup_size_control=True,
        shared_memory=shared, max_invocations=1024, max_workgroup_count=(2**31 - 1, 65535, 65535),
        max_storage_range=2**32 - 1, max_allocation=2**32, timestamp_period_ns=1.0, fp16=True, int8=True,
        storage16=True, storage8=True, int_dot=True, bf16=False,
        coopmat=tuple(CoopmatShape(m, n, kk, "f16", "f16", "f32", "f32") for m, n, kk in shapes),
        heaps=(), host_visible_device_local=True, extensions=frozenset())


PROFILES = {  # as the devices report them
    "h200": _caps("NVIDIA H200", 48 << 10, (32, 32, 32), ((16, 16, 16), (16, 8, 16), (16, 8, 8))),
    "radv": _caps("AMD Radeon 8060S (RADV)", 64 << 10, (64, 32, 64), ((16, 16, 16),)),
}


def _specialize(spv: bytes, spec: list[int], tmp: Path) -> str:
    """spirv-opt with spec constants 0.. frozen to `spec` (bools as 0/1), then spirv-val; the disassembly."""
    src, out = tmp / "in.spv", tmp / "out.spv"
    src.write_bytes(spv)
    opt, env = _tool("spirv-opt")
    vals = " ".join(f"{i}:{v}" for i, v in enumerate(spec))
    r = subprocess.run([str(opt), "--target-env=vulkan1.3", f"--set-spec-const-default-value={vals}",
                        "--freeze-spec-const", "--fold-spec-const-op-composite", str(src), "-o", str(out)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, f"spirv-opt ({vals}): {r.stderr}"
    val, env = _tool("spirv-val")
    r = subprocess.run([str(val), "--target-env", "vulkan1.3", str(out)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, f"spirv-val of the module specialized to {vals}: {r.stdout}{r.stderr}"
    dis, env = _tool("spirv-dis")
    return subprocess.run([str(dis), str(out)], capture_output=True, text=True, env=env, check=True).stdout


def _smem_uvec4(dis: str) -> int:
    m = re.search(r"%SMEM = OpConstant %uint (\d+)", dis)
    assert m, "SMEM did not fold to a constant"
    return int(m.group(1))


ALL_EP = EP_SCALE | EP_BIAS | EP_SILU | EP_MUL | EP_RES
DENSE_SHAPES = ((4096, 4096), (12288, 40), (50, 4096), (50, 40))


@needs_compiler
@pytest.mark.parametrize("profile", PROFILES)
def test_dense_specialized(profile, tmp_path):
    """Every type at the 4096² tile, F16 and Q4_K at every tile cm_tile picks: valid when specialized,
    and the shader's shared memory is CmTile.smem within the device's limit."""
    caps = PROFILES[profile]
    shape = cm_shape(caps)
    assert (shape.m, shape.n, shape.k) == (16, 16, 16)
    cases = [(q, cm_tile(caps, 4096, 4096)) for q in COOPMAT_TYPES]
    cases += [(q, cm_tile(caps, n_out, n_tok)) for q in (Q.F16, Q.Q4_K) for n_out, n_tok in DENSE_SHAPES[1:]]
    assert str(cases[0][1]) == "128x128/64x32", f"{profile}: 4096² tile {cases[0][1]}"
    for q, tile in cases:
        spv = compile_variant("mul_mat_cm.comp", {"QTYPE": int(q)})
        dis = _specialize(spv, [CM_WG, ALL_EP, *cm_spec(caps, tile)], tmp_path)
        smem = 16 * _smem_uvec4(dis)
        assert smem == tile.smem(shape.n) <= caps.shared_memory, f"{profile} {q.name} {tile}: {smem} B"


@needs_compiler
@pytest.mark.parametrize("profile", PROFILES)
def test_expert_specialized(profile, tmp_path):
    """The expert GEMM: every type fused (GATE_UP) and as down at two tile widths, Q4_K in every mode
    and width: valid when specialized, shared memory (plus the tile's row tables) within the limit."""
    caps = PROFILES[profile]
    shape = cm_shape(caps)
    cases = [(q, moe.Mode.GATE_UP, 48) for q in COOPMAT_TYPES] + [(q, moe.Mode.DOWN, 64) for q in COOPMAT_TYPES]
    cases += [(Q.Q4_K, m, bn) for m in moe.Mode for bn in moe.TILES]
    for q, mode, bn in cases:
        nb = 2 if mode == moe.Mode.GATE_UP else 1
        tile = moe.cm_expert_tile(caps, bn, nb)
        assert tile is not None, f"{profile}: no expert tile for bn={bn} nb={nb}"
        spv = compile_variant("mul_mat_id_cm.comp", {"QTYPE": int(q)})
        dis = _specialize(spv, [CM_WG, int(mode), *cm_spec(caps, tile), 1], tmp_path)
        smem = 16 * _smem_uvec4(dis)
        assert smem == tile.smem(shape.n, nb), f"{profile} {q.name} {mode.name} bn={bn} {tile}: {smem} B"
        assert smem + 12 * bn <= caps.shared_memory


@needs_compiler
@pytest.mark.parametrize("profile", PROFILES)
def test_expert_fast_specialized(profile, tmp_path):
    """The expert GEMM with the wide-load fetch (FAST, spec constant 11) for every type with a
    wide-load decoder (and F16, which has none), fused and as down: valid when specialized, and the
    same folded shared memory as without it."""
    caps = PROFILES[profile]
    shape = cm_shape(caps)
    for q in (Q.Q4_K, Q.Q5_K, Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.F16):
        spv = compile_variant("mul_mat_id_cm.comp", {"QTYPE": int(q)})
        for mode, nb, bn in ((moe.Mode.GATE_UP, 2, 16), (moe.Mode.DOWN, 1, 48)):
            tile = moe.cm_expert_tile(caps, bn, nb)
            dis = _specialize(spv, [CM_WG, int(mode), *cm_spec(caps, tile), 1, 1], tmp_path)
            assert 16 * _smem_uvec4(dis) == tile.smem(shape.n, nb), f"{profile} {q.name} {mode.name} bn={bn} {tile}"


def test_subgroup_bound():
    """SG_MAX is the largest subgroup size the driver may pick (RADV: 64 of 32..64): the shaders size
    their per-subgroup accumulators for the fewest subgroups (256 / 64 = 4, two of the 8 warp tiles
    each) and hand the tiles out by the actual gl_NumSubgroups, so no tile is left out either way."""
    caps = PROFILES["radv"]
    tile = cm_tile(caps, 4096, 4096)
    assert cm_spec(caps, tile)[3] == 64 and tile.warp_tiles == 8
    assert cm_spec(PROFILES["h200"], tile)[3] == 32
    with pytest.raises(ValueError, match="two halves"):
        cm_spec(replace(caps, subgroup_max=256), tile)
