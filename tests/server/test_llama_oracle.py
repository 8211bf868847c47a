"""llama-server itself (xllamacpp's embedded server, loopback only) as the oracle of the llama-style
endpoints on the same tiny model: /infill's FIM prompt, /apply-template, /tokenize's pieces."""

from __future__ import annotations

import json
import urllib.request

import pytest

from harness import call
from scripted import ScriptedForward, serve_scripted

from vkflash.server.llama_api import infill_prompt
from vkflash.server.schemas import InfillRequest

N_CTX, N_BATCH = 1024, 512
WORDS = ["def", " fib", "(n)", ":", " return", " x", "\n", "    ", " é", "<|im_end|>", "中"]


@pytest.fixture(scope="module")
def oracle(tiny_model):
    """POST to a CPU llama-server on the tiny model (n_ctx 1024, n_batch 512)."""
    xlc = pytest.importorskip("xllamacpp")
    p = xlc.CommonParams()
    p.model.path = str(tiny_model)
    p.n_ctx, p.n_batch, p.n_parallel, p.warmup = N_CTX, N_BATCH, 1, False
    p.cpuparams.n_threads = 2
    server = xlc.Server(p)
    base = server.listening_address

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            return json.loads(urllib.request.urlopen(req, timeout=120).read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"llama-server: {e.code} {e.read().decode()}") from None

    yield post
    del server


def _text(rng, n: int) -> str:
    return "".join(rng.choice(WORDS, size=n))


@pytest.mark.oracle
def test_infill_prompt_is_llama_servers(oracle, tokenizer, rng):
    """The same FIM layout and cuts: extra files where the context leaves room, the prefix's tail and
    the suffix's head within one batch. (llama-server reserves room for its own default n_predict,
    -1, whatever the request asks; vkflash for the request's, so the request leaves it out here.)"""
    for k in range(4):  # a prefix past its cut with short extras, or extras past theirs (both: over n_ctx)
        n_prefix, n_extra = (500, 80) if k % 2 else (100, 400)
        body = {"input_prefix": _text(rng, int(rng.integers(0, n_prefix))),
                "input_suffix": _text(rng, int(rng.integers(0, 200))), "prompt": _text(rng, int(rng.integers(0, 5))),
                "input_extra": [{"filename": f"m{i}.py", "text": _text(rng, int(rng.integers(0, n_extra)))}
                                for i in range(int(rng.integers(0, 3)))],
                "temperature": 0, "cache_prompt": False}
        want = oracle("/infill", dict(body, max_tokens=1))
        ids = infill_prompt(tokenizer, InfillRequest.model_validate(body), N_BATCH, N_CTX, -1)
        assert tokenizer.decode(ids, special=True) == want["prompt"]
        assert len(ids) == want["tokens_evaluated"]


@pytest.mark.oracle
def test_apply_template_and_pieces_are_llama_servers(oracle, in_process, tiny_model, tokenizer, rng):
    fwd = ScriptedForward([], tokenizer.eos_id, tokenizer.vocab_size, N_CTX)
    base = serve_scripted(in_process, tiny_model, tokenizer, fwd)
    msgs = [{"role": "system", "content": _text(rng, 3)}, {"role": "user", "content": _text(rng, 4)},
            {"role": "assistant", "content": _text(rng, 4)}, {"role": "user", "content": _text(rng, 2)}]
    assert call(base, "POST", "/apply-template", {"messages": msgs}).body == oracle("/apply-template",
                                                                                   {"messages": msgs})
    text = _text(rng, 12) + "ж🙂"
    for parse_special in (True, False):
        body = {"content": text, "with_pieces": True, "parse_special": parse_special}
        assert call(base, "POST", "/tokenize", body).body == oracle("/tokenize", body), parse_special
