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

from vkflash.errors import FormatError
from vkflash.formats.gguf_file import GGUFFile

# llama.cpp pre-tokenizer regexes by `tokenizer.ggml.pre` (llama-vocab.cpp / unicode.cpp)
PRE_REGEX: dict[str, str] = {
    "qwen2": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
              r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
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
    special: bool = False
    _dec: codecs.IncrementalDecoder = field(init=False)

    def __post_init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token (possibly empty)."""
        return self._dec.decode(self.tok.token_bytes(token_id, self.special))

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
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=by_text, merges=pairs, ignore_merges=False)
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        self._hf = hf

    @classmethod
    def from_fields(cls, meta: dict) -> "Tokenizer":
        """From a dict of GGUF metadata (key → Python value)."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise FormatError(f"unsupported tokenizer.ggml.model {model!r}: only gpt2 (byte-level BPE)")
        try:
            tokens = list(meta["tokenizer.ggml.tokens"])
            merges = list(meta["tokenizer.ggml.merges"])
        except KeyError as e:
            raise FormatError(f"GGUF tokenizer metadata lacks {e.args[0]}") from None
        types = list(meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
        return cls(tokens, [int(t) for t in types], merges, str(meta.get("tokenizer.ggml.pre", "default")),
                   eos_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
                   bos_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   eot_id=_opt_int(meta.get("tokenizer.ggml.eot_token_id")))

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """Read the tokenizer.ggml.* keys of a GGUF file."""
        return cls.from_fields(read_tokenizer_meta(path))

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

    def streamer(self, special: bool = False) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for streaming output."""
        return IncrementalDetokenizer(self, special)

    def is_eog(self, token_id: int) -> bool:
        """True for end-of-generation tokens (eos, eot, <|im_end|>, <|endoftext|>, …)."""
        return token_id in self.eog_ids


def _opt_int(v) -> int | None:
    """int(v) or None."""
    return None if v is None else int(v)


def read_tokenizer_meta(path: str | Path) -> dict:
    """The tokenizer.* metadata of a GGUF file, read by GGUFFile, as plain Python values (arrays as lists)."""
    meta = GGUFFile(path).metadata
    return {k: _plain(meta[k]) for k in meta if k.startswith("tokenizer.")}


def _plain(value: Any) -> Any:
    """A decoded metadata value with NumPy arrays turned into lists of Python scalars."""
    return value.tolist() if isinstance(value, np.ndarray) else value
