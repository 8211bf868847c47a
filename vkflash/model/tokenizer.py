"""Tokenizer built from GGUF `tokenizer.ggml.*` metadata only, matching llama.cpp's tokenization.

gpt2-style byte-level BPE (via `tokenizers`) with the file's pre-tokenizer regex; special
tokens in text are split out first exactly like llama.cpp's `parse_special=true` partition
(longest token text first). No NFC or other normalisation, like llama.cpp.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vkflash.errors import FormatError, one_line
from vkflash.formats.gguf_file import GGUFFile

# llama.cpp pre-tokenizer regexes by `tokenizer.ggml.pre` (llama-vocab.cpp / unicode.cpp)
PRE_REGEX: dict[str, str] = {
    "qwen2": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
              r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TOKEN_TYPES = range(0, BYTE + 1)  # llama.cpp's llama_token_type: UNDEFINED (0) … BYTE
# token texts llama.cpp's loader forces to CONTROL (end-of-generation / FIM auto-detection)
FORCED_CONTROL = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "</s>", "<|return|>", "<|call|>", "<|flush|>",
    "<|calls|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
})
# end-of-generation texts (llama.cpp special_eog_ids auto-detection, the subset Qwen uses)
EOG_TEXTS = frozenset({"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<|eom_id|>",
                       "<end_of_turn>", "<|end_of_text|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"})


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable unicode map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


@dataclass
class IncrementalDetokenizer:
    """Streams text from token ids; holds back bytes of a UTF-8 character split across tokens."""

    tok: "Tokenizer"
    _dec: codecs.IncrementalDecoder = field(init=False)

    def __post_init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token (possibly empty)."""
        return self._dec.decode(self.tok.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still pending, with U+FFFD for an unfinished character."""
        return self._dec.decode(b"", final=True)


class Tokenizer:
    """llama.cpp-compatible BPE tokenizer of a GGUF file (model `gpt2`)."""

    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], pre: str,
                 eos_id: int | None, bos_id: int | None = None, add_bos: bool = False,
                 eot_id: int | None = None) -> None:
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        if pre not in PRE_REGEX:
            raise FormatError(f"unsupported tokenizer.ggml.pre {pre!r} (supported: {', '.join(PRE_REGEX)})")
        self.tokens, self.pre, self.add_bos = tokens, pre, add_bos
        self.types = [CONTROL if (t in FORCED_CONTROL and ty == NORMAL) else ty
                      for t, ty in zip(tokens, token_types)]
        self.bos_id, self.eos_id = bos_id, eos_id
        by_text: dict[str, int] = {}
        for i, t in enumerate(tokens):
            by_text.setdefault(t, i)
        self.eot_id = eot_id if eot_id is not None else by_text.get("<|im_end|>")
        self.eog_ids = {i for t, i in by_text.items() if t in EOG_TEXTS}
        self.eog_ids |= {x for x in (eos_id, self.eot_id) if x is not None}
        specials = [i for i, ty in enumerate(self.types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)]
        self._specials = sorted(specials, key=lambda i: -len(tokens[i]))  # stable: lower id first on ties
        pairs = [_merge_pair(i, m) for i, m in enumerate(merges)]
        try:
            bpe = models.BPE(vocab=by_text, merges=pairs, ignore_merges=False)
        except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
            raise FormatError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {one_line(str(e))}") from None
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        self._hf = hf

    @classmethod
    def from_fields(cls, meta: dict) -> "Tokenizer":
        """From a dict of GGUF metadata (key → Python value), every key's type and length checked."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise FormatError(f"unsupported tokenizer.ggml.model {model!r}: only gpt2 (byte-level BPE)")
        tokens = _strings(meta, "tokenizer.ggml.tokens")
        merges = _strings(meta, "tokenizer.ggml.merges")
        if not tokens:
            raise FormatError("tokenizer.ggml.tokens is empty")
        types = _per_token(meta, "tokenizer.ggml.token_type", len(tokens), int)
        if types is not None:
            bad = next((i for i, t in enumerate(types) if t not in TOKEN_TYPES), None)
            if bad is not None:
                raise FormatError(f"tokenizer.ggml.token_type[{bad}] = {types[bad]} is not a token type "
                                  f"({TOKEN_TYPES.start}..{TOKEN_TYPES.stop - 1})")
        _per_token(meta, "tokenizer.ggml.scores", len(tokens), float)  # unused by BPE, but llama.cpp reads it
        pre = meta.get("tokenizer.ggml.pre", "default")
        if not isinstance(pre, str):
            raise FormatError(f"tokenizer.ggml.pre must be a string, found {type(pre).__name__}")
        add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
        if not isinstance(add_bos, bool):
            raise FormatError(f"tokenizer.ggml.add_bos_token must be a bool, found {type(add_bos).__name__}")
        ids = {k: _token_id(meta, f"tokenizer.ggml.{k}_token_id", len(tokens)) for k in ("eos", "bos", "eot")}
        return cls(tokens, types if types is not None else [NORMAL] * len(tokens), merges, pre,
                   eos_id=ids["eos"], bos_id=ids["bos"], add_bos=add_bos, eot_id=ids["eot"])

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """Read the tokenizer.ggml.* keys of a GGUF file."""
        meta = read_tokenizer_meta(path)  # its errors already name the file
        try:
            return cls.from_fields(meta)
        except FormatError as e:
            raise FormatError(f"{path}: {e}") from None

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return len(self.tokens)

    def _partition(self, text: str) -> list[str | int]:
        """Split text into raw fragments and special ids, longest special text first (llama.cpp)."""
        parts: list[str | int] = [text]
        for sid in self._specials:
            s = self.tokens[sid]
            if not s:
                continue
            out: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or s not in p:
                    out.append(p)
                    continue
                pieces = p.split(s)
                for k, piece in enumerate(pieces):
                    if piece:
                        out.append(piece)
                    if k + 1 < len(pieces):
                        out.append(sid)
            parts = out
        return parts

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of text; BOS first when add_special and the file asks for it."""
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        parts = self._partition(text) if parse_special else [text]
        for p in parts:
            if isinstance(p, int):
                ids.append(p)
            else:
                # encode_batch releases the GIL (encode holds it: a long prompt froze the server's event loop)
                ids.extend(self._hf.encode_batch([p], add_special_tokens=False)[0].ids)
        return ids

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The bytes token_id stands for (llama.cpp token_to_piece); control tokens only if special."""
        ty, text = self.types[token_id], self.tokens[token_id]
        if ty == NORMAL:
            return bytes(_BYTE_OF_CHAR.get(c, 0) for c in text)
        if ty == USER_DEFINED or (special and ty in (CONTROL, UNKNOWN)):
            return text.encode("utf-8")
        return b""

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of a token sequence (invalid UTF-8 becomes U+FFFD)."""
        return b"".join(self.token_bytes(int(i), special) for i in ids).decode("utf-8", errors="replace")

    def template_tokens(self) -> dict[str, str]:
        """bos_token / eos_token for a chat template: the special tokens' texts ("" where the model
        has none), as llama-server passes them."""
        return {f"{k}_token": self.decode([t], special=True) if t is not None else ""
                for k, t in (("bos", self.bos_id), ("eos", self.eos_id))}

    def streamer(self) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for streaming output."""
        return IncrementalDetokenizer(self)

    def is_eog(self, token_id: int) -> bool:
        """True for end-of-generation tokens (eos, eot, <|im_end|>, <|endoftext|>, …)."""
        return token_id in self.eog_ids


def _strings(meta: dict, key: str) -> list[str]:
    """A required array of strings."""
    value = meta.get(key)
    if value is None:
        raise FormatError(f"GGUF tokenizer metadata lacks {key}")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise FormatError(f"{key} must be an array of strings")
    return value


def _per_token(meta: dict, key: str, n: int, kind: type) -> list | None:
    """An optional numeric array (int or float) with one entry per token, None when absent."""
    value = meta.get(key)
    if value is None:
        return None
    ok = (int,) if kind is int else (int, float)
    if not isinstance(value, list) or not all(isinstance(v, ok) and not isinstance(v, bool) for v in value):
        raise FormatError(f"{key} must be an array of {'integers' if kind is int else 'numbers'}")
    if len(value) != n:
        raise FormatError(f"{key} has {len(value)} entries, tokenizer.ggml.tokens has {n}")
    return value


def _token_id(meta: dict, key: str, n: int) -> int | None:
    """An optional token id, which must name one of the n tokens."""
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise FormatError(f"{key} must be an integer, found {type(value).__name__}")
    if not 0 <= value < n:
        raise FormatError(f"{key} = {value} is not a token id (0..{n - 1})")
    return value


def _merge_pair(i: int, merge: str) -> tuple[str, str]:
    """The two token texts of merge i ("left right")."""
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise FormatError(f"tokenizer.ggml.merges[{i}] = {merge!r} is not two tokens separated by a space")
    return left, right


def read_tokenizer_meta(path: str | Path | GGUFFile) -> dict:
    """The tokenizer.* metadata of a GGUF file (a path, read by GGUFFile, or an open GGUFFile) as plain
    Python values (arrays as lists)."""
    meta = (path if isinstance(path, GGUFFile) else GGUFFile(path)).metadata
    return {k: _plain(meta[k]) for k in meta if k.startswith("tokenizer.")}


def _plain(value: Any) -> Any:
    """A decoded metadata value with NumPy arrays turned into lists of Python scalars."""
    return value.tolist() if isinstance(value, np.ndarray) else value
