"""Tool calls: the `<tool_call>` parser over any chunking (streamed = whole), invalid and unclosed
blocks, and the server turning scripted output into OpenAI tool_calls, streamed and not."""

from __future__ import annotations

import json

import pytest

from harness import call
from scripted import ScriptedForward, openai_client, serve_scripted

from vkflash.server.tools import CLOSE, OPEN, ToolCallParser, split_tool_calls

WORDS = ["check", "the", "weather", "in", "Paris", "ok", "first", "é€", "{", "}", "<", ">", "tool"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _text(rng, lo=0, hi=6) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi))))


def _args(rng) -> dict:
    keys = ["city", "days", "units", "nested", "ünï"]
    out = {}
    for k in rng.choice(keys, size=int(rng.integers(0, 4)), replace=False):
        v = rng.integers(0, 3)
        out[str(k)] = _text(rng, 1, 4) if v == 0 else int(rng.integers(-99, 99)) if v == 1 else {"x": [1, _text(rng, 1, 3)]}
    return out


def _block(name: str, args: dict, rng) -> str:
    sep = ["", "\n", " "][int(rng.integers(0, 3))]
    return f"{OPEN}{sep}{json.dumps({'name': name, 'arguments': args}, ensure_ascii=bool(rng.integers(0, 2)))}{sep}{CLOSE}"


def _output(rng) -> tuple[str, str, list[tuple[str, dict]]]:
    """A model output of optional text, 0-3 calls and optional trailing text; its expected split."""
    head, tail = _text(rng), _text(rng)
    calls = [(f"fn_{int(rng.integers(0, 100))}", _args(rng)) for _ in range(int(rng.integers(0, 4)))]
    if not calls:
        return head + tail, head + tail, []
    body = "\n".join(_block(n, a, rng) for n, a in calls)
    return f"{head}\n{body}\n{tail}", head.rstrip() + tail.lstrip(), calls


def _chunked(text: str, rng) -> tuple[str, list]:
    cuts = sorted(set(int(c) for c in rng.integers(0, len(text) + 1, size=int(rng.integers(0, len(text) + 1)))))
    p, content, calls = ToolCallParser(), "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        c, k = p.push(text[a:b])
        content, calls = content + c, calls + k
    c, k = p.flush()
    return content + c, calls + k


def test_parser_splits_calls_from_content_under_any_chunking(rng):
    for _ in range(200):
        text, want_content, want_calls = _output(rng)
        content, calls = split_tool_calls(text)
        assert content == want_content, text
        assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls, text
        assert len({c.id for c in calls}) == len(calls)
        streamed, scalls = _chunked(text, rng)
        assert streamed == content and [(c.name, c.arguments) for c in scalls] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("body", ["not json", '{"arguments": {}}', '["get_weather"]', '{"name": 3}'])
def test_invalid_blocks_stay_content(rng, body):
    text = f"{_text(rng, 1)} {OPEN}{body}{CLOSE}"
    content, calls = split_tool_calls(text)
    assert calls == [] and content.endswith(f"{OPEN}{body}{CLOSE}")
    assert _chunked(text, rng)[0] == content


def test_unclosed_blocks(rng):
    args = _args(rng)
    complete = f"{OPEN}\n{json.dumps({'name': 'f', 'arguments': args})}\n"
    content, calls = split_tool_calls(complete)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", args)]
    cut = complete[: int(rng.integers(len(OPEN) + 2, len(complete) - 2))]
    assert split_tool_calls(cut) == (cut, [])
    partial_tag = _text(rng, 1) + OPEN[: int(rng.integers(1, len(OPEN)))]
    assert split_tool_calls(partial_tag) == (partial_tag, [])


def test_string_arguments_pass_through():
    content, calls = split_tool_calls(f'{OPEN}{{"name": "f", "arguments": "{{\\"a\\": 1}}"}}{CLOSE}')
    assert content == "" and calls[0].arguments == '{"a": 1}'


def test_lone_surrogate_arguments_encode_as_utf8():
    """A model-written "\\ud83d" (a lone surrogate once parsed) is spelled as that escape again, in
    object and string arguments alike, and other non-ASCII text stays readable."""
    for args in ('{"s": "\\ud83d é"}', '"{\\"s\\": \\"\\ud83d é\\"}"'):
        _, calls = split_tool_calls(f'{OPEN}{{"name": "f", "arguments": {args}}}{CLOSE}')
        assert json.loads(calls[0].arguments.encode("utf-8")) == {"s": "\ud83d é"} and "é" in calls[0].arguments


MSGS = [{"role": "user", "content": "weather in Paris?"}]


def _serve_output(in_process, tiny_model, tokenizer, text: str) -> str:
    fwd = ScriptedForward(tokenizer.encode(text, parse_special=True), tokenizer.eos_id, tokenizer.vocab_size, 512)
    return serve_scripted(in_process, tiny_model, tokenizer, fwd)


def test_server_returns_tool_calls(in_process, tiny_model, tokenizer, rng):
    head = _text(rng, 0, 4)
    calls = [("get_weather", {"city": _text(rng, 1, 3)}) for _ in range(int(rng.integers(1, 3)))]
    text = head + "\n" + "\n".join(_block(n, a, rng) for n, a in calls)
    base = _serve_output(in_process, tiny_model, tokenizer, text)
    c = openai_client(base)
    r = c.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == (head.strip() or None)
    got = [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls]
    assert got == calls and all(t.type == "function" and t.id.startswith("call_") for t in ch.message.tool_calls)

    content, finish, acc = "", None, {}
    for chunk in c.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, temperature=0, stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for t in d.tool_calls or []:
            slot = acc.setdefault(t.index, {"name": "", "arguments": ""})
            slot["name"] += t.function.name or ""
            slot["arguments"] += t.function.arguments or ""
    assert finish == "tool_calls" and content == head.strip()
    assert [(acc[i]["name"], json.loads(acc[i]["arguments"])) for i in sorted(acc)] == calls

    for body in ({"messages": MSGS, "temperature": 0},
                 {"messages": MSGS, "temperature": 0, "tools": TOOLS, "tool_choice": "none"}):
        raw = call(base, "POST", "/v1/chat/completions", body).body["choices"][0]
        assert raw["finish_reason"] == "stop" and OPEN in raw["message"]["content"]
        assert "tool_calls" not in raw["message"]


def test_server_answers_a_lone_surrogate_in_arguments(in_process, tiny_model, tokenizer):
    """A call whose arguments hold a lone surrogate is a 200 and the same JSON value, streamed and not
    (its reply failed to encode: a 500, and a stream cut before [DONE])."""
    output = OPEN + '\n{"name":"f","arguments":{"s":"\\ud83d"}}\n' + CLOSE
    base = _serve_output(in_process, tiny_model, tokenizer, output)
    c = openai_client(base)
    r = c.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, temperature=0)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"s": "\ud83d"}
    chunks = list(c.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, temperature=0, stream=True))
    args = "".join(t.function.arguments or "" for ch in chunks for t in ch.choices[0].delta.tool_calls or [])
    assert json.loads(args) == {"s": "\ud83d"} and chunks[-1].choices[0].finish_reason == "tool_calls"
