"""The one checked way into a GGUF model file: everything a later load would trip on, up front.

`open_model` reads the file through formats' GGUFFile (header, key/value types and lengths, the
tensor table against the file's length), then the arch's hyper-parameters and tensor table
(model/hparams, model/tensors), builds the tokenizer and renders the chat template once.
`vkflash inspect` reports exactly this, and `run`, `verify`, `bench` and `serve` go through it
before loading anything: a file `inspect` calls valid loads, and a damaged one stops with one
VkflashError line that names the file and what is wrong with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gguf import GGUFValueType

from vkflash.errors import FormatError, ModelError, VkflashError, one_line
from vkflash.formats.gguf_file import GGUFFile
from vkflash.model.hparams import HParams, hparams_from_gguf
from vkflash.model.tensors import validate_tensors
from vkflash.model.tokenizer import Tokenizer, read_tokenizer_meta

TEMPLATE_KEY = "tokenizer.chat_template"


@dataclass(frozen=True)
class ModelFile:
    """A GGUF model file that passed every check: its hyper-parameters, tensors and tokenizer."""

    file: GGUFFile
    hp: HParams
    tokenizer: Tokenizer | None
    """None only when the file has no tokenizer.ggml.* key at all (weights-only test files)."""
    chat_template: str | None
    """tokenizer.chat_template, None when the file has none."""
    mtp_only: bool = False
    """An MTP-only file (a draft head for MODEL_DRAFT), opened with open_model(draft=True)."""

    def require_tokenizer(self) -> Tokenizer:
        """The tokenizer, or a ModelError for a file without one (text in or out needs it)."""
        if self.tokenizer is None:
            raise ModelError(f"{self.file.path}: the file has no tokenizer (tokenizer.ggml.* keys)")
        return self.tokenizer

    def describe(self) -> str:
        """One line: arch, tensor count, tokenizer."""
        tok = self.tokenizer
        words = f"{tok.vocab_size}-token {tok.pre} BPE tokenizer" if tok is not None else "no tokenizer"
        kind = f"{self.hp.arch} MTP-only draft" if self.mtp_only else self.hp.arch
        return f"{kind}, {len(self.file.tensors)} tensors, {words}"


def open_model(path: str | os.PathLike[str], draft: bool = False) -> ModelFile:
    """Open and check a GGUF model file (see the module docstring); every failure is one VkflashError.
    An MTP-only file (no trunk: a draft head for MODEL_DRAFT) passes only with `draft` (inspect)."""
    try:
        gf = GGUFFile(path)  # its errors already name the file
    except VkflashError as e:
        raise type(e)(one_line(str(e))) from None
    try:
        hp = hparams_from_gguf(gf)
        mtp_only = validate_tensors(hp, {n: t.ne for n, t in gf.tensors.items()}).mtp_only
        if mtp_only and not draft:
            raise ModelError("an MTP-only file (a draft head: MODEL_DRAFT / --draft), not a model to run")
        tok = _tokenizer(gf, hp)
        template = _chat_template(gf)
    except VkflashError as e:
        raise type(e)(one_line(f"{gf.path}: {e}")) from None
    return ModelFile(gf, hp, tok, template, mtp_only)


def _tokenizer(gf: GGUFFile, hp: HParams) -> Tokenizer | None:
    """The file's tokenizer, built (so merges that do not fit the tokens fail here), within hp.V ids."""
    if not any(k.startswith("tokenizer.ggml.") for k in gf.metadata):
        return None
    tok = Tokenizer.from_fields(read_tokenizer_meta(gf))
    if tok.vocab_size > hp.V:
        raise ModelError(f"the tokenizer has {tok.vocab_size} tokens but the model only {hp.V}")
    return tok


def _chat_template(gf: GGUFFile) -> str | None:
    """tokenizer.chat_template, which must be a string that renders a one-message chat."""
    from vkflash.model.chat import render_chat

    typ = gf.metadata.key_type(TEMPLATE_KEY)
    if typ is None:
        return None
    if typ != GGUFValueType.STRING:
        raise FormatError(f"{TEMPLATE_KEY} must be a string, found {typ.name}")
    source = str(gf.metadata[TEMPLATE_KEY])
    try:
        render_chat(source, [{"role": "user", "content": "hi"}])
    except VkflashError:
        raise
    except Exception as e:  # a template is code: any exception of its own means the file's template is broken
        raise ModelError(f"{TEMPLATE_KEY} fails on a one-message chat: {type(e).__name__}: {e}") from None
    return source
