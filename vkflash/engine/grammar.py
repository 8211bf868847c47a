"""Constrained decoding through llguidance: a JSON schema, a GBNF / Lark grammar or a regex becomes
a token mask applied to the logits before sampling, so the output always matches it.

`Grammar` is what a request compiles once (and a bad grammar fails there, as `InvalidRequest`);
`Grammar.constraint()` is the per-generation matcher the generation loop drives: `mask` sets every
token the grammar forbids to −inf, `accept` advances it by the token drawn, `done` says the grammar
admits no further byte (the output is complete).
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from vkflash.engine.api import InvalidRequest
from vkflash.model.tokenizer import NORMAL, Tokenizer

GrammarKind = Literal["json_schema", "gbnf", "lark", "regex", "llguidance"]

# per Tokenizer, its llguidance view (building one walks the whole vocabulary)
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, Any] = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


class _Vocab:
    """What llguidance's TokenizerWrapper reads of a tokenizer: token bytes (special tokens marked
    with a leading 0xFF, as llguidance expects, so grammar text never matches them) and an encoder."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        self.tokens = [tok.token_bytes(i) if ty == NORMAL else b"\xff" + t.encode("utf-8")
                       for i, (t, ty) in enumerate(zip(tok.tokens, tok.types))]
        self.special_token_ids = [i for i, ty in enumerate(tok.types) if ty != NORMAL]

    def __call__(self, text: str | bytes) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self.tok.encode(s, parse_special=False)


def ll_tokenizer(tok: Tokenizer, n_vocab: int) -> Any:
    """The llguidance tokenizer of `tok` (built once per tokenizer; the end tokens end a grammar)."""
    import llguidance

    with _LL_LOCK:
        ll = _LL_TOKENIZERS.get(tok)
        if ll is None:
            eos = sorted(tok.eog_ids) or [tok.eos_id]
            ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tok)), n_vocab=n_vocab, eos_token=eos)
            _LL_TOKENIZERS[tok] = ll
        return ll


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar over one tokenizer's vocabulary (n_vocab: the model's logits width)."""

    source: str
    ll_tok: Any
    n_vocab: int

    @classmethod
    def compile(cls, kind: GrammarKind, text: str | dict[str, Any], tok: Tokenizer, n_vocab: int,
                param: str) -> "Grammar":
        """Compile a grammar or raise InvalidRequest naming `param` and what is wrong with it."""
        import llguidance

        try:
            if kind == "json_schema":
                schema = json.loads(text) if isinstance(text, str) else text
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be an object")
                # compact JSON: a free run of whitespace between tokens is never what a client wants
                source = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, overrides={"whitespace_flexible": False})
            else:
                if not isinstance(text, str):
                    raise ValueError("a grammar is text")
                source = llguidance.grammar_from(kind, text)
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"{param}: {str(e).splitlines()[0]}", param) from None
        ll_tok = ll_tokenizer(tok, n_vocab)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, ll_tok)
        if is_error:
            raise InvalidRequest(f"{param}: {messages[0].splitlines()[0] if messages else 'invalid grammar'}", param)
        return cls(source, ll_tok, n_vocab)

    def constraint(self) -> "Constraint":
        """A fresh matcher at the grammar's start."""
        import llguidance

        m = llguidance.LLMatcher(self.ll_tok, self.source, log_level=0)
        if m.is_error():
            raise InvalidRequest(f"grammar: {m.get_error()}", "grammar")
        return Constraint(m, self.n_vocab)


@dataclass
class Constraint:
    """One generation's grammar state: masks logits, advances by the tokens drawn."""

    matcher: Any
    n_vocab: int
    _bits: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self._bits = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """bool[n_vocab]: the tokens the grammar admits next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every forbidden token at −inf (a new array; the input is not touched)."""
        ok = self.allowed()
        if not ok.any():
            raise RuntimeError(f"the grammar admits no token: {self.matcher.get_error() or 'dead end'}")
        return np.where(ok, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def accept(self, token: int) -> None:
        """Advance by the token drawn (it came from a masked draw, so the grammar allows it)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar admits no further output: the generation is complete."""
        return bool(self.matcher.is_stopped())
