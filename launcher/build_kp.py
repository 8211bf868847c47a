#!/usr/bin/env python3
"""Build Kompute (kp 0.9.0) from its PyPI sdist with vkflash's patch set and install the module.

Stdlib only. Steps: get the sdist (VKFLASH_KP_SDIST or `pip download` into .cache/kp), unpack
into build/kp/, apply launcher/kp-patches/*.patch in order (failing loudly, naming the patch),
configure and build the Python module directly with CMake, copy kp*.so into site-packages.
A stamp (hash of sdist + patches + this script + interpreter + headers) makes reruns instant.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "launcher" / "kp-patches"
KP_VERSION = "0.9.0"
SDIST_NAME = f"kp-{KP_VERSION}.tar.gz"
SDIST_SHA256 = "98e583dc6e9731ff6d7a3e3317817e4d93f7b2945929619e29a56325db279949"
# Kompute's CMake reads these from the environment; without them it tries to fetch from GitHub.
KOMPUTE_ENV = {
    "KOMPUTE_OPT_USE_BUILT_IN_FMT": "OFF",
    "KOMPUTE_OPT_USE_BUILT_IN_PYBIND11": "OFF",
    "KOMPUTE_OPT_USE_BUILT_IN_VULKAN_HEADER": "OFF",
    "KOMPUTE_OPT_DISABLE_VULKAN_VERSION_CHECK": "ON",
    "KOMPUTE_OPT_INSTALL": "OFF",
    "KOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS": "ON",
    "KOMPUTE_OPT_BUILD_PYTHON": "ON",
    "KOMPUTE_OPT_USE_SPDLOG": "OFF",
    # Logging goes through Python's logging and would need the GIL, which the patched
    # module releases while the GPU runs: keep Kompute's own logging compiled out.
    "KOMPUTE_OPT_LOG_LEVEL": "Off",
}


class BuildError(SystemExit):
    """A build step failed; the message names the step (and the patch, if one failed)."""


def log(msg: str) -> None:
    """Print one short progress line."""
    print(f"[kp] {msg}", flush=True)


@dataclass(frozen=True)
class Target:
    """The interpreter the module is built for and where it gets installed."""

    python: str
    site: Path
    ext_suffix: str
    version: str


def query_target(python: str, site: str | None) -> Target:
    """Ask the target interpreter for its site-packages dir and extension suffix."""
    code = (
        "import json,sys,sysconfig;print(json.dumps([sysconfig.get_paths()['platlib'],"
        "sysconfig.get_config_var('EXT_SUFFIX'),sys.version]))"
    )
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout
    platlib, ext_suffix, version = json.loads(out)
    return Target(python, Path(site) if site else Path(platlib), ext_suffix, version)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def get_sdist(python: str) -> Path:
    """The kp sdist: VKFLASH_KP_SDIST if set, else a cached `pip download`; sha256-checked."""
    env_path = os.environ.get("VKFLASH_KP_SDIST")
    if env_path:
        sdist = Path(env_path)
        if not sdist.is_file():
            raise BuildError(f"[kp] VKFLASH_KP_SDIST={env_path} is not a file")
    else:
        cache = ROOT / ".cache" / "kp"
        sdist = cache / SDIST_NAME
        if not sdist.is_file():
            log(f"pip download kp=={KP_VERSION} (sdist)")
            cache.mkdir(parents=True, exist_ok=True)
            cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:",
                   f"kp=={KP_VERSION}", "-d", str(cache)]
            if subprocess.run(cmd).returncode != 0 or not sdist.is_file():
                raise BuildError("[kp] pip download of the kp sdist failed (offline? set VKFLASH_KP_SDIST)")
    digest = sha256_file(sdist)
    if digest != SDIST_SHA256:
        raise BuildError(f"[kp] {sdist} has sha256 {digest}, expected {SDIST_SHA256}")
    return sdist


def list_patches(stock: bool) -> list[Path]:
    """The patch files in apply order; `stock` keeps only the build-system ones (00-*)."""
    patches = sorted(PATCH_DIR.glob("*.patch"))
    return [p for p in patches if p.name.startswith("00-")] if stock else patches


def headers_dir() -> str | None:
    """Vulkan (and fmt) headers to build against when they are not installed system-wide."""
    return os.environ.get("VKFLASH_VK_HEADERS") or None


def patch_set_id(patches: list[Path]) -> str:
    """Short hash of the pinned sdist and the patch files: the module's version names it."""
    h = hashlib.sha256(SDIST_SHA256.encode())
    for p in patches:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:10]


def stamp_key(sdist: Path, patches: list[Path], target: Target) -> str:
    """Everything that changes the built module, hashed."""
    h = hashlib.sha256()
    h.update(SDIST_SHA256.encode())
    h.update(sha256_file(sdist).encode())
    for p in patches:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(Path(__file__).read_bytes())
    h.update(f"{target.ext_suffix}|{target.version}|{headers_dir()}".encode())
    return h.hexdigest()


def unpack(sdist: Path, dest: Path) -> Path:
    """Unpack the sdist freshly into dest/src and return that directory."""
    src = dest / "src"
    if src.exists():
        shutil.rmtree(src)
    tmp = dest / "unpack"
    if tmp.exists():
        shutil.rmtree(tmp)
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp, filter="data")
        else:
            tar.extractall(tmp)
    (top,) = list(tmp.iterdir())
    top.rename(src)
    tmp.rmdir()
    return src


def apply_patches(src: Path, patches: list[Path]) -> None:
    """Apply each patch with `patch -p1 --forward` (or `git apply`); stop naming the first failure."""
    use_patch = shutil.which("patch") is not None
    if not use_patch and shutil.which("git") is None:
        raise BuildError("[kp] neither `patch` nor `git` is installed: cannot apply the patch set")
    for p in patches:
        if use_patch:
            cmd = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-i", str(p)]
        else:
            cmd = ["git", "apply", "-p1", "--whitespace=nowarn", str(p)]
        r = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"[kp] patch {p.name} no longer applies to kp {KP_VERSION}:\n"
                             f"{r.stdout}{r.stderr}")
        log(f"applied {p.name}")


def find_libvulkan() -> str | None:
    """Path of the Vulkan loader library, for builds against headers outside the system."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.split(" ")[0] in ("libvulkan.so.1", "libvulkan.so") and "x86-64" in name:
            return path.strip()
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        for lib in ("libvulkan.so.1", "libvulkan.so"):
            if (Path(d) / lib).exists():
                return str(Path(d) / lib)
    return None


def pybind11_cmakedir(python: str) -> str | None:
    """pybind11's CMake dir from the target interpreter's pip package, or None (system one)."""
    r = subprocess.run([python, "-m", "pybind11", "--cmakedir"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


HEARTBEAT_S = 30.0
CMAKE_PERCENT = re.compile(r"^\[\s*(\d+)%\]", re.M)


def run_logged(cmd: list[str], logf: Path, env: dict[str, str], what: str, heartbeat_s: float = HEARTBEAT_S) -> None:
    """Run a build command appending its output to logf, saying every heartbeat_s that it still
    runs (with make's last percentage; a fresh 2-core machine spends minutes here); on failure
    show the log's tail."""
    t0 = time.monotonic()
    with logf.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        while True:
            try:
                proc.wait(timeout=heartbeat_s)
                break
            except subprocess.TimeoutExpired:
                done = CMAKE_PERCENT.findall(logf.read_text(errors="replace"))
                log(f"{what}: {time.monotonic() - t0:.0f} s{f', {done[-1]}%' if done else ''} (log: {logf})")
    if proc.returncode != 0:
        tail = "".join(logf.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise BuildError(f"{tail}\n[kp] {what} failed (full log: {logf})")


def cmake_build(src: Path, build: Path, target: Target, version_info: str, jobs: int) -> Path:
    """Configure and build the kp module with CMake; return the built .so."""
    if build.exists():
        shutil.rmtree(build)
    build.mkdir(parents=True)
    logf = build / "build.log"
    env = {**os.environ, **KOMPUTE_ENV}
    args = [
        "cmake", "-S", str(src), "-B", str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
        "-DPYBIND11_FINDPYTHON=ON",
        f"-DPython_EXECUTABLE={target.python}",
        f"-DPYTHON_EXECUTABLE={target.python}",
        f"-DKP_VERSION_INFO={version_info}",
    ]
    pb = pybind11_cmakedir(target.python)
    if pb:
        args.append(f"-Dpybind11_DIR={pb}")
    hdr = headers_dir()
    if hdr:
        args += [f"-DVulkan_INCLUDE_DIR={hdr}", f"-DKP_FMT_INCLUDE_DIR={hdr}"]
        lib = find_libvulkan()
        if lib is None:
            raise BuildError("[kp] VKFLASH_VK_HEADERS is set but no libvulkan.so* was found")
        args.append(f"-DVulkan_LIBRARY={lib}")
    log("cmake configure")
    run_logged(args, logf, env, "cmake configure")
    log(f"cmake build (-j {jobs})")
    run_logged(["cmake", "--build", str(build), "--target", "kp", "-j", str(jobs)], logf, env, "cmake build")
    built = sorted(build.rglob("kp*.so"))
    if not built:
        raise BuildError(f"[kp] the build produced no kp*.so (log: {logf})")
    return built[0]


def deliver(built: Path, target: Target, out: Path | None, stock: bool) -> None:
    """Install the module into site-packages (stock builds: only to --out or build/kp-stock/out)."""
    name = f"kp{target.ext_suffix}"
    if stock:
        out = out or built.parent.parent / "out"
    else:
        dest = target.site / name
        if not (dest.is_file() and sha256_file(dest) == sha256_file(built)):
            target.site.mkdir(parents=True, exist_ok=True)
            for old in target.site.glob("kp.*so"):
                old.unlink()
            shutil.copy2(built, dest)
            log(f"installed {dest}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, out / name)
        log(f"copied to {out / name}")


def check_import(target: Target) -> str:
    """Import the installed module in a fresh interpreter; return its __version__."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{target.site}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(target.site)
    r = subprocess.run([target.python, "-c", "import kp;print(kp.__version__)"],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise BuildError(f"[kp] the installed module does not import:\n{r.stderr}")
    return r.stdout.strip()


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", help="venv to install into (default: the running interpreter's)")
    ap.add_argument("--site", help="install into this directory instead of site-packages")
    ap.add_argument("--out", help="also copy the built .so into this directory")
    ap.add_argument("--prebuilt", help="install this kp*.so instead of building (built anyway if it is from another patch set)")
    ap.add_argument("--stock", action="store_true",
                    help="build without the behaviour patches (only 00-*), into build/kp-stock; for comparisons")
    ap.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    """Build (or reuse, or take prebuilt) the patched kp module and install it."""
    t0 = time.monotonic()
    a = parse_args(argv)
    python = str(Path(a.venv) / "bin" / "python") if a.venv else sys.executable
    target = query_target(python, a.site)
    out = Path(a.out) if a.out else None
    patches = list_patches(a.stock)
    want_version = f"{KP_VERSION}+vkflash.{'stock' if a.stock else patch_set_id(patches)}"
    if a.prebuilt:
        deliver(Path(a.prebuilt), target, out, stock=False)
        try:
            version = check_import(target)
        except BuildError as e:
            version = f"unimportable ({str(e).strip().splitlines()[-1]})"
        if version == want_version:
            log(f"prebuilt module {version} installed")
            return 0
        log(f"prebuilt module is {version}, not the current patch set {want_version}: building instead")
    sdist = get_sdist(python)
    key = stamp_key(sdist, patches, target)
    work = ROOT / "build" / ("kp-stock" if a.stock else "kp")
    stamp = work / "stamp"
    built = work / "build" / "kp.so"
    if not a.force and stamp.is_file() and stamp.read_text().strip() == key and built.is_file():
        deliver(built, target, out, a.stock)
        log(f"up to date ({time.monotonic() - t0:.1f} s)")
        return 0
    work.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    log(f"unpacking {sdist.name} into {work.relative_to(ROOT)}")
    src = unpack(sdist, work)
    apply_patches(src, patches)
    so = cmake_build(src, work / "build", target, want_version, a.jobs)
    shutil.copy2(so, built)
    deliver(built, target, out, a.stock)
    if not a.stock:
        log(f"module {check_import(target)} imports")
    stamp.write_text(key + "\n")
    log(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
