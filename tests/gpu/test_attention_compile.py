"""Every flash-attention variant compiles and passes spirv-val: the coopmat kernels cannot run on
lavapipe, so this is their CI check (the emulated builds of tests/flash_cm.py too, which also leaves
their SPIR-V in build/spv for devices without a compiler).

Both coopmat kernels are also specialized with the shape vkflash picks (cm_tiles) on the two devices that
matter (test_matmul_compile.PROFILES: the H200, RADV on Strix Halo) and on the H200 in every other
CM_SHAPES / SG_SHAPES entry that fits, at Dh 256, validated again, and their folded shared arrays must
take exactly CmTiles.shared_bytes / SgTiles.shared_bytes (the Python checks that keep a shape within the
device's shared memory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flash_cm import emulated_kernels, have_compiler
from test_matmul_compile import PROFILES, _specialize
from vkflash.gpu.compile_shaders import compile_variant
from vkflash.gpu.ops.attention import CM_SHAPES, CM_WG, KERNELS, SG_SHAPES, SG_WG, CmTiles, SgTiles, cm_fits, \
    cm_tiles, sg_fits, sg_tiles

pytestmark = pytest.mark.skipif(not have_compiler(), reason="no shader compiler here (precompiled SPIR-V only)")

SIZES = {"uint": 4, "float": 4, "half": 2}  # element types of the shared arrays (and 4-vectors of them)


@pytest.mark.parametrize("k", [k for k in KERNELS if k.name.startswith("attn_flash")] + emulated_kernels(),
                         ids=lambda k: k.name)
def test_compiles_and_validates(k):
    spv = compile_variant(k.shader, dict(k.defines), validate=True)
    assert spv[:4] == b"\x03\x02\x23\x07", "not a SPIR-V module"


def _shared_bytes(dis: str) -> int:
    """Bytes of the Workgroup-storage variables of a disassembled, specialized module."""
    names = {m: "uint" for m in re.findall(r"^\s*(%\S+) = OpTypeInt 32 0$", dis, re.M)}
    names.update((m, "float") for m in re.findall(r"^\s*(%\S+) = OpTypeFloat 32$", dis, re.M))
    names.update((m, "half") for m in re.findall(r"^\s*(%\S+) = OpTypeFloat 16$", dis, re.M))
    vec = dict(re.findall(r"^\s*(%\S+) = OpTypeVector (%\S+) 4$", dis, re.M))
    consts = {m[0]: int(m[2]) for m in re.findall(r"^\s*(%\S+) = OpConstant (%\S+) (\d+)$", dis, re.M)}
    arrays = {m[0]: (m[1], m[2]) for m in re.findall(r"^\s*(%\S+) = OpTypeArray (%\S+) (%\S+)$", dis, re.M)}
    ptrs = dict(re.findall(r"^\s*(%\S+) = OpTypePointer Workgroup (%\S+)$", dis, re.M))
    total = 0
    for ptr in re.findall(r"^\s*%\S+ = OpVariable (%\S+) Workgroup$", dis, re.M):
        t, n = ptrs[ptr], 1
        if t in arrays:
            t, length = arrays[t]
            n = consts[length]
        total += n * (4 * SIZES[names[vec[t]]] if t in vec else SIZES[names[t]])
    return total


CASES = [(f"{name}-default", caps, cm_tiles(caps, 256)) for name, caps in PROFILES.items()] + [
    (f"h200-{t.br}x{t.bc}-{t.parts}", PROFILES["h200"], t) for t in CM_SHAPES
    if t != cm_tiles(PROFILES["h200"], 256) and cm_fits(PROFILES["h200"], 256, t)]


@pytest.mark.parametrize("define", ["KV_F16", "KV_Q8_0", "KV_F32"])
@pytest.mark.parametrize("name,caps,tiles", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("flags", [0b0111, 0b1110], ids=["gated-masked-gather", "masked-gather-split"])
def test_cm_specialized(tmp_path: Path, define, name, caps, tiles: CmTiles, flags):
    """Specialized (constants frozen and folded) to Dh 256 and the device's shape, the coopmat kernel
    validates and declares exactly tiles.shared_bytes(256) of shared memory, within the device's."""
    assert tiles is not None, f"{name}: no coopmat flash shape fits at Dh 256"
    spv = compile_variant("attn_flash_cm.comp", {define: 1})
    dis = _specialize(spv, [CM_WG, 256, tiles.br, tiles.bc, flags, tiles.workers], tmp_path)
    got = _shared_bytes(dis)
    assert got == tiles.shared_bytes(256) <= caps.shared_memory, \
        f"{name}: kernel declares {got} B of shared memory, CmTiles says {tiles.shared_bytes(256)}, " \
        f"the device has {caps.shared_memory}"


SG_CASES = [(f"{name}-default", caps, sg_tiles(caps, 256)) for name, caps in PROFILES.items()] + [
    (f"h200-{t}", PROFILES["h200"], t) for t in SG_SHAPES
    if t != sg_tiles(PROFILES["h200"], 256) and sg_fits(PROFILES["h200"], 256, t)]


@pytest.mark.parametrize("define", ["KV_F16", "KV_Q8_0"])
@pytest.mark.parametrize("name,caps,tiles", SG_CASES, ids=[c[0] for c in SG_CASES])
def test_sg_specialized(tmp_path: Path, define, name, caps, tiles: SgTiles):
    """Specialized to Dh 256 and each shape, the subgroup-rows kernel (all flags) validates and declares
    exactly tiles.shared_bytes(256) of shared memory, within the device's."""
    assert tiles is not None, f"{name}: no subgroup-rows shape fits at Dh 256"
    spv = compile_variant("attn_flash_sg.comp", {define: 1})
    dis = _specialize(spv, [SG_WG, 256, tiles.br, tiles.bc, 0b1111, int(tiles.prefetch)], tmp_path)
    got = _shared_bytes(dis)
    assert got == tiles.shared_bytes(256) <= caps.shared_memory, \
        f"{name}: kernel declares {got} B of shared memory, SgTiles says {tiles.shared_bytes(256)}, " \
        f"the device has {caps.shared_memory}"
