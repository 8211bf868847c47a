"""launcher/setup and launcher/build_kp.py on a fresh machine: a long step (apt, pip, the
Kompute build) says that it still runs, with its elapsed time, instead of minutes of silence."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _build_kp():
    spec = importlib.util.spec_from_file_location("build_kp", ROOT / "launcher" / "build_kp.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["build_kp"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_setup_heartbeat_speaks_while_a_step_runs():
    """setup's heartbeat: a 3-second step with a 1-second heartbeat says so at least once, on
    stderr (the step's own stdout may go to /dev/null), and passes the step's exit status on."""
    fn = re.search(r"^log\(\).*?^heartbeat\(\) \{.*?^\}\n", (ROOT / "launcher" / "setup").read_text(), re.M | re.S)
    assert fn is not None
    script = f"set -euo pipefail\nVKFLASH_SETUP_HEARTBEAT_S=1\n{fn.group(0)}\nheartbeat 'slow step' sleep 3 >/dev/null\n" \
             "heartbeat 'failing step' false || echo \"failed with $?\""
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^\[setup\] slow step: \d+ s$", r.stderr, re.M), r.stderr
    assert r.stdout.strip() == "failed with 1"


def test_kp_build_heartbeat_shows_make_progress(tmp_path, capsys):
    """build_kp's run_logged: while the build runs it prints its elapsed time and make's last
    percentage from the log."""
    bk = _build_kp()
    cmd = ["bash", "-c", "echo '[ 12%] Building CXX object a.o'; sleep 1.5; echo '[ 57%] Building CXX object b.o';"
           " sleep 1.5"]
    bk.run_logged(cmd, tmp_path / "build.log", {"PATH": "/usr/bin:/bin"}, "cmake build", heartbeat_s=1.0)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[kp] cmake build: ")]
    assert lines and all(re.fullmatch(r"\[kp\] cmake build: \d+ s, (12|57)% \(log: .*build\.log\)", ln)
                         for ln in lines), lines
    assert lines[-1].split(", ")[1].startswith("57%")
