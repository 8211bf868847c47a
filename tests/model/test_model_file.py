"""open_model, the one checked way into a model file: what `inspect` reports and `run` relies on.
Beyond the per-part tests (formats, hparams, tensors, tokenizer) it checks what only the whole file
can show: tokenizer against the vocabulary size, the chat template, files without a tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from engine.qwen2_tiny import write_qwen2
from test_run_verify import GEO, with_tokenizer
from vkflash.errors import ConfigError, FormatError, ModelError
from vkflash.formats.gguf_file import GGUFFile
from vkflash.formats.gguf_write import RawTensor, Typed, write_gguf
from vkflash.model.model_file import open_model


@pytest.fixture
def bare(tmp_path: Path, rng: np.random.Generator) -> Path:
    """A tiny qwen2 without tokenizer keys."""
    write_qwen2(tmp_path / "bare.gguf", rng, GEO, Q.Q8_0)
    return tmp_path / "bare.gguf"


@pytest.fixture
def good(bare: Path, tmp_path: Path) -> Path:
    """The same with the tiny BPE and a chat template."""
    return with_tokenizer(bare, tmp_path / "good.gguf")


def rewritten(src: Path, **meta: Any) -> Path:
    """A copy of src with metadata keys replaced (a value of None drops the key)."""
    f = GGUFFile(src)
    kv = {k: f.metadata[k] for k in f.metadata if k != "general.architecture"}
    for key, value in meta.items():
        key = key.replace("__", ".")
        if value is None:
            kv.pop(key)
        else:
            kv[key] = value
    out = src.with_name("rewritten.gguf")
    write_gguf(out, f.arch, kv, {n: RawTensor(t.data.tobytes(), t.ggml_type, t.ne) for n, t in f.tensors.items()})
    return out


def test_good_and_bare_files(good: Path, bare: Path) -> None:
    m = open_model(good)
    assert m.require_tokenizer().vocab_size == m.hp.V == GEO.V and m.chat_template
    assert m.describe() == f"qwen2, {len(m.file.tensors)} tensors, {GEO.V}-token qwen2 BPE tokenizer"
    b = open_model(bare)
    assert b.tokenizer is None and b.chat_template is None and "no tokenizer" in b.describe()
    with pytest.raises(ModelError, match="bare.gguf: the file has no tokenizer"):
        b.require_tokenizer()


def test_tokenizer_within_the_vocabulary(good: Path) -> None:
    tokens = GGUFFile(good).metadata["tokenizer.ggml.tokens"]
    types = list(GGUFFile(good).metadata["tokenizer.ggml.token_type"])
    p = rewritten(good, tokenizer__ggml__tokens=[*tokens, "extra"],
                  tokenizer__ggml__token_type=np.asarray(types + [1], np.int32))
    with pytest.raises(ModelError, match=f"rewritten.gguf: the tokenizer has {GEO.V + 1} tokens but the model only "
                                         f"{GEO.V}$"):
        open_model(p)


def test_any_tokenizer_key_means_a_tokenizer_that_builds(good: Path) -> None:
    """A file with some tokenizer keys (one lost to a damaged key name) is refused, not tokenizer-less."""
    with pytest.raises(FormatError, match="rewritten.gguf: unsupported tokenizer.ggml.model None"):
        open_model(rewritten(good, tokenizer__ggml__model=None))
    with pytest.raises(FormatError, match="rewritten.gguf: tokenizer.ggml.merges do not fit"):
        open_model(rewritten(good, tokenizer__ggml__merges=["Ġ zzz"]))


@pytest.mark.parametrize("template,error,pattern", [
    ("{% if %}", ConfigError, "chat template does not compile"),
    ("{% for m in messages %}{{ m.content }}\n{% endfor %}{% endif %}", ConfigError, "does not compile"),
    ("{{ 1 // 0 }}", ModelError, "fails on a one-message chat: ZeroDivisionError"),
    (Typed(7, V.UINT32), FormatError, "tokenizer.chat_template must be a string, found UINT32"),
])
def test_chat_template_must_render(good: Path, template: Any, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern) as e:
        open_model(rewritten(good, tokenizer__chat_template=template))
    assert "\n" not in str(e.value) and str(e.value).startswith(str(good.with_name("rewritten.gguf")))
