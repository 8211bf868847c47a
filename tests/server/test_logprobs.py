"""logprobs / top_logprobs: the scores against float64 log-softmax (ties ordered by id), and the
server reporting them on chat and completions, streamed and not, from full logits even when the
forward has the greedy argmax fast path."""

from __future__ import annotations

import numpy as np
import pytest

from harness import call
from scripted import ArgmaxScripted, ScriptedForward, openai_client, serve_scripted

from vkflash.server.logprobs import score


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def test_score_is_log_softmax_with_ordered_ties(rng):
    for _ in range(50):
        V = int(rng.integers(1, 300))
        z = rng.normal(0, 5, V).astype(np.float32)
        if V > 3:  # force ties, some straddling the top-n cut
            z[rng.integers(0, V, size=V // 3)] = z[int(rng.integers(0, V))]
        t, n = int(rng.integers(0, V)), int(rng.integers(0, 25))
        lp, top = score(z, t, n)
        want = _log_softmax(z)
        assert abs(lp - want[t]) < 1e-12
        order = sorted(range(V), key=lambda i: (-want[i], i))[: min(n, V)]
        assert [i for i, _ in top] == order
        assert np.allclose([v for _, v in top], want[order], rtol=0, atol=1e-12)


MSGS = [{"role": "user", "content": "count"}]


def _serve(in_process, tiny_model, tokenizer, rng, cls=ScriptedForward):
    words = ["one", "two", "three", "four", "é", "fib", "(n)"]
    text = " ".join(rng.choice(words, size=int(rng.integers(2, 8))))
    fwd = cls(tokenizer.encode(text), tokenizer.eos_id, tokenizer.vocab_size, 256, rng=rng)
    return serve_scripted(in_process, tiny_model, tokenizer, fwd), fwd


def _check_entries(entries, fwd, tokenizer, k):
    """Each entry scores its token from the logits the forward gave for it; top-k as log-softmax."""
    assert len(entries) == len(fwd.given) - 1  # the last logits chose the end token (no entry)
    for e, z in zip(entries, fwd.given):
        want = _log_softmax(z)
        t = int(np.argmax(z))
        assert bytes(e["bytes"]) == tokenizer.token_bytes(t, special=True)
        assert e["token"] == bytes(e["bytes"]).decode("utf-8", errors="replace")
        assert abs(e["logprob"] - want[t]) < 1e-9
        top = e["top_logprobs"]
        assert len(top) == k
        order = np.argsort(-want, kind="stable")[:k]
        assert [bytes(x["bytes"]) for x in top] == [tokenizer.token_bytes(int(i), special=True) for i in order]
        assert np.allclose([x["logprob"] for x in top], want[order], rtol=0, atol=1e-9)


@pytest.mark.parametrize("cls", [ScriptedForward, ArgmaxScripted])
def test_chat_logprobs_streamed_and_not(in_process, tiny_model, tokenizer, rng, cls):
    base, fwd = _serve(in_process, tiny_model, tokenizer, rng, cls)
    k = int(rng.integers(0, 21))
    body = {"messages": MSGS, "temperature": 0, "logprobs": True, "top_logprobs": k}
    r = call(base, "POST", "/v1/chat/completions", body).body
    entries = r["choices"][0]["logprobs"]["content"]
    _check_entries(entries, fwd, tokenizer, k)
    assert len(entries) == r["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in entries) == r["choices"][0]["message"]["content"]

    streamed = []
    for ch in openai_client(base).chat.completions.create(model="scripted", messages=MSGS, temperature=0,
                                                            logprobs=True, top_logprobs=k, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += [e.model_dump() for e in ch.choices[0].logprobs.content]
    _check_entries(streamed, fwd, tokenizer, k)
    assert [e["bytes"] for e in streamed] == [e["bytes"] for e in entries]  # fresh random logits each run
    if cls is ArgmaxScripted:
        assert fwd.argmax_calls == 0  # logprobs need logits: the fast path stays off
        plain = call(base, "POST", "/v1/chat/completions", {"messages": MSGS, "temperature": 0}).body["choices"][0]
        assert plain["logprobs"] is None and plain["message"]["content"] == r["choices"][0]["message"]["content"]
        assert fwd.argmax_calls == r["usage"]["completion_tokens"] + 1  # without logprobs it is used


def test_completion_text_offsets_count_the_text(in_process, tiny_model, tokenizer, rng):
    """A character split over byte tokens (€ = E2 82 AC): each text_offset is the number of the text's
    characters before the token (the split character counts at its last byte), streamed and not."""
    byte_token = {tokenizer.token_bytes(i, special=True): i for i in range(tokenizer.vocab_size)}
    script = [*tokenizer.encode("a"), *(byte_token[bytes([b])] for b in "€".encode()), *tokenizer.encode("b")]
    fwd = ScriptedForward(script, tokenizer.eos_id, tokenizer.vocab_size, 256, rng=rng)
    base = serve_scripted(in_process, tiny_model, tokenizer, fwd)
    r = call(base, "POST", "/v1/completions", {"prompt": "count", "temperature": 0, "logprobs": 1}).body
    assert r["choices"][0]["text"] == "a€b" and r["choices"][0]["logprobs"]["text_offset"] == [0, 1, 1, 1, 2]
    chunks = list(openai_client(base).completions.create(model="scripted", prompt="count", temperature=0, logprobs=1,
                                                           stream=True))
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == [0, 1, 1, 1, 2]


def test_completion_logprobs_streamed_and_not(in_process, tiny_model, tokenizer, rng):
    base, fwd = _serve(in_process, tiny_model, tokenizer, rng)
    k = int(rng.integers(0, 6))
    r = call(base, "POST", "/v1/completions", {"prompt": "count", "temperature": 0, "logprobs": k}).body
    lp = r["choices"][0]["logprobs"]
    n = r["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    for i, z in enumerate(fwd.given[:n]):
        want = _log_softmax(z)
        assert abs(lp["token_logprobs"][i] - want.max()) < 1e-9
        top: dict[str, float] = {}
        for j in np.argsort(-want, kind="stable")[:k]:  # alternatives that print alike keep the best
            top.setdefault(tokenizer.token_bytes(int(j), special=True).decode(errors="replace"), want[j])
        assert list(lp["top_logprobs"][i]) == list(top)
        assert list(lp["top_logprobs"][i].values()) == pytest.approx(list(top.values()), abs=1e-9)
    chunks = list(openai_client(base).completions.create(model="scripted", prompt="count", temperature=0,
                                                           logprobs=k, stream=True))
    toks = sum((c.choices[0].logprobs.tokens for c in chunks), [])
    offs = sum((c.choices[0].logprobs.text_offset for c in chunks), [])
    vals = sum((c.choices[0].logprobs.token_logprobs for c in chunks), [])
    assert toks == lp["tokens"] and offs == lp["text_offset"]
    assert np.allclose(vals, [_log_softmax(z).max() for z in fwd.given[:n]], rtol=0, atol=1e-9)


@pytest.mark.parametrize("body,param", [({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
                                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                        ({"logprobs": 2}, "logprobs")])
def test_logprobs_request_errors(in_process, tiny_model, tokenizer, rng, body, param):
    base, _ = _serve(in_process, tiny_model, tokenizer, rng)
    r = call(base, "POST", "/v1/chat/completions", {"messages": MSGS, **body})
    assert r.status == 400 and r.body["error"]["param"] == param
