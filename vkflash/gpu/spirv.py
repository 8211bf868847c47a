"""A small SPIR-V reflector: a compute module's push constants, specialization constants and bindings.

Pure Python over the module's words (spec: SPIR-V 1.6 §2.3 physical layout, §3 enumerants), so the
typed kernel interfaces of gpu/interface.py can be checked against what the shader really declares
without another dependency. Names come from OpName / OpMemberName (glslangValidator keeps them
unless told -g0 / --strip-debug; of several names for one id, the first, the declaration's); a
push-constant member or specialization constant of any type but a 32-bit scalar (or a bool, for
specialization constants) is refused with a clear error.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = 0x07230203

# opcodes
OP_NAME, OP_MEMBER_NAME = 5, 6
OP_TYPE_BOOL, OP_TYPE_INT, OP_TYPE_FLOAT, OP_TYPE_STRUCT, OP_TYPE_POINTER = 20, 21, 22, 30, 32
OP_SPEC_TRUE, OP_SPEC_FALSE, OP_SPEC = 48, 49, 50
OP_VARIABLE, OP_DECORATE, OP_MEMBER_DECORATE = 59, 71, 72
# decorations
DEC_SPEC_ID, DEC_NON_WRITABLE, DEC_NON_READABLE = 1, 24, 25
DEC_BINDING, DEC_SET, DEC_OFFSET = 33, 34, 35
# storage classes
SC_UNIFORM_CONSTANT, SC_UNIFORM, SC_PUSH_CONSTANT, SC_STORAGE_BUFFER = 0, 2, 9, 12

SCALARS = ("u32", "i32", "f32")
"""Scalar types a push-constant member may have (a specialization constant may also be "bool")."""


class SpirvError(ValueError):
    """The module is not SPIR-V, or declares something the reflector does not accept."""


@dataclass(frozen=True)
class Member:
    """One push-constant block member: name ("" when stripped), byte offset, scalar type."""

    name: str
    offset: int
    type: str


@dataclass(frozen=True)
class SpecConstant:
    """One specialization constant: its constant_id, name ("" when stripped), type and default."""

    spec_id: int
    name: str
    type: str
    default: int | float | bool


@dataclass(frozen=True)
class Binding:
    """One descriptor binding: set, binding, name (variable's, else its block's), access decorations."""

    set: int
    binding: int
    name: str
    readonly: bool
    writeonly: bool


@dataclass(frozen=True)
class Reflection:
    """What a compute module declares: push members by offset, spec constants and bindings by id."""

    push: tuple[Member, ...]
    spec: tuple[SpecConstant, ...]
    bindings: tuple[Binding, ...]


def _string(words: list[int]) -> str:
    """A nul-terminated UTF-8 literal packed little-endian into words."""
    raw = struct.pack(f"<{len(words)}I", *words)
    return raw[:raw.index(0)].decode() if 0 in raw else raw.decode()


def _instructions(code: bytes) -> list[tuple[int, list[int]]]:
    """(opcode, operand words) of every instruction after the five-word header."""
    if len(code) % 4 or len(code) < 20:
        raise SpirvError(f"SPIR-V must be whole words after a 5-word header, got {len(code)} bytes")
    words = list(struct.unpack(f"<{len(code) // 4}I", code))
    if words[0] != MAGIC:
        raise SpirvError(f"not SPIR-V (magic {words[0]:#010x}; big-endian modules are not supported)")
    out, i = [], 5
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        if n == 0 or i + n > len(words):
            raise SpirvError(f"truncated instruction (opcode {op}) at word {i}")
        out.append((op, words[i + 1:i + n]))
        i += n
    return out


def reflect(code: bytes) -> Reflection:
    """The push-constant block, specialization constants and descriptor bindings of a SPIR-V module."""
    names: dict[int, str] = {}
    member_names: dict[tuple[int, int], str] = {}
    decorations: dict[int, dict[int, list[int]]] = {}
    member_decorations: dict[tuple[int, int], dict[int, list[int]]] = {}
    types: dict[int, str] = {}  # scalar type id -> u32 / i32 / f32 / bool / other
    structs: dict[int, list[int]] = {}
    pointers: dict[int, tuple[int, int]] = {}  # pointer type id -> (storage class, pointee)
    variables: list[tuple[int, int, int]] = []  # (id, pointer type, storage class)
    specs: list[tuple[int, int, int | float | bool]] = []  # (id, type id, default)
    for op, a in _instructions(code):
        if op == OP_NAME:  # the first name given to an id: glslang also names later aliases of it
            names.setdefault(a[0], _string(a[1:]))
        elif op == OP_MEMBER_NAME:
            member_names[(a[0], a[1])] = _string(a[2:])
        elif op == OP_DECORATE:
            decorations.setdefault(a[0], {})[a[1]] = a[2:]
        elif op == OP_MEMBER_DECORATE:
            member_decorations.setdefault((a[0], a[1]), {})[a[2]] = a[3:]
        elif op == OP_TYPE_BOOL:
            types[a[0]] = "bool"
        elif op == OP_TYPE_INT:
            types[a[0]] = ("i" if a[2] else "u") + str(a[1])
        elif op == OP_TYPE_FLOAT:
            types[a[0]] = f"f{a[1]}"
        elif op == OP_TYPE_STRUCT:
            structs[a[0]] = a[1:]
        elif op == OP_TYPE_POINTER:
            pointers[a[0]] = (a[1], a[2])
        elif op == OP_VARIABLE:
            variables.append((a[1], a[0], a[2]))
        elif op in (OP_SPEC_TRUE, OP_SPEC_FALSE):
            specs.append((a[1], a[0], op == OP_SPEC_TRUE))
        elif op == OP_SPEC:
            t = types.get(a[0], "?")
            value: int | float = a[2]
            if t == "f32":
                value = struct.unpack("<f", struct.pack("<I", a[2]))[0]
            elif t == "i32":
                value = a[2] - (1 << 32) if a[2] & 0x80000000 else a[2]
            specs.append((a[1], a[0], value))

    def type_name(t: int, what: str, allowed: tuple[str, ...]) -> str:
        name = types.get(t)
        if name not in allowed:
            raise SpirvError(f"{what}: type {name or 'non-scalar'} is not one of {', '.join(allowed)}")
        return name

    push: list[Member] = []
    bindings: list[Binding] = []
    blocks = 0
    for var, ptr, sc in variables:
        block = pointers[ptr][1]
        if sc == SC_PUSH_CONSTANT:
            blocks += 1
            if blocks > 1:
                raise SpirvError("more than one push-constant block")
            for m, t in enumerate(structs[block]):
                mname = member_names.get((block, m), "")
                kind = type_name(t, f"push constant member {m} {mname!r}", SCALARS)
                push.append(Member(mname, member_decorations[(block, m)][DEC_OFFSET][0], kind))
        elif sc in (SC_UNIFORM_CONSTANT, SC_UNIFORM, SC_STORAGE_BUFFER) and DEC_BINDING in decorations.get(var, {}):
            dec = decorations[var]
            members = [member_decorations.get((block, m), {}) for m in range(len(structs.get(block, [])))]
            access = [d in dec or (bool(members) and all(d in md for md in members))
                      for d in (DEC_NON_WRITABLE, DEC_NON_READABLE)]
            name = names.get(var) or names.get(block, "")
            bindings.append(Binding(dec.get(DEC_SET, [0])[0], dec[DEC_BINDING][0], name, *access))
    spec: dict[int, SpecConstant] = {}
    for i, t, v in specs:
        if DEC_SPEC_ID not in decorations.get(i, {}):
            continue
        name = names.get(i, "")
        kind = type_name(t, f"spec constant {name!r}", (*SCALARS, "bool"))
        c = SpecConstant(decorations[i][DEC_SPEC_ID][0], name, kind, v)
        seen = spec.get(c.spec_id)
        if seen is not None and seen.type != c.type:
            raise SpirvError(f"constant_id {c.spec_id} declared twice, as {seen.type} and {c.type}")
        if seen is None or not seen.name:  # glslang may repeat one (the workgroup size), unnamed
            spec[c.spec_id] = c
    return Reflection(tuple(sorted(push, key=lambda m: m.offset)), tuple(spec[k] for k in sorted(spec)),
                      tuple(sorted(bindings, key=lambda b: (b.set, b.binding))))
