"""Typed kernel interfaces against the SPIR-V: every registry entry's push and spec classes and
buffer count match its compiled shader; the reflector reads a small shader right; mismatched
declarations and out-of-range values are reported."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from flash_cm import have_compiler
from vkflash.gpu.compile_shaders import compile_variant
from vkflash.gpu.interface import InterfaceError, PushConstants, SpecConstants, boolean, f32, i32, pack, u32
from vkflash.gpu.registry import table
from vkflash.gpu.spirv import Binding, Member, SpecConstant, SpirvError, reflect

needs_compiler = pytest.mark.skipif(not have_compiler(), reason="no shader compiler here (precompiled SPIR-V only)")

SHADER = """#version 450
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint MODE = 3;
layout(constant_id = 2) const bool FLAG = true;
layout(constant_id = 3) const float GAIN = 1.5;
layout(constant_id = 4) const int SHIFT = -2;
layout(std430, binding = 0) readonly buffer In { float a[]; };
layout(std430, binding = 1) writeonly buffer Out { float b[]; };
layout(std430, binding = 2) buffer Io { uint c[]; } io;
layout(push_constant) uniform P { uint n; int delta; float scale; } p;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < p.n) b[i] = (FLAG ? a[i] * p.scale * GAIN : 0.0) + float(p.delta + SHIFT);
    io.c[i] += MODE;
}
"""


@dataclass(frozen=True)
class Push(PushConstants):
    n: u32
    delta: i32
    scale: f32


@dataclass(frozen=True)
class Spec(SpecConstants):
    mode: u32
    flag: boolean
    gain: f32
    shift: i32


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The reflection of SHADER, compiled like any kernel (an absolute path outside shaders/)."""
    src = tmp_path_factory.mktemp("spirv") / "reflect_me.comp"
    src.write_text(SHADER)
    return reflect(compile_variant(str(src)))


@needs_compiler
@pytest.mark.parametrize("name", sorted(table()))
def test_kernel_matches_its_shader(name):
    k = table()[name]
    k.check_against(reflect(compile_variant(k.shader, dict(k.defines))))


@needs_compiler
def test_reflects_push_spec_and_bindings(small):
    assert small.push == (Member("n", 0, "u32"), Member("delta", 4, "i32"), Member("scale", 8, "f32"))
    assert small.spec == (SpecConstant(0, "", "u32", 1), SpecConstant(1, "MODE", "u32", 3),
                          SpecConstant(2, "FLAG", "bool", True), SpecConstant(3, "GAIN", "f32", 1.5),
                          SpecConstant(4, "SHIFT", "i32", -2))
    assert small.bindings == (Binding(0, 0, "In", True, False), Binding(0, 1, "Out", False, True),
                              Binding(0, 2, "io", False, False))


@needs_compiler
def test_matching_declarations_pass(small):
    Push.check_against(small)
    Spec.check_against(small)


@dataclass(frozen=True)
class WrongType(PushConstants):
    n: u32
    delta: u32
    scale: f32


@dataclass(frozen=True)
class Swapped(PushConstants):
    delta: i32
    n: u32
    scale: f32


@dataclass(frozen=True)
class Missing(PushConstants):
    n: u32
    delta: i32


@dataclass(frozen=True)
class SpecSwapped(SpecConstants):
    flag: boolean
    mode: u32
    gain: f32
    shift: i32


@needs_compiler
@pytest.mark.parametrize("cls, message", [
    (WrongType, r"delta \(offset 4\): declared u32, the shader has i32"),
    (Swapped, r"delta \(offset 0\): the shader names it 'n'"),
    (Missing, r"2 fields declared, the shader has 3 push-constant members"),
    (SpecSwapped, r"flag \(constant_id 1\): the shader names it 'mode'.*declared bool, the shader has u32"),
])
def test_mismatches_are_reported(small, cls, message):
    with pytest.raises(InterfaceError, match=message):
        cls.check_against(small)


def test_words_pack_and_check_ranges():
    assert Push(5, -1, 1.0).words() == (5, 0xFFFFFFFF, 0x3F800000)
    assert Spec(2, True, 0.1, 7).words() == (2, 1, 0x3DCCCCCD, 7)
    for bad, message in ((Push(-1, 0, 0.0), "outside the u32 range"), (Push(0, 1 << 31, 0.0), "outside the i32"),
                         (Push(0, 0, "x"), "f32 field got 'x'"), (Push(1.5, 0, 0.0), "u32 field got 1.5"),
                         (Spec(0, 2, 0.0, 0), "outside the bool range")):
        with pytest.raises(InterfaceError, match=message):
            bad.words()


def test_pack_takes_the_declared_class_only():
    assert pack("k", Push, Push(1, 2, 0.0)) == (1, 2, 0)
    assert pack("k", SpecConstants, ()) == ()
    with pytest.raises(InterfaceError, match="takes a SpecConstants, not a list"):
        pack("k", SpecConstants, [1])
    with pytest.raises(InterfaceError, match="takes a Push, not a list"):
        pack("k", Push, [1, 2, 0])
    with pytest.raises(InterfaceError, match="takes Push, got Missing"):
        pack("k", Push, Missing(1, 2))


def test_not_spirv_is_refused():
    with pytest.raises(SpirvError, match="not SPIR-V"):
        reflect(b"\0" * 20)
    with pytest.raises(SpirvError, match="whole words"):
        reflect(b"\x03\x02\x23\x07\0")


@needs_compiler
def test_a_vector_push_member_is_refused(tmp_path):
    src = tmp_path / "vector_push.comp"
    src.write_text("#version 450\nlayout(local_size_x = 1) in;\n"
                   "layout(std430, binding = 0) writeonly buffer Out { vec2 o[]; };\n"
                   "layout(push_constant) uniform P { uint n; vec2 v; } p;\n"
                   "void main() { o[p.n] = p.v; }\n")
    with pytest.raises(SpirvError, match="push constant member 1 'v': type non-scalar is not one of u32, i32, f32"):
        reflect(compile_variant(str(src)))
