"""The server over scripted forwards (in this process, real sockets): reasoning_content splitting,
stop strings, and a device lost mid-generation turning /health unhealthy for good."""

from __future__ import annotations

import threading

import pytest

from harness import call, start_in_process, wait_health
from scripted import ScriptedForward, openai_client, serve_scripted

from vkflash import settings
from vkflash.engine.api import EngineInfo
from vkflash.model.tokenizer import read_tokenizer_meta
from vkflash.server.backend import Loaded
from vkflash.server.state import ServerOptions, ServerState

OPENS_THINK = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def _serve(in_process, tiny_model, tokenizer, output: str, template: str | None = None, lose_at: int | None = None):
    fwd = ScriptedForward(tokenizer.encode(output, parse_special=True), tokenizer.eos_id, tokenizer.vocab_size, 256,
                          lose_at)
    return serve_scripted(in_process, tiny_model, tokenizer, fwd, template)


_client = openai_client


MSGS = [{"role": "user", "content": "why?"}]


@pytest.mark.parametrize("prompt_opens_think", [False, True])
def test_reasoning_content_split(in_process, tiny_model, tokenizer, rng, prompt_opens_think):
    words = ["alpha", "beta", "fib", "range", "value"]
    thought = " ".join(rng.choice(words, size=int(rng.integers(1, 6))))
    answer = " ".join(rng.choice(words, size=int(rng.integers(1, 6))))
    out = f"{thought}\n</think>\n\n{answer}" if prompt_opens_think else f"<think>\n{thought}\n</think>\n\n{answer}"
    base = _serve(in_process, tiny_model, tokenizer, out, OPENS_THINK if prompt_opens_think else None)
    c = _client(base)
    r = c.chat.completions.create(model="scripted", messages=MSGS, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == answer
    assert r.choices[0].message.reasoning_content == thought
    chunks = [ch for ch in c.chat.completions.create(model="scripted", messages=MSGS, temperature=0, stream=True)
              if ch.choices]
    reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert reasoning.strip() == thought and content == answer
    raw = call(base, "POST", "/v1/chat/completions", {"messages": MSGS, "temperature": 0, "reasoning_format": "none"})
    assert raw.body["choices"][0]["message"]["content"] == out and "reasoning_content" not in raw.body["choices"][0]["message"]


def test_stop_strings_through_the_server(in_process, tiny_model, tokenizer, rng):
    text = "def fibonacci(n): return n for i in range(10)"
    base = _serve(in_process, tiny_model, tokenizer, text)
    a = int(rng.integers(1, len(text) - 4))
    stop = text[a:a + int(rng.integers(1, 4))]
    r = call(base, "POST", "/v1/completions", {"prompt": "x", "temperature": 0, "stop": [stop]})
    assert r.body["choices"][0] == {"index": 0, "text": text[:text.find(stop)], "finish_reason": "stop",
                                    "logprobs": None}
    streamed = "".join(ch.choices[0].text for ch in _client(base).completions.create(
        model="scripted", prompt="x", temperature=0, stop=stop, stream=True))
    assert streamed == text[:text.find(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_lost_device_makes_the_server_unhealthy(in_process, tiny_model, tokenizer, stream):
    base = _serve(in_process, tiny_model, tokenizer, "value range fib alpha beta", lose_at=3)
    assert call(base, "GET", "/health").status == 200
    r = call(base, "POST", "/v1/chat/completions", {"messages": MSGS, "temperature": 0, "stream": stream})
    if stream:
        assert r.status == 200 and "VK_ERROR_DEVICE_LOST" in r.body and r.body.rstrip().endswith("data: [DONE]")
    else:
        assert r.status == 503 and "VK_ERROR_DEVICE_LOST" in r.body["error"]["message"]
    h = call(base, "GET", "/health")
    assert h.status == 503 and h.body["status"] == "failed" and "device lost" in h.body["error"]["message"]
    again = call(base, "POST", "/v1/chat/completions", {"messages": MSGS})
    assert again.status == 503 and "device lost" in again.body["error"]["message"]
    assert "vkflash_healthy 0" in call(base, "GET", "/metrics").body


def test_loading_is_503_then_ready(in_process, tiny_model, tokenizer):
    release = threading.Event()
    fwd = ScriptedForward(tokenizer.encode("fib"), tokenizer.eos_id, tokenizer.vocab_size, 64)
    info = EngineInfo("slow", str(tiny_model), "qwen4exp", "scripted", 64, 64, tokenizer.vocab_size,
                      read_tokenizer_meta(tiny_model)["tokenizer.chat_template"])

    def slow_loader(_s):
        release.wait(30)
        return Loaded(fwd, tokenizer, info)

    p = start_in_process(ServerState(settings.load(env={}), ServerOptions(), slow_loader))
    in_process.append(p)
    h = call(p.base, "GET", "/health")
    assert h.status == 503 and h.body["status"] == "loading"
    r = call(p.base, "POST", "/v1/chat/completions", {"messages": MSGS})
    assert r.status == 503 and r.body["error"]["code"] == "loading" and r.headers.get("retry-after")
    release.set()
    wait_health(p.base, 200, timeout=10)
    r = call(p.base, "POST", "/v1/chat/completions", {"messages": MSGS, "temperature": 0})
    assert r.body["choices"][0]["message"]["content"] == "fib"


def test_speculation_timings_and_metrics(in_process, tiny_model, tokenizer):
    """A speculative forward: responses carry timings.draft_n / draft_n_accepted (streamed too), and
    /metrics the drafted and accepted totals and their ratio."""
    from scripted import SpeculativeScripted

    fwd = SpeculativeScripted(tokenizer.encode("alpha beta fib range value"), tokenizer.eos_id,
                              tokenizer.vocab_size, 256)
    base = serve_scripted(in_process, tiny_model, tokenizer, fwd)
    r = call(base, "POST", "/v1/chat/completions", {"messages": MSGS, "temperature": 0})
    t = r.body["timings"]
    assert r.body["choices"][0]["message"]["content"] == "alpha beta fib range value"
    assert t["draft_n"] == fwd.drafted > 0 and t["draft_n_accepted"] == fwd.accepted > 0
    s = call(base, "POST", "/v1/completions", {"prompt": "x", "temperature": 0, "stream": True}).body
    last = [line for line in s.splitlines() if '"timings"' in line][-1]
    assert '"draft_n"' in last and '"draft_n_accepted"' in last
    m = call(base, "GET", "/metrics").body
    sample = {line.split()[0]: line.split()[1] for line in m.splitlines() if not line.startswith("#")}
    drafted, accepted = float(sample["vkflash_draft_tokens_total"]), float(sample["vkflash_draft_accepted_total"])
    assert drafted >= 2 * t["draft_n"] and 0 < accepted < drafted
    assert float(sample["vkflash_draft_acceptance_ratio"]) == pytest.approx(accepted / drafted)
    assert float(sample["llamacpp:spec_decode_num_draft_tokens_total"]) == drafted
