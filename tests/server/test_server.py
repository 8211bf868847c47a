"""The server as a real process on a tiny generated model: the official openai client, SSE
flushing on a raw socket, the bounded queue, disconnects, every error case, null fields, usage once
per stream, any model name, the paths without /v1, and the side endpoints."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from harness import call, start_server, stop_server

from vkflash.engine.api import SamplingParams, TokenEvent
from vkflash.engine.generate import generate
from vkflash.engine.reference_backend import ReferenceForward
from vkflash.model.chat import render_chat
from vkflash.model.weights import load_model

CTX = 160
DELAY_MS = 20
QUEUE = 2


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("srv"), {"MODEL": str(tiny_model), "CTX": str(CTX)},
                     ["--queue-depth", str(QUEUE), "--token-delay-ms", str(DELAY_MS)])
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def model_id(server):
    return call(server.base, "GET", "/v1/models").body["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def _words(rng, n):
    vocab = ["def", "return", "fibonacci", "for", "in", "range", "print", "hello", "value", "n", "(", ")", ":"]
    return " ".join(rng.choice(vocab, size=n))


def _prompt_ids(tokenizer, template, messages):
    return tokenizer.encode(render_chat(template, messages), add_special=True, parse_special=True)


def _template(tiny_model):
    from vkflash.model.tokenizer import read_tokenizer_meta

    return read_tokenizer_meta(tiny_model)["tokenizer.chat_template"]


def test_startup_prints_every_knob_with_its_source(server):
    out = server.output()
    assert f"CTX={CTX} (env CTX)" in out
    assert "TEMP=0.8 (default)" in out
    assert "listening on http://127.0.0.1:" in out


def test_openai_chat_streamed_and_not(client, model_id, tokenizer, tiny_model, rng):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": _words(rng, 8)}]
    m = int(rng.integers(3, 12))
    r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=m, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == m
    assert r.usage.prompt_tokens == len(_prompt_ids(tokenizer, _template(tiny_model), messages))
    assert r.usage.total_tokens == r.usage.prompt_tokens + m
    stream = client.chat.completions.create(model=model_id, messages=messages, max_tokens=m, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # greedy: same tokens both ways
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == m and not chunks[-1].choices


def test_openai_completions_match_the_reference(client, model_id, tiny_model, tokenizer, rng):
    """Greedy tokens through the server = greedy tokens of the NumPy reference run here."""
    prompt = [int(t) for t in rng.integers(0, 400, size=int(rng.integers(3, 20)))]
    m = int(rng.integers(2, 10))
    fwd = ReferenceForward(load_model(tiny_model), CTX)
    want = [e.token for e in generate(fwd, tokenizer, prompt, SamplingParams(temperature=0.0, max_tokens=m,
                                                                               ignore_eos=True))
            if isinstance(e, TokenEvent)]
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=m, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode(want)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(want)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt=prompt, max_tokens=m, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == r.choices[0].text


def test_seeded_sampling_repeats(server, rng):
    body = {"prompt": _words(rng, 5), "max_tokens": 8, "temperature": 1.0, "seed": int(rng.integers(0, 2**31)),
            "ignore_eos": True}
    a = call(server.base, "POST", "/v1/completions", body)
    b = call(server.base, "POST", "/v1/completions", body)
    assert a.status == b.status == 200 and a.body["choices"][0]["text"] == b.body["choices"][0]["text"]
    t = a.body["timings"]
    assert t["prompt_n"] + t["cache_n"] == a.body["usage"]["prompt_tokens"] and t["predicted_n"] == 8 and t["predicted_ms"] > 0


def _raw_stream(base: str, body: dict, on_event=None) -> list[tuple[float, str]]:
    """POST a streamed request over a plain socket; (arrival time, data) of each SSE event."""
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    events, buf = [], b""
    try:
        while True:
            data = s.recv(65536)
            if not data:
                break
            buf += data
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                line = ev.decode().split("data: ", 1)
                if len(line) == 2:
                    events.append((time.monotonic(), line[1]))
                    if on_event is not None and on_event(events):
                        return events
    finally:
        s.close()
    return events


def test_first_event_is_flushed_before_generation_ends(server, rng):
    n = 40
    t0 = time.monotonic()
    events = _raw_stream(server.base, {"messages": [{"role": "user", "content": _words(rng, 4)}], "max_tokens": n,
                                       "temperature": 0, "stream": True, "ignore_eos": True})
    assert events[-1][1] == "[DONE]"
    first_token = next(t for t, d in events if d != "[DONE]" and json.loads(d)["choices"][0]["delta"].get("content"))
    done = events[-1][0]
    # n tokens with ≥ DELAY_MS each: the first token must reach us long before the last
    assert done - first_token > 0.5 * (n - 1) * DELAY_MS / 1e3, (first_token - t0, done - t0)


def test_concurrent_clients_complete_or_get_503(server, rng):
    n_clients, m = 7, 15
    before = call(server.base, "GET", "/metrics").body
    results: list = [None] * n_clients

    def one(i: int) -> None:
        body = {"prompt": _words(rng, 3), "max_tokens": m, "temperature": 0, "ignore_eos": True}
        results[i] = call(server.base, "POST", "/v1/completions", body, timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if r.status == 200]
    busy = [r for r in results if r.status == 503]
    assert len(ok) + len(busy) == n_clients
    assert all(r.body["choices"][0]["finish_reason"] == "length" and r.body["usage"]["completion_tokens"] == m
               for r in ok)
    assert all(r.headers.get("retry-after") and r.body["error"]["code"] == "queue_full" for r in busy)
    assert len(ok) >= 1 + QUEUE and busy  # the slot plus the queue were used, the rest refused
    after = call(server.base, "GET", "/metrics").body
    assert _metric(after, "vkflash_rejected_total") - _metric(before, "vkflash_rejected_total") == len(busy)


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_slot(server, rng, stream):
    before = call(server.base, "GET", "/metrics").body
    body = {"messages": [{"role": "user", "content": _words(rng, 4)}], "max_tokens": 130, "temperature": 0,
            "stream": stream, "ignore_eos": True}
    if stream:
        events = _raw_stream(server.base, body, on_event=lambda evs: len(evs) >= 3)  # hang up after 2 tokens
        assert len(events) == 3
    else:
        _hang_up_after(server.base, body, 0.3)
    t0 = time.monotonic()
    r = call(server.base, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 2, "temperature": 0})
    took = time.monotonic() - t0
    assert r.status == 200
    # the abandoned request had > 100 tokens × ≥ DELAY_MS left; the next one must not wait for them
    assert took < 0.5 * 100 * DELAY_MS / 1e3, took
    after = call(server.base, "GET", "/metrics").body
    assert _metric(after, 'vkflash_generations_total{reason="cancelled"}') \
        - _metric(before, 'vkflash_generations_total{reason="cancelled"}') == 1


def _hang_up_after(base: str, body: dict, seconds: float) -> None:
    """Send a non-streamed request, then close the connection before the answer comes."""
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        time.sleep(seconds)


def test_mid_conversation_system_message(client, model_id, tokenizer, tiny_model, rng):
    messages = [{"role": "system", "content": "one"}, {"role": "user", "content": _words(rng, 3)},
                {"role": "assistant", "content": _words(rng, 3)}, {"role": "system", "content": "two"},
                {"role": "user", "content": _words(rng, 3)}]
    r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == len(_prompt_ids(tokenizer, _template(tiny_model), messages))


def _chat(**kw):
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **kw}


@pytest.mark.parametrize("name,kwargs,status,param", [
    ("invalid json", {"raw": b'{"messages": [}'}, 400, None),
    ("not an object", {"raw": b'[1, 2]'}, 400, None),
    ("missing messages", {"body": {"max_tokens": 3}}, 400, "messages"),
    ("messages wrong type", {"body": {"messages": "hi"}}, 400, "messages"),
    ("temperature wrong type", {"body": _chat(temperature="hot")}, 400, "temperature"),
    ("max_tokens wrong type", {"body": _chat(max_tokens=2.5)}, 400, "max_tokens"),
    ("bad role", {"body": {"messages": [{"role": "wizard", "content": "x"}]}}, 400, "messages"),
    ("empty messages", {"body": {"messages": []}}, 400, "messages"),
    ("temperature out of range", {"body": _chat(temperature=-1)}, 400, "temperature"),
    ("n > 1", {"body": _chat(n=2)}, 400, "n"),
    ("image part", {"body": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}}, 400, "messages"),
    ("prompt longer than context", {"body": {"messages": [{"role": "user", "content": "hello " * CTX}]}}, 400,
     "messages"),
])
def test_errors_are_openai_objects_and_the_server_lives_on(server, name, kwargs, status, param):
    r = call(server.base, "POST", "/v1/chat/completions", **kwargs)
    assert r.status == status, (name, r.body)
    err = r.body["error"]
    assert err["message"] and err["type"] and err["param"] == param, (name, err)
    if name == "prompt longer than context":
        assert err["code"] == "context_length_exceeded"
    ok = call(server.base, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert ok.status == 200 and call(server.base, "GET", "/health").status == 200


def _events(body: str) -> list[dict]:
    """The JSON events of an SSE body ([DONE] left out)."""
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: {")]


def test_null_means_the_default(server, rng):
    """OpenAI clients send null for a field left at its default: it takes that default (it was a
    400), streamed or not; a required field's null stays a 400."""
    chat = {"messages": [{"role": "user", "content": _words(rng, 4)}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "cache_prompt": False}
    nulls = dict.fromkeys(("model", "n", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logprobs",
                           "top_logprobs", "tools", "tool_choice"), None)
    want = call(server.base, "POST", "/v1/chat/completions", chat).body["choices"][0]
    r = call(server.base, "POST", "/v1/chat/completions", {**chat, **nulls, "stream": None, "stream_options": None})
    assert r.status == 200 and r.body["choices"][0] == want, r.body
    r = call(server.base, "POST", "/v1/chat/completions",
             {**chat, **nulls, "stream": True, "stream_options": {"include_usage": None}})
    events = _events(r.body)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == want["message"]["content"]
    assert all(e["choices"] for e in events) and "usage" in events[-1]  # include_usage null: false
    text = {"prompt": _words(rng, 4), "max_tokens": 2, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    want = call(server.base, "POST", "/v1/completions", text).body["choices"][0]
    r = call(server.base, "POST", "/v1/completions", {**text, "echo": None, "logprobs": None, "top_k": None})
    assert r.status == 200 and r.body["choices"][0] == want, r.body
    for path, body in (("/v1/chat/completions", {"messages": None}), ("/v1/completions", {"prompt": None}),
                       ("/v1/chat/completions", {"messages": [{"role": None, "content": "hi"}]})):
        r = call(server.base, "POST", path, body)
        assert r.status == 400 and r.body["error"]["param"] == next(iter(body)), r.body


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", _chat(ignore_eos=True)),
                                       ("/v1/completions", {"prompt": "hello", "max_tokens": 2, "ignore_eos": True})])
def test_stream_usage_comes_once(server, path, body, include_usage):
    """A stream carries usage once (clients that sum every chunk's usage, LangChain's, counted it
    twice): with include_usage in a last chunk without choices, else on the finish chunk, which
    always has the timings."""
    r = call(server.base, "POST", path, {**body, "stream": True, "stream_options": {"include_usage": include_usage}})
    assert r.status == 200 and r.body.rstrip().endswith("data: [DONE]")
    events = _events(r.body)
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and "timings" in finish[0]
    assert [e for e in events if "usage" in e] == [events[-1]] and events[-1]["usage"]["completion_tokens"] == 2
    assert (events[-1]["choices"] == []) if include_usage else (events[-1] is finish[0])


def test_any_model_name_is_the_served_model(client, model_id):
    """As llama-server, `model` is not checked (clients send placeholders); responses name the served model."""
    r = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == model_id and r.choices[0].finish_reason in ("stop", "length")
    assert client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2).model == model_id


def test_paths_without_v1(server, model_id):
    """llama-server's aliases: /chat/completions, /completions and /models, for clients whose base URL has no /v1."""
    import openai

    c = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in c.models.list()] == [model_id]
    r = c.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.object == "chat.completion" and r.usage.completion_tokens >= 1
    r = c.completions.create(model=model_id, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.usage.completion_tokens == 2


def test_max_tokens_beyond_the_context_is_length(server):
    r = call(server.base, "POST", "/v1/completions", {"prompt": [1, 2, 3] * 40, "max_tokens": 10 * CTX,
                                                       "temperature": 0, "ignore_eos": True})
    assert r.status == 200
    assert r.body["choices"][0]["finish_reason"] == "length"
    assert r.body["usage"]["total_tokens"] == CTX


def test_unknown_path_and_method(server):
    r = call(server.base, "GET", "/v2/nothing")
    assert r.status == 404 and r.body["error"]["message"]
    r = call(server.base, "GET", "/v1/chat/completions")
    assert r.status == 405 and r.body["error"]["message"]


def test_health_models_props_openapi(server, model_id):
    assert call(server.base, "GET", "/health").body["status"] == "ok"
    assert model_id in server.output()
    props = call(server.base, "GET", "/props").body
    assert props["default_generation_settings"]["n_ctx"] == CTX and props["total_slots"] == 1
    assert "<|im_start|>" in props["chat_template"]
    schema = call(server.base, "GET", "/openapi.json").body
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize"):
        assert path in schema["paths"], path
    assert "ChatRequest" in schema["components"]["schemas"]


def test_metrics_count_requests_and_tokens(server):
    before = call(server.base, "GET", "/metrics").body
    r = call(server.base, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    after = call(server.base, "GET", "/metrics").body
    for fam in ("requests_total", "generated_tokens_total", "prompt_tokens_total", "prompt_tokens_cached_total",
                "prompt_tokens_per_second",
                "decode_tokens_per_second", "queue_depth", "kv_fill_ratio", "guard_tier", "healthy"):
        assert f"# TYPE vkflash_{fam} " in after, fam
    assert _metric(after, "vkflash_generated_tokens_total") - _metric(before, "vkflash_generated_tokens_total") == 3
    cached = r.body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert _metric(after, "vkflash_prompt_tokens_total") - _metric(before, "vkflash_prompt_tokens_total") \
        == r.body["usage"]["prompt_tokens"] - cached
    assert _metric(after, "vkflash_prompt_tokens_cached_total") - _metric(before, "vkflash_prompt_tokens_cached_total") \
        == cached
    key = 'vkflash_requests_total{path="/v1/completions",status="200"}'
    assert _metric(after, key) - _metric(before, key) == 1
    assert _metric(after, "vkflash_healthy") == 1


def test_tokenize_round_trip(server, rng):
    alphabet = list("abcdefghij fibonacci(n) -> int:\n\té€中")
    text = "".join(rng.choice(alphabet, size=int(rng.integers(1, 80)))) + "<|im_start|>"
    toks = call(server.base, "POST", "/tokenize", {"content": text}).body["tokens"]
    assert all(isinstance(t, int) for t in toks)
    assert call(server.base, "POST", "/detokenize", {"tokens": toks}).body["content"] == text
    pieces = call(server.base, "POST", "/tokenize", {"content": text, "with_pieces": True}).body["tokens"]
    assert [p["id"] for p in pieces] == toks
    bad = call(server.base, "POST", "/detokenize", {"tokens": [0, 10**6]})
    assert bad.status == 400 and bad.body["error"]["param"] == "tokens"


def test_api_key(tiny_model, tmp_path):
    import openai

    key = "k-" + "".join(np.random.default_rng().choice(list("abcdef0123456789"), size=16))
    s = start_server(tmp_path, {"MODEL": str(tiny_model), "CTX": "64", "API_KEY": key})
    try:
        assert call(s.base, "GET", "/health").status == 200  # public
        r = call(s.base, "GET", "/v1/models")
        assert r.status == 401 and r.body["error"]["code"] == "invalid_api_key"
        assert call(s.base, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}).status == 401
        assert call(s.base, "GET", "/v1/models", headers={"Authorization": f"Bearer {key}"}).status == 200
        c = openai.OpenAI(base_url=s.base + "/v1", api_key=key, max_retries=0)
        assert c.completions.create(model=c.models.list().data[0].id, prompt="hi", max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        stop_server(s)


def test_bad_knob_stops_startup(tmp_path):
    import subprocess
    import sys

    from harness import ROOT

    r = subprocess.run([sys.executable, "-m", "vkflash.server"], cwd=ROOT, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "CTX": "lots"}, timeout=60)
    assert r.returncode == 1
    assert "CTX" in r.stderr and "'lots'" in r.stderr and "integer" in r.stderr


def test_logprobs_match_the_reference(client, model_id, tiny_model, tokenizer, rng):
    """Completion logprobs of a real model = log-softmax of the reference's teacher-forced logits."""
    prompt = [int(t) for t in rng.integers(0, 400, size=int(rng.integers(3, 20)))]
    m, k = int(rng.integers(2, 8)), int(rng.integers(1, 6))
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=m, temperature=0, logprobs=k,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    fwd = ReferenceForward(load_model(tiny_model), CTX)
    z = fwd.prefill(prompt)
    for i in range(m):
        want = z.astype(np.float64) - z.max() - np.log(np.exp(z.astype(np.float64) - z.max()).sum())
        t = int(np.argmax(z))
        assert abs(lp.token_logprobs[i] - want[t]) < 1e-4, (i, lp)
        top: dict[str, float] = {}
        for j in np.argsort(-want, kind="stable")[:k]:  # alternatives that print alike keep the best
            top.setdefault(tokenizer.token_bytes(int(j), special=True).decode(errors="replace"), want[j])
        assert lp.top_logprobs[i].keys() == top.keys(), (i, lp)
        assert list(lp.top_logprobs[i].values()) == pytest.approx(list(top.values()), abs=1e-4)
        z = fwd.decode(t)


def test_structured_output_on_the_model(client, model_id, rng):
    """The tiny model's output is noise; sampled under a schema or a grammar it always complies."""
    schema = {"type": "object", "additionalProperties": False, "required": ["pick", "n"],
              "properties": {"pick": {"enum": ["fib", "range", "value"]}, "n": {"type": "integer", "minimum": -9,
                                                                               "maximum": 99}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for _ in range(2):
        r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": _words(rng, 3)}],
                                           response_format=fmt, temperature=1.0, max_tokens=48)
        obj = json.loads(r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop" and set(obj) == {"pick", "n"}
        assert obj["pick"] in ("fib", "range", "value") and isinstance(obj["n"], int) and -9 <= obj["n"] <= 99
    r = client.completions.create(model=model_id, prompt=_words(rng, 3), temperature=1.0, max_tokens=8,
                                  extra_body={"grammar": 'root ::= ("yes" | "no")'})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
