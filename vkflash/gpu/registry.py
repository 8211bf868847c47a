"""THE kernel registry: every kernel name → shader file, #define variant, buffer count, needs.

Each op family (vkflash/gpu/ops/<family>.py) declares its kernels in a KERNELS list; this module
gathers them into one table (names must be unique) so `vkflash info`, the ahead-of-time shader
build and the graph runner all look kernels up in one place. Variants that only change constants
use specialization constants (constant_id 0 is always local_size_x), not extra entries.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from functools import cache
from typing import Iterator

from vkflash.gpu.device import Capabilities
from vkflash.gpu.interface import InterfaceError, PushConstants, SpecConstants
from vkflash.gpu.spirv import Reflection


@dataclass(frozen=True)
class Kernel:
    """One compiled shader variant and how to launch it."""

    name: str
    shader: str  # path under shaders/
    n_buffers: int
    defines: tuple[tuple[str, str | int], ...] = ()
    local_size: int = 256
    needs: frozenset[str] = field(default_factory=frozenset)  # e.g. {"coopmat_f16", "fp16"}
    push: type[PushConstants] = field(kw_only=True)  # typed push constants
    spec: type[SpecConstants] = field(kw_only=True)  # typed constant_ids 1, 2, … (the bare class: none)

    def usable(self, caps: Capabilities) -> bool:
        """Whether the device offers what this variant needs."""
        have = {"fp16": caps.fp16 and caps.storage16, "int8": caps.int8 and caps.storage8,
                "coopmat_f16": caps.coopmat_shape("f16", "f32") is not None,
                "int_dot": caps.int_dot, "subgroup_size_control": caps.subgroup_size_control}
        return all(have.get(n, False) for n in self.needs)

    def workgroup(self, caps: Capabilities) -> int:
        return min(self.local_size, caps.max_invocations)

    def check_against(self, r: Reflection) -> None:
        """Raise InterfaceError unless the declared push and spec constants and the buffer count are
        what the compiled shader declares (bindings 0..n_buffers-1 of set 0)."""
        where = f"{self.name} ({self.shader})"
        self.push.check_against(r, where)
        self.spec.check_against(r, where)
        bindings = sorted({(b.set, b.binding) for b in r.bindings})
        if bindings != [(0, i) for i in range(self.n_buffers)]:
            raise InterfaceError(f"{where}: {self.n_buffers} buffers declared, the shader binds {bindings}")


@cache
def table() -> dict[str, Kernel]:
    """name → Kernel, gathered from every module in vkflash.gpu.ops."""
    import vkflash.gpu.ops as ops_pkg

    out: dict[str, Kernel] = {}
    for m in sorted(pkgutil.iter_modules(ops_pkg.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"vkflash.gpu.ops.{m.name}")
        for k in getattr(mod, "KERNELS", ()):
            if k.name in out:
                raise RuntimeError(f"kernel {k.name!r} declared twice")
            out[k.name] = k
    return out


def kernel(name: str) -> Kernel:
    try:
        return table()[name]
    except KeyError:
        raise KeyError(f"unknown kernel {name!r}") from None


def all_variants() -> Iterator[tuple[str, dict[str, str | int]]]:
    """(shader, defines) of every registered kernel, for the ahead-of-time build."""
    for k in table().values():
        yield k.shader, dict(k.defines)
