"""Typed kernel interfaces: a family's push and specialization constants declared once, in order.

A family declares each as a frozen dataclass of annotated scalar fields:

    @dataclass(frozen=True)
    class NormPush(PushConstants):
        n: u32
        n_groups: u32
        ...
        eps: f32

The field order is the layout: push field i is the block member at byte offset 4·i; spec field i
is constant_id i + 1 (constant_id 0, the workgroup size, is added by Gpu.algorithm). `words()`
packs the values into the uint32 words a dispatch records (f32 as IEEE bits, bools as 0/1, u32
and i32 range-checked); `check_against(reflection)` compares the declaration with the shader's
SPIR-V (gpu/spirv.py): count, order (offsets, constant_ids), scalar types and names. Name rule: a
push field is spelled exactly as the GLSL block member; a spec field as the GLSL constant in lower
case (MODE → mode, HAS_GAMMA → has_gamma).
"""

from __future__ import annotations

import operator
import typing
from dataclasses import dataclass, fields
from functools import cache
from numbers import Real
from typing import Annotated, Sequence

import numpy as np

from vkflash.gpu.spirv import Reflection

u32 = Annotated[int, "u32"]
i32 = Annotated[int, "i32"]
f32 = Annotated[float, "f32"]
boolean = Annotated[bool, "bool"]  # specialization constants only: a push constant has no bool type
KINDS = ("u32", "i32", "f32", "bool")
RANGES = {"u32": (0, 1 << 32), "i32": (-(1 << 31), 1 << 31), "bool": (0, 2)}


class InterfaceError(ValueError):
    """A declared interface disagrees with its shader, or a value does not fit its field."""


@cache
def layout(cls: type) -> tuple[tuple[str, str], ...]:
    """(field name, scalar kind) of a Constants class, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in fields(cls):
        kind = next((m for m in getattr(hints[f.name], "__metadata__", ()) if m in KINDS), None)
        if kind is None:
            raise InterfaceError(f"{cls.__name__}.{f.name}: annotate it u32, i32, f32 or boolean")
        out.append((f.name, kind))
    return tuple(out)


def _word(where: str, kind: str, v: object) -> int:
    """One field value as a uint32 word."""
    if kind == "f32":
        if not isinstance(v, Real) or isinstance(v, bool):
            raise InterfaceError(f"{where}: f32 field got {v!r}")
        return int(np.float32(v).view(np.uint32))
    try:
        n = operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        raise InterfaceError(f"{where}: {kind} field got {v!r}") from None
    lo, hi = RANGES[kind]
    if not lo <= n < hi:
        raise InterfaceError(f"{where}: {n} is outside the {kind} range [{lo}, {hi})")
    return n & 0xFFFFFFFF


@dataclass(frozen=True)
class Constants:
    """Base of the typed blocks: scalar fields packed to uint32 words in field order."""

    def words(self) -> tuple[int, ...]:
        """The values as the uint32 words a dispatch records."""
        name = type(self).__name__
        return tuple(_word(f"{name}.{f}", kind, getattr(self, f)) for f, kind in layout(type(self)))

    @classmethod
    def _mismatches(cls, want: list[tuple[str, str, str]], have: list[tuple[str, str, str]], what: str) -> list[str]:
        """Differences between declared and reflected (position label, name, kind) lists."""
        out = [f"{len(want)} fields declared, the shader has {len(have)} {what}"] if len(want) != len(have) else []
        for (pos, name, kind), (hpos, hname, hkind) in zip(want, have):
            if pos != hpos:
                out.append(f"{name}: declared at {pos}, the shader's next is at {hpos}")
            if hname and hname != name:
                out.append(f"{name} ({pos}): the shader names it {hname!r}")
            if hkind != kind:
                out.append(f"{name} ({pos}): declared {kind}, the shader has {hkind}")
        return out

    @classmethod
    def _raise(cls, problems: list[str], shader: str) -> None:
        """One InterfaceError naming the class, the shader and every mismatch, if there are any."""
        if problems:
            raise InterfaceError(f"{cls.__name__} does not match {shader or 'the shader'}: " + "; ".join(problems))


@dataclass(frozen=True)
class PushConstants(Constants):
    """A push-constant block: field i is the member at byte offset 4·i. The bare class: no block."""

    @classmethod
    def check_against(cls, r: Reflection, shader: str = "") -> None:
        """Raise InterfaceError unless the fields are the block's members (count, offsets, types, names)."""
        want = [(f"offset {4 * i}", n, k) for i, (n, k) in enumerate(layout(cls))]
        have = [(f"offset {m.offset}", m.name, m.type) for m in r.push]
        cls._raise(cls._mismatches(want, have, "push-constant members"), shader)


@dataclass(frozen=True)
class SpecConstants(Constants):
    """Specialization constants: field i is constant_id i + 1. The bare class: none but the workgroup size."""

    @classmethod
    def check_against(cls, r: Reflection, shader: str = "") -> None:
        """Raise InterfaceError unless the fields are constant_ids 1, 2, … (types, lower-cased names)."""
        want = [(f"constant_id {i + 1}", n, k) for i, (n, k) in enumerate(layout(cls))]
        have = [(f"constant_id {s.spec_id}", s.name.lower(), s.type) for s in r.spec if s.spec_id != 0]
        cls._raise(cls._mismatches(want, have, "specialization constants besides the workgroup size"), shader)


def pack(kernel: str, declared: type[Constants], value: Constants | Sequence[int]) -> tuple[int, ...]:
    """The words of a dispatch's push or spec constants: a typed value of the kernel's declared class
    (an empty list stands for a declaration without fields)."""
    if isinstance(value, Constants):
        if type(value) is not declared:
            raise InterfaceError(f"{kernel}: takes {declared.__name__}, got {type(value).__name__}")
        return value.words()
    if value or layout(declared):
        raise InterfaceError(f"{kernel}: takes a {declared.__name__}, not a list")
    return ()
