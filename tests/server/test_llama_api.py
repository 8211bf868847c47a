"""llama-server parity over scripted forwards (in this process, real sockets): structured output
(json_schema / response_format / GBNF / forced tool calls) on random logits, /infill's FIM layout,
/apply-template, /tokenize's parse_special and pieces, /props, /slots, /v1/health, seed and
repeat_last_n -1, the llamacpp:* metrics and SSE keep-alive comments during a long prefill."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from harness import call
from scripted import ScriptedForward, openai_client, serve_scripted

from vkflash.model.chat import render_chat
from vkflash.model.tokenizer import Tokenizer, read_tokenizer_meta

MSGS = [{"role": "user", "content": "pick one"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "n"],
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 999}}}


class RandomForward(ScriptedForward):
    """Logits drawn at random for every position (a model whose output is noise); records the
    prompt of the last prefill; optionally slow to prefill."""

    def __init__(self, V: int, n_ctx: int, rng: np.random.Generator, prefill_s: float = 0.0) -> None:
        super().__init__([], 0, V, n_ctx)
        self.rng, self.prefill_s = rng, prefill_s
        self.prompt: list[int] = []

    def _next(self) -> np.ndarray:
        return self.rng.normal(0.0, 3.0, self.n_vocab).astype(np.float32)

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        time.sleep(self.prefill_s)
        self.prompt = list(ids)
        return super().prefill(ids)


def _serve_random(in_process, tiny_model, tokenizer, rng, n_ctx: int = 2048, **kw) -> tuple[str, RandomForward]:
    env = kw.pop("env", None)
    fwd = RandomForward(tokenizer.vocab_size, n_ctx, rng, **kw)
    return serve_scripted(in_process, tiny_model, tokenizer, fwd, env=env), fwd


def _check(obj: object) -> None:
    """obj matches SCHEMA."""
    assert isinstance(obj, dict) and set(obj) == {"color", "n"}, obj
    assert obj["color"] in ("red", "green", "blue") and isinstance(obj["n"], int) and 0 <= obj["n"] <= 999, obj


def test_json_schema_output_always_validates(in_process, tiny_model, tokenizer, rng):
    """Random logits, sampled: every output is JSON matching the schema, through each way to ask."""
    base, _ = _serve_random(in_process, tiny_model, tokenizer, rng)
    c = openai_client(base)
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    end = time.monotonic() + 20
    for i in range(6):
        r = c.chat.completions.create(model="scripted", messages=MSGS, temperature=1.0, max_tokens=64,
                                      response_format=fmt, seed=int(rng.integers(0, 2**31)))
        assert r.choices[0].finish_reason == "stop"
        _check(json.loads(r.choices[0].message.content))
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="scripted", messages=MSGS, temperature=1.0, max_tokens=64, response_format=fmt, stream=True)
            if ch.choices)
        _check(json.loads(streamed))
        raw = call(base, "POST", "/v1/completions", {"prompt": "x", "temperature": 1.0, "max_tokens": 64,
                                                     "json_schema": SCHEMA})
        _check(json.loads(raw.body["choices"][0]["text"]))
        if time.monotonic() > end:
            break
    obj = c.chat.completions.create(model="scripted", messages=MSGS, temperature=1.0, max_tokens=64,
                                    response_format={"type": "json_object", "schema": SCHEMA})  # llama-server's form
    _check(json.loads(obj.choices[0].message.content))


def test_gbnf_grammar_yields_one_of_its_words(in_process, tiny_model, tokenizer, rng):
    base, _ = _serve_random(in_process, tiny_model, tokenizer, rng)
    words = ["yes", "no"] + [str(w) for w in rng.choice(["maybe", "fib", "range"], size=1)]
    grammar = "root ::= (" + " | ".join(f'"{w}"' for w in words) + ")"
    for _ in range(5):
        r = call(base, "POST", "/v1/completions", {"prompt": "x", "temperature": 1.0, "max_tokens": 16,
                                                   "grammar": grammar})
        assert r.status == 200 and r.body["choices"][0]["text"] in words, r.body
        assert r.body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body,param", [
    ({"grammar": 'root ::= ("yes" | '}, "grammar"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"json_schema": {"type": "frob"}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "integer"}}, "json_schema"),
])
def test_invalid_schema_or_grammar_is_400(in_process, tiny_model, tokenizer, rng, body, param):
    base, _ = _serve_random(in_process, tiny_model, tokenizer, rng)
    for path, req in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MSGS})):
        r = call(base, "POST", path, {**req, **body, "max_tokens": 4})
        assert r.status == 400 and r.body["error"]["param"] == param, r.body
    assert call(base, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}).status == 200


def test_forced_tool_call_matches_the_tool_schema(in_process, tiny_model, tokenizer, rng):
    base, _ = _serve_random(in_process, tiny_model, tokenizer, rng)
    tools = [{"type": "function", "function": {"name": "pick", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "other", "parameters": {
                 "type": "object", "properties": {"q": {"type": "boolean"}}, "required": ["q"],
                 "additionalProperties": False}}}]
    c = openai_client(base)
    r = c.chat.completions.create(model="scripted", messages=MSGS, tools=tools, temperature=1.0, max_tokens=96,
                                  tool_choice={"type": "function", "function": {"name": "pick"}})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "pick"
    _check(json.loads(calls[0].function.arguments))
    r = c.chat.completions.create(model="scripted", messages=MSGS, tools=tools, temperature=1.0, max_tokens=200,
                                  tool_choice="required")
    calls = r.choices[0].message.tool_calls or []
    assert calls and all(x.function.name in ("pick", "other") for x in calls), r
    bad = call(base, "POST", "/v1/chat/completions", {"messages": MSGS, "tools": tools,
                                                      "tool_choice": {"type": "function", "function": {"name": "x"}}})
    assert bad.status == 400 and bad.body["error"]["param"] == "tool_choice"


def test_grammar_after_reasoning_when_the_prompt_opens_think(in_process, tiny_model, tokenizer, rng):
    """A prompt that opened <think>: free reasoning, then the grammar; the content is what it matched."""
    opens = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "<|im_start|>assistant\n<think>\n")
    think = tokenizer.encode("</think>", parse_special=True)[0]

    class Thinks(RandomForward):
        """Closes its reasoning after a few tokens: the pull to </think> grows by 2 a step (a fixed +4
        left it open all 96 tokens in ~4% of runs on the tiny vocabulary, an empty content)."""

        steps = 0

        def _next(self) -> np.ndarray:
            z = super()._next()
            self.steps += 1
            z[think] += 2.0 * self.steps
            return z

    fwd = Thinks(tokenizer.vocab_size, 512, rng)
    base = serve_scripted(in_process, tiny_model, tokenizer, fwd, opens)
    r = call(base, "POST", "/v1/chat/completions", {"messages": MSGS, "temperature": 1.0, "max_tokens": 96,
                                                    "grammar": 'root ::= ("yes" | "no")'})
    msg = r.body["choices"][0]["message"]
    assert r.status == 200 and msg["content"].lstrip() in ("yes", "no"), r.body
    assert len(msg["content"]) - len(msg["content"].lstrip()) <= 4  # what separates it from </think>, bounded


def _no_fim_tokenizer(tiny_model) -> Tokenizer:
    """The tiny tokenizer with its FIM tokens renamed away."""
    meta = dict(read_tokenizer_meta(tiny_model))
    meta["tokenizer.ggml.tokens"] = [t.replace("fim", "xim") for t in meta["tokenizer.ggml.tokens"]]
    return Tokenizer.from_fields(meta)


def test_infill_lays_out_the_fim_prompt(in_process, tiny_model, tokenizer, rng):
    """The repo-level FIM layout; the context (8192) leaves room for the extra files past one batch (2048)."""
    base, fwd = _serve_random(in_process, tiny_model, tokenizer, rng, n_ctx=8192)
    words = ["def", "fib", "(n)", ":", "return", "x", "\n", "    "]
    prefix, suffix, prompt = ("".join(rng.choice(words, size=int(rng.integers(1, 12)))) for _ in range(3))
    extra = [{"filename": f"f{i}.py", "text": "".join(rng.choice(words, size=4))}
             for i in range(int(rng.integers(0, 3)))]
    n = int(rng.integers(1, 6))
    r = call(base, "POST", "/infill", {"input_prefix": prefix, "input_suffix": suffix, "prompt": prompt,
                                       "input_extra": extra, "n_predict": n, "temperature": 0, "ignore_eos": True})
    assert r.status == 200, r.body
    ids = {t: tokenizer.encode(t, parse_special=True)[0] for t in
           ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>")}

    def enc(s: str) -> list[int]:
        return tokenizer.encode(s, parse_special=False)

    want = [ids["<|repo_name|>"], *enc("myproject\n")]
    for e in extra:
        want += [ids["<|file_sep|>"], *enc(e["filename"] + "\n"), *enc(e["text"])]
    want += [ids["<|file_sep|>"], *enc("filename\n"), ids["<|fim_prefix|>"], *enc(prefix), *enc(prompt),
             ids["<|fim_suffix|>"], *enc(suffix), ids["<|fim_middle|>"]]
    assert fwd.prompt == want
    b = r.body
    assert b["stop"] is True and b["tokens_predicted"] == n and b["stop_type"] == "limit"
    assert b["tokens_evaluated"] == len(want) and b["timings"]["predicted_n"] == n
    stream = call(base, "POST", "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": n,
                                            "temperature": 0, "ignore_eos": True, "stream": True}).body
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ")]
    assert [e["stop"] for e in events][-1] is True and not any(e["stop"] for e in events[:-1])
    assert events[-1]["tokens_predicted"] == n


def test_infill_without_fim_tokens_is_400(in_process, tiny_model, rng):
    tok = _no_fim_tokenizer(tiny_model)
    fwd = RandomForward(tok.vocab_size, 256, rng)
    base = serve_scripted(in_process, tiny_model, tok, fwd)
    r = call(base, "POST", "/infill", {"input_prefix": "def f(", "input_suffix": ")"})
    assert r.status == 400 and "<|fim_prefix|>" in r.body["error"]["message"]
    assert call(base, "GET", "/props").body["infill"] is False


def test_apply_template_tokenize_props_health(in_process, tiny_model, tokenizer, rng):
    base, _ = _serve_random(in_process, tiny_model, tokenizer, rng, env={"TEMP": "0.55"})
    tpl = read_tokenizer_meta(tiny_model)["tokenizer.chat_template"]
    msgs = [{"role": "system", "content": "brief"},
            {"role": "user", "content": " ".join(rng.choice(["fib", "range", "hello"], size=3))}]
    r = call(base, "POST", "/apply-template", {"messages": msgs})
    assert r.body == {"prompt": render_chat(tpl, msgs)}
    text = "".join(rng.choice(list("abc fib(n)"), size=int(rng.integers(1, 20)))) + "<|im_start|>ж"
    special = tokenizer.encode("<|im_start|>", parse_special=True)[0]
    parsed = call(base, "POST", "/tokenize", {"content": text}).body["tokens"]
    plain = call(base, "POST", "/tokenize", {"content": text, "parse_special": False}).body["tokens"]
    assert special in parsed and special not in plain
    assert plain == tokenizer.encode(text, parse_special=False)
    pieces = call(base, "POST", "/tokenize", {"content": text, "with_pieces": True}).body["tokens"]
    assert [p["id"] for p in pieces] == parsed
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces) \
        == text.encode()
    assert any(isinstance(p["piece"], list) for p in pieces)  # "ж" is two byte tokens, neither valid UTF-8 alone
    props = call(base, "GET", "/props").body
    dgs = props["default_generation_settings"]
    assert dgs["n_ctx"] == 2048 and dgs["params"]["temperature"] == 0.55 and props["total_slots"] == 1
    assert props["chat_template"] == tpl and props["model_path"] == str(tiny_model) and props["infill"] is True
    caps = props["chat_template_caps"]
    assert caps["supports_system_role"] and caps["supports_tools"] and caps["supports_tool_calls"]
    assert props["build_info"].startswith("vkflash")
    assert call(base, "GET", "/v1/health").body == call(base, "GET", "/health").body == {"status": "ok"}


def test_slots_show_the_running_job(in_process, tiny_model, tokenizer, rng):
    base, fwd = _serve_random(in_process, tiny_model, tokenizer, rng)
    fwd.prefill_s = 1.0
    idle = call(base, "GET", "/slots").body
    assert idle[0]["id"] == 0 and idle[0]["is_processing"] is False and idle[0]["n_ctx"] == 2048
    temp, n = float(np.round(rng.uniform(0.1, 1.5), 2)), int(rng.integers(2, 9))
    t = threading.Thread(target=call, args=(base, "POST", "/v1/completions",
                                            {"prompt": "x", "temperature": temp, "max_tokens": n, "ignore_eos": True}))
    t.start()
    end = time.monotonic() + 10
    while not (busy := call(base, "GET", "/slots").body)[0]["is_processing"] and time.monotonic() < end:
        time.sleep(0.02)
    assert busy[0]["params"]["temperature"] == temp and busy[0]["params"]["n_predict"] == n
    assert call(base, "GET", "/slots?fail_on_no_slot=1").status == 503
    t.join()
    while call(base, "GET", "/slots").body[0]["is_processing"] and time.monotonic() < end:
        time.sleep(0.02)
    assert call(base, "GET", "/slots").body[0]["is_processing"] is False


def test_minus_one_seed_and_repeat_last_n(in_process, tiny_model, tokenizer, rng):
    """llama-server's -1 values (they were a 400): `seed` -1 is random (no seed), `repeat_last_n` -1
    penalizes over the whole context; other negative values stay a 400."""
    n_ctx = 256
    a, b = (tokenizer.encode(w)[0] for w in rng.choice(["fib", "range", "print", "value"], size=2, replace=False))
    base = serve_scripted(in_process, tiny_model, tokenizer,
                          ScriptedForward([a], tokenizer.eos_id, tokenizer.vocab_size, n_ctx))
    # the scripted token a lies 80 tokens back: out of the default window (64), within the context
    body = {"prompt": [a] + [b] * 80, "max_tokens": 1, "temperature": 0, "presence_penalty": 2.0}
    text = {n: call(base, "POST", "/v1/completions", {**body, "repeat_last_n": n}).body["choices"][0]["text"]
            for n in (64, n_ctx, -1)}
    assert text[64] == tokenizer.decode([a]) and text[-1] == text[n_ctx] != text[64]
    r = call(base, "POST", "/infill", {"input_prefix": "def f(", "n_predict": 1, "seed": -1, "repeat_last_n": -1})
    assert r.status == 200, r.body
    assert r.body["generation_settings"]["seed"] == 0xFFFFFFFF  # llama-server's "no seed"
    assert r.body["generation_settings"]["repeat_last_n"] == n_ctx
    for field in ("seed", "repeat_last_n"):
        r = call(base, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, field: -2})
        assert r.status == 400 and r.body["error"]["code"] == "invalid_value", r.body


def test_llamacpp_metrics(in_process, tiny_model, tokenizer, rng):
    from prometheus_client.parser import text_string_to_metric_families

    base, _ = _serve_random(in_process, tiny_model, tokenizer, rng)

    def sample() -> dict[str, float]:
        text = call(base, "GET", "/metrics").body
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}

    before = sample()
    n = int(rng.integers(2, 9))
    r = call(base, "POST", "/v1/completions", {"prompt": "fib range", "max_tokens": n, "ignore_eos": True})
    after = sample()
    p = r.body["usage"]["prompt_tokens"]
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == p
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == n
    assert after["llamacpp:n_decode_total"] - before["llamacpp:n_decode_total"] == 1 + (n - 1)
    assert after["llamacpp:n_tokens_max"] >= p + n
    assert after["llamacpp:prompt_tokens_seconds"] > 0 and after["llamacpp:predicted_tokens_seconds"] > 0
    assert after["llamacpp:requests_processing"] == 0 and after["llamacpp:requests_deferred"] == 0
    assert after["llamacpp:kv_cache_tokens"] == p + n - 1
    assert after["llamacpp:kv_cache_usage_ratio"] == pytest.approx((p + n - 1) / 2048)
    assert after["vkflash_generated_tokens_total"] == after["llamacpp:tokens_predicted_total"]


def _raw_sse(base: str, path: str, body: dict) -> list[tuple[float, str]]:
    """(arrival time, raw event text) of every SSE event, comments included."""
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    out, buf = [], b""
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                  + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        while data := s.recv(65536):
            buf += data
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                out.append((time.monotonic(), ev.decode().split("\r\n")[-1]))
    return out


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": MSGS}),
                                       ("/v1/completions", {"prompt": "x"})])
def test_keepalive_comments_during_a_long_prefill(in_process, tiny_model, tokenizer, rng, path, body):
    every = 0.1
    base, _ = _serve_random(in_process, tiny_model, tokenizer, rng, prefill_s=0.8, env={"SSE_KEEPALIVE": str(every)})
    events = _raw_sse(base, path, {**body, "max_tokens": 3, "stream": True, "ignore_eos": True})
    comments = [e for _, e in events if e.startswith(":")]
    # the prefill takes 8 intervals and decoding is instant: the comments are the prefill's
    assert len(comments) >= 3 and all(e == ": keep-alive" for e in comments), events
    assert events[-1][1] == "data: [DONE]"
    c = openai_client(base)  # the official client skips the comments
    if path == "/v1/completions":
        chunks = list(c.completions.create(model="scripted", prompt="x", max_tokens=3, stream=True,
                                           extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        chunks = list(c.chat.completions.create(model="scripted", messages=MSGS, max_tokens=3, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
