"""The CLI on bad input: one `error:` line and a non-zero exit, a traceback only with --debug."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from vkflash.formats.gguf_write import write_gguf
from vkflash.model.make_model import make_model


def vkflash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vkflash.cli", *args], capture_output=True, text=True, timeout=120)


def assert_one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("m") / "q4e.gguf"
    make_model("qwen4exp", "tiny", "F32", int(np.random.default_rng().integers(1 << 30)), out)
    return out


def test_valid_file_inspects(tiny):
    r = vkflash("inspect", str(tiny))
    assert r.returncode == 0 and "qwen4exp" in r.stdout and "valid" in r.stdout


def test_truncated_file(tiny, tmp_path):
    data = tiny.read_bytes()
    for cut in (10, 2000, len(data) // 2, len(data) - 1):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        assert_one_line_error(vkflash("inspect", str(p)), "truncated")


def test_wrong_magic(tiny, tmp_path):
    p = tmp_path / "magic.gguf"
    p.write_bytes(b"GGML" + tiny.read_bytes()[4:])
    assert_one_line_error(vkflash("inspect", str(p)), "magic")


def test_missing_file(tmp_path):
    assert_one_line_error(vkflash("inspect", str(tmp_path / "nope.gguf")))


def test_unknown_arch(tmp_path):
    p = tmp_path / "llama.gguf"
    write_gguf(p, "llama", {"llama.context_length": 16}, {"token_embd.weight": np.zeros((4, 8), np.float32)})
    assert_one_line_error(vkflash("inspect", str(p)), "llama")


def test_missing_required_key(tmp_path):
    p = tmp_path / "nokeys.gguf"
    write_gguf(p, "qwen3next", {"qwen3next.context_length": 16}, {"token_embd.weight": np.zeros((4, 8), np.float32)})
    assert_one_line_error(vkflash("inspect", str(p)), "qwen3next.")


def test_unsupported_quant(tmp_path):
    p = tmp_path / "q81.gguf"
    # Q8_1 blocks (32 elements in 40 bytes): our writer refuses them, so write with gguf directly
    w = gguf.GGUFWriter(str(p), "qwen2")
    w.add_tensor("token_embd.weight", np.zeros((1, 40), np.uint8), raw_shape=(1, 40), raw_dtype=Q.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(vkflash("inspect", str(p)), "Q8_1")


def test_debug_shows_traceback(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGUF")
    r = vkflash("--debug", "inspect", str(p))
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_bad_knob_value_stops_with_its_name():
    r = subprocess.run([sys.executable, "-m", "vkflash.cli", "knobs"], capture_output=True, text=True,
                       env={"UB": "huge", "PATH": ""}, timeout=60)
    assert_one_line_error(r, "UB", "'huge'")


def test_version_is_the_package_version():
    """`vkflash --version` prints the version pyproject.toml declares, at once, and exits 0."""
    import tomllib

    import vkflash as pkg

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    r = vkflash("--version")
    assert r.returncode == 0 and r.stdout == f"vkflash {declared}\n" and pkg.__version__ == declared, r.stderr
