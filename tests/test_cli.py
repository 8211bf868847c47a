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


def test_installed_command_is_the_checked_entry(tmp_path):
    """The installed `vkflash` command is cli.main (the one-line error for what escapes a command),
    not the bare Typer app, and answers bad input in one line like `python -m vkflash.cli`."""
    from importlib.metadata import entry_points

    (ep,) = entry_points(group="console_scripts", name="vkflash")
    assert ep.value == "vkflash.cli:main"
    script = Path(sys.executable).parent / "vkflash"
    r = subprocess.run([str(script), "inspect", str(tmp_path / "absent.gguf")], capture_output=True, text=True,
                       timeout=120)
    assert_one_line_error(r, "absent.gguf")


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


@pytest.mark.parametrize("flag, value, knob", [("--ub", "0", "UB"), ("--ctx", "-1", "CTX"), ("--kv", "q4_0", "KV")])
def test_run_checks_its_knob_flags_like_serve(flag, value, knob, tmp_path):
    """`run --ub 0` was taken as 1 (and --ctx / --kv unchecked): its flags are the knobs', checked the same way."""
    r = vkflash("run", str(tmp_path / "absent.gguf"), "-p", "hi", flag, value)
    assert_one_line_error(r, knob, repr(value))


@pytest.mark.parametrize("flag, value, knob", [("--ub", "0", "UB"), ("--ub", "-5", "UB"), ("--kv", "q3", "KV")])
def test_bench_model_checks_its_knob_flags(flag, value, knob, tmp_path):
    """`bench model --ub 0` (or -5) benched a ubatch clamped to 1 without a word: the knobs' check, one line."""
    r = vkflash("bench", "model", str(tmp_path / "absent.gguf"), "--quick", flag, value)
    assert_one_line_error(r, knob, repr(value))


def test_verify_refuses_an_empty_context(tiny):
    """`verify --ctx 0` (or below) ran with the context raised silently: one line instead."""
    assert_one_line_error(vkflash("verify", str(tiny), "--ctx", "0"), "--ctx 0")


def test_serve_checks_a_named_model_before_it_listens(tiny, tmp_path):
    """`vkflash serve -m cut.gguf` announced its port, then failed loading: now one line, nothing listens."""
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:5000])
    r = vkflash("serve", "-m", str(cut), "--port", "1")  # port 1: were it reached, binding would fail differently
    assert_one_line_error(r, "cut.gguf: truncated GGUF")
    assert "listening" not in r.stdout, r.stdout


def test_a_directory_as_the_model_says_so(tmp_path):
    """A folder given as the model is named as such, not as a missing file."""
    assert_one_line_error(vkflash("run", str(tmp_path), "-p", "hi"), "not a regular file")


def test_run_and_inspect_refuse_a_truncated_file_in_one_line(tiny, tmp_path):
    """`head -c 40 t.gguf > x.gguf; vkflash run x.gguf -p hi`: the checked loader's line, no traceback."""
    p = tmp_path / "x.gguf"
    p.write_bytes(tiny.read_bytes()[:40])
    for args in (("inspect", str(p)), ("run", str(p), "-p", "hi", "--max-tokens", "1")):
        assert_one_line_error(vkflash(*args), "x.gguf: truncated GGUF")


def test_an_mtp_only_file_is_a_draft_not_a_model(tmp_path):
    """An MTP-only GGUF (no trunk) inspects as a valid draft; run, verify, plan and bench refuse it in
    one line (they used to pass the check and fail on its missing token embedding with a traceback)."""
    draft = make_model("qwen4exp", "tiny", "F32", int(np.random.default_rng().integers(1 << 30)), tmp_path / "t.gguf",
                       mtp_separate=True)[1]
    r = vkflash("inspect", str(draft))
    assert r.returncode == 0 and "qwen4exp MTP-only draft" in r.stdout and "valid" in r.stdout, r.stderr
    for args in (("run", str(draft), "-p", "hi", "--max-tokens", "1"), ("verify", str(draft)),
                 ("plan", str(draft)), ("bench", "model", str(draft))):
        assert_one_line_error(vkflash(*args), "an MTP-only file", "not a model to run")


def test_unreadable_file_and_bad_token_count(tiny):
    """A model path that cannot be read (/proc/self/mem: an I/O error at offset 0, whoever runs it),
    `verify --tokens -1`: one line each."""
    for args in (("inspect", "/proc/self/mem"), ("run", "/proc/self/mem", "-p", "hi", "--max-tokens", "1")):
        assert_one_line_error(vkflash(*args), "/proc/self/mem: cannot read")
    assert_one_line_error(vkflash("verify", str(tiny), "--tokens", "-1"), "at least 2 tokens")


def test_inspect_builds_the_tokenizer(tiny, tmp_path):
    """A merge naming a token the vocabulary lacks used to pass `inspect` and fail at `run`; both refuse it."""
    raw = bytearray(tiny.read_bytes())
    key = b"tokenizer.ggml.merges"
    at = raw.index(key) + len(key) + 4 + 4 + 8  # value type, item type, count: the first string's length
    while raw[at + 8] >= 0x80:  # a merge that starts with an ASCII character: replacing it keeps UTF-8
        at += 8 + int.from_bytes(raw[at:at + 8], "little")
    raw[at + 8] = 0x01
    p = tmp_path / "merges.gguf"
    p.write_bytes(bytes(raw))
    for args in (("inspect", str(p)), ("run", str(p), "-p", "hi", "--max-tokens", "1")):
        assert_one_line_error(vkflash(*args), "merges.gguf: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens")


def test_serve_refuses_what_inspect_refuses(tiny, tmp_path):
    """`vkflash serve` loads through the same check: a chat template that does not compile (which the
    server's own load would take, failing every chat later) stops the server with that reason in one
    line and a non-zero exit status."""
    import os

    from server.harness import free_port

    from vkflash.formats.gguf_file import GGUFFile
    from vkflash.formats.gguf_write import RawTensor

    f = GGUFFile(tiny)
    meta = {k: f.metadata[k] for k in f.metadata if k != "general.architecture"}
    meta["tokenizer.chat_template"] = "{% if %}"
    bad = tmp_path / "template.gguf"
    write_gguf(bad, f.arch, meta, {n: RawTensor(t.data.tobytes(), t.ggml_type, t.ne) for n, t in f.tensors.items()})
    env = dict(os.environ, VKFLASH_BACKEND="reference", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "vkflash.cli", "serve", "--model", str(bad), "--port",
                           str(free_port())], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "template.gguf: chat template does not compile" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_version_is_the_package_version():
    """`vkflash --version` prints the version pyproject.toml declares, at once, and exits 0."""
    import tomllib

    import vkflash as pkg

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    r = vkflash("--version")
    assert r.returncode == 0 and r.stdout == f"vkflash {declared}\n" and pkg.__version__ == declared, r.stderr
