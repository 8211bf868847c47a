"""Fixtures of the model room: llama.cpp (xllamacpp's embedded server, loopback only) as an oracle
for tokenization and logits."""

from __future__ import annotations

import json
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def llama_server(path: Path, n_ctx: int = 512):
    """A CPU llama.cpp server on path; yields an object with tokenize() and complete()."""
    xlc = pytest.importorskip("xllamacpp")
    p = xlc.CommonParams()
    p.model.path = str(path)
    p.n_ctx = n_ctx
    p.n_parallel = 1
    p.warmup = False
    p.cpuparams.n_threads = 2
    server = xlc.Server(p)
    try:
        yield _Oracle(server)
    finally:
        del server


class _Oracle:
    """Thin wrapper over the two calls the tests need."""

    def __init__(self, server) -> None:
        self.server = server
        self.base = server.listening_address

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp tokenization with parse_special=true, no BOS."""
        body = json.dumps({"content": text, "add_special": False, "parse_special": True}).encode()
        req = urllib.request.Request(self.base + "/tokenize", data=body, headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())["tokens"]

    def complete(self, prompt: list[int], n: int, n_probs: int = 5) -> list[dict]:
        """Greedy continuation of prompt ids; per step {'id', 'logprob', 'top_logprobs': [...]}."""
        r = self.server.handle_completions({"prompt": prompt, "max_tokens": n, "temperature": 0,
                                            "n_probs": n_probs, "ignore_eos": True})
        return r["choices"][0]["logprobs"]["content"]


@pytest.fixture
def llama_oracle():
    """The llama_server context manager (skips when xllamacpp is missing)."""
    return llama_server
