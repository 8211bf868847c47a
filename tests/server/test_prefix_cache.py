"""Prompt reuse through the server (in this process, real sockets, the official openai client)
over the GPU forward of the tiny qwen4exp model: a multi-turn chat reports the reused prefix as
usage.prompt_tokens_details.cached_tokens and timings.cache_n, streamed and not; cache_prompt false
prefills it all; /v1/completions with token ids likewise. A chat turn keeps its state where its
generation prompt begins, so the next turn reuses it even when the history does not repeat the
generation prompt (thinking off: the empty think block is dropped) or a reply's first newline
merges with it."""

from __future__ import annotations

import pytest

from harness import wait_health, start_in_process
from scripted import openai_client

from vkflash import settings
from vkflash.engine.api import EngineInfo
from vkflash.engine.gpu_forward import GpuForward
from vkflash.engine.prefix import common_prefix
from vkflash.model.chat import render_chat
from vkflash.model.tokenizer import read_tokenizer_meta
from vkflash.server.backend import Loaded
from vkflash.server.state import ServerOptions, ServerState

pytestmark = pytest.mark.gpu
WORDS = ["def", "return", "fibonacci", "for", "in", "range", "print", "hello", "value", "n"]


def _expected(fwd: GpuForward, prompt_ends: list[int], ids: list[int]) -> int:
    """What reuse keeps of ids: the whole common prefix when it is the whole sequence, else the last
    kept prompt position (the checkpoints) at or below it."""
    c = min(common_prefix(fwd._seq, ids), len(ids) - 1)
    return c if c == fwd.n_past else max((e for e in prompt_ends if e <= c), default=0)


def test_cached_tokens_over_a_conversation(in_process, gpu, tiny_model, tokenizer, rng):
    template = read_tokenizer_meta(tiny_model)["tokenizer.chat_template"]
    fwd = GpuForward(tiny_model, ctx=512, ub=16, kv="f16", gpu=gpu, ckpt=4, ckpt_every=0)
    info = EngineInfo("tiny", str(tiny_model), "qwen4exp", "vulkan", fwd.n_ctx, fwd.n_ctx, tokenizer.vocab_size,
                      template)
    state = ServerState(settings.load(env={}), ServerOptions(queue_depth=1), lambda s: Loaded(fwd, tokenizer, info))
    p = start_in_process(state)
    in_process.append(p)
    wait_health(p.base, 200)
    client = openai_client(p.base)

    def say() -> str:
        return " ".join(rng.choice(WORDS, size=int(rng.integers(4, 10))))

    def ids_of(messages: list[dict], generation_prompt: bool = True) -> list[int]:
        text = render_chat(template, messages, add_generation_prompt=generation_prompt, enable_thinking=False)
        return tokenizer.encode(text, add_special=True, parse_special=True)

    ends: list[int] = []
    messages = [{"role": "system", "content": say()}, {"role": "user", "content": say()}]
    for turn in range(4):
        ids = ids_of(messages)
        assert ids[-4:] == tokenizer.encode("<think>\n\n</think>\n\n", parse_special=True)[-4:]  # thinking off
        want = _expected(fwd, ends, ids) if turn else 0
        body = {"ignore_eos": True, "cache_prompt": turn != 2, "chat_template_kwargs": {"enable_thinking": False}}
        if turn == 2:
            want = 0  # cache_prompt false: a cold prefill
        if turn == 3:
            r = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body=body))
            assert r[-1].usage.prompt_tokens_details.cached_tokens == want and not r[-1].choices
            timings = [c.model_extra["timings"] for c in r if c.model_extra.get("timings")]
            assert timings[-1]["cache_n"] == want and timings[-1]["prompt_n"] == len(ids) - want
            text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        else:
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                               extra_body=body)
            assert r.usage.prompt_tokens == len(ids)
            assert r.usage.prompt_tokens_details.cached_tokens == r.model_extra["timings"]["cache_n"] == want
            text = r.choices[0].message.content or ""
        if turn:
            assert want > 0 or turn == 2  # the conversation's earlier turns were kept
        ends = [] if turn == 2 else ends
        ends.append(len(ids_of(messages, generation_prompt=False)))  # where the generation prompt begins
        if turn == 0:
            text = "\n\n" + text  # a reply starting with newlines: they merge with the prompt's last token
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": say()}]

    # /v1/completions, token ids: the second prompt extends the first and restarts from its end
    V = tokenizer.vocab_size
    x = [int(t) for t in rng.integers(0, V, int(rng.integers(10, 30)))]
    for second in (False, True):
        if second:  # y's first token is not the one the reply to x began with: reuse keeps x, no more
            y = [int(t) for t in rng.integers(0, V, int(rng.integers(2, 10)))]
            y[0] = (fwd._seq[len(x)] + 1 + y[0] % (V - 1)) % V
        prompt, want = (x + y, len(x)) if second else (x, _expected(fwd, ends, x))
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens_details.cached_tokens == r.model_extra["timings"]["cache_n"] == want
        ends.append(len(prompt))


def test_checkpoint_at_is_before_the_generation_prompt(tokenizer, tiny_model):
    """The server's checkpoint position of a chat request: where its generation prompt begins; the
    prompt's end (None) when the template cannot render the conversation without one."""
    from types import SimpleNamespace

    from vkflash.server.openai_api import checkpoint_at, render
    from vkflash.server.schemas import ChatRequest

    template = read_tokenizer_meta(tiny_model)["tokenizer.chat_template"]
    req = ChatRequest(model="tiny", messages=[{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "count to three"}])
    state = SimpleNamespace(settings={"REASONING": "", "TPLFIX": 1})
    for source, want_none in ((template, False), (template + "{% if not add_generation_prompt %}"
                                                  "{{ raise_exception('no') }}{% endif %}", True)):
        loaded = SimpleNamespace(tokenizer=tokenizer, info=SimpleNamespace(chat_template=source))
        text = render(req, state, loaded, None)
        ids = tokenizer.encode(text, True, True)
        keep = checkpoint_at(req, state, loaded, None, text, ids)
        if want_none:
            assert keep is None
        else:
            history = render_chat(source, [m.model_dump(exclude_none=True) for m in req.messages],
                                  add_generation_prompt=False)
            assert keep == len(tokenizer.encode(history, True, True)) and 0 < keep < len(ids)
