#!/usr/bin/env python3
"""Host cost of one Sequence.eval() of a 1-dispatch sequence: stock kp vs the patched build.

Prints µs per eval (blocking wait, and for the patched build also spin-wait). The stock module
comes from `launcher/build_kp.py --stock` (build/kp-stock/out); the patched one is the installed kp.
Usage: kp_eval_cost.py [--stock-dir DIR] [--evals N]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GLSL = """#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer A { uint a[]; };
void main() { a[gl_GlobalInvocationID.x] += 1u; }
"""


def compile_spirv(out: Path) -> Path:
    """The tiny shader, compiled with the venv's cmeel glslangValidator; on machines without it
    (the lent GPU), the copy an earlier run left in the SPIR-V cache (build/spv)."""
    cached = Path(os.environ.get("VKFLASH_SPV_CACHE", ROOT / "build" / "spv")) / (
        f"kpcost-{hashlib.sha256(GLSL.encode()).hexdigest()[:16]}.spv")
    prefix = Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix"
    exe = prefix / "bin" / "glslangValidator"
    if not exe.exists():
        if not cached.is_file():
            sys.exit(f"[kp] no glslangValidator under {prefix} and no precompiled {cached}")
        return cached
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(prefix / "lib") + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    comp, spv = out / "inc.comp", out / "inc.spv"
    comp.write_text(GLSL)
    subprocess.run([str(exe), "-V", str(comp), "-o", str(spv)], check=True, capture_output=True, env=env)
    cached.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spv, cached)
    return spv


def measure(spv: Path, evals: int) -> dict[str, float]:
    """In this process: µs per eval for each wait mode the loaded kp supports."""
    import numpy as np
    import kp

    mgr = kp.Manager(0)
    t = mgr.tensor_t(np.zeros(64, np.uint32), tensor_type=kp.TensorTypes.host)
    algo = mgr.algorithm([t], spv.read_bytes(), (1, 1, 1), np.array([], np.uint32), np.array([], np.uint32))
    modes = ["blocking"] + (["spin"] if hasattr(kp.Sequence, "set_spin_wait") else [])
    result: dict[str, float] = {"version": kp.__version__}
    for mode in modes:
        seq = mgr.sequence()
        if mode == "spin":
            seq.set_spin_wait(True)
        seq.record(kp.OpAlgoDispatch(algo))
        for _ in range(100):
            seq.eval()
        t0 = time.perf_counter()
        for _ in range(evals):
            seq.eval()
        result[mode] = (time.perf_counter() - t0) / evals * 1e6
    return result


def run_child(module_dir: Path | None, spv: Path, evals: int) -> dict[str, float]:
    """measure() in a fresh interpreter that imports kp from module_dir (None: the installed one)."""
    env = dict(os.environ)
    if module_dir is not None:
        env["PYTHONPATH"] = str(module_dir)
    out = subprocess.run([sys.executable, __file__, "--child", str(spv), "--evals", str(evals)],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    """Compare stock and patched kp; print one line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stock-dir", default=str(ROOT / "build" / "kp-stock" / "out"))
    ap.add_argument("--evals", type=int, default=3000)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(Path(a.child), a.evals)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        spv = compile_spirv(Path(tmp))
        rows = []
        stock = Path(a.stock_dir)
        if any(stock.glob("kp*.so")):
            rows.append(("stock", run_child(stock, spv, a.evals)))
        else:
            print(f"[kp] no stock module in {stock} (run launcher/build_kp.py --stock); patched only")
        rows.append(("patched", run_child(None, spv, a.evals)))
    for label, r in rows:
        modes = ", ".join(f"{m} {r[m]:.1f} us" for m in ("blocking", "spin") if m in r)
        print(f"[kp] {label:8s} {r['version']}: eval() of 1 dispatch: {modes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
