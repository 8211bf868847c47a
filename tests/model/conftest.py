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
        self._ascii_id: int | None = None

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp tokenization with parse_special=true, no BOS."""
        body = json.dumps({"content": text, "add_special": False, "parse_special": True}).encode()
        req = urllib.request.Request(self.base + "/tokenize", data=body, headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())["tokens"]

    def complete(self, prompt: list[int], n: int, n_probs: int = 5) -> list[dict]:
        """Greedy continuation of prompt ids: exactly n steps, each {'id', 'logprob', 'top_logprobs': [...]}
        from the raw logits, 'id' being their argmax over the whole vocabulary (EOS included).

        One single-token request per step, on prompt + the ids chosen so far, without the prompt
        cache. llama-server records a step's logprobs only when the text generated so far ends on a
        whole UTF-8 character, so a byte-level BPE token that ends inside one (a lone lead byte such
        as 0xF3, common among random models' greedy picks) silently drops its step, and a reply made
        only of such steps has "logprobs": null. Each request therefore biases the sampler onto a
        plain ASCII token: the step is always recorded, and its logprobs are still the model's own
        (llama.cpp reads them from the unbiased logits, not from the sampler)."""
        if n_probs < 1:
            raise ValueError("n_probs must be at least 1: the greedy id is read from the top logprobs")
        if self._ascii_id is None:
            self._ascii_id = self.tokenize("a")[-1]  # any token of ASCII text is whole UTF-8
        ids, steps = [int(t) for t in prompt], []
        for _ in range(n):
            body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "n_probs": n_probs, "ignore_eos": True,
                    "cache_prompt": False, "logit_bias": [[self._ascii_id, 1e4]]}
            r = self.server.handle_completions(body)
            try:
                (entry,) = r["choices"][0]["logprobs"]["content"]
                top = entry["top_logprobs"]
                assert entry["id"] == self._ascii_id and len(top) >= 1
            except (KeyError, IndexError, TypeError, ValueError, AssertionError):
                raise AssertionError(f"llama-server gave no usable logprobs\nrequest: {json.dumps(body)}\n"
                                     f"reply: {json.dumps(r)}") from None
            steps.append({"id": top[0]["id"], "logprob": top[0]["logprob"], "top_logprobs": top})
            ids.append(top[0]["id"])
        return steps

@pytest.fixture
def llama_oracle():
    """The llama_server context manager (skips when xllamacpp is missing)."""
    return llama_server
