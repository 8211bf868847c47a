"""Chat templates: sandboxed rendering and helpers, mid-conversation system fix (TPLFIX),
reasoning-effort remapping, and the reasoning/content split (whole and streamed)."""

import json

import numpy as np
import pytest

from vkflash.errors import ConfigError
from vkflash.model.chat import (QWEN3_THINKING_TEMPLATE, ReasoningParser, accepted_efforts,
                                prompt_opens_think, remap_effort, render_chat, reply_start, split_reasoning)

STRICT = """\
{%- for m in messages %}
{%- if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be first') }}{% endif %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if reasoning_effort is defined %}effort={{ reasoning_effort }}{% endif %}{% endif %}
{%- if reasoning_effort is defined and reasoning_effort not in ['low', 'high'] %}{{ raise_exception('bad effort') }}{% endif %}"""


def test_qwen3_template_thinking_tools_and_history():
    """Generation prompt with/without thinking, tools as JSON (non-ASCII kept), reasoning only after the last user turn."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "old thought"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "new thought"}]
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"type": "object"}}}]
    text = render_chat(QWEN3_THINKING_TEMPLATE, msgs, tools=tools, add_generation_prompt=False)
    assert "old thought" not in text and "<think>\nnew thought\n</think>\n\n6" in text
    assert json.dumps(tools[0], ensure_ascii=False) in text and "Be brief." in text
    on = render_chat(QWEN3_THINKING_TEMPLATE, msgs[:2], enable_thinking=True)
    off = render_chat(QWEN3_THINKING_TEMPLATE, msgs[:2], enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<think>\n\n</think>\n\n")
    assert not prompt_opens_think(on) and not prompt_opens_think(off)
    assert prompt_opens_think(on + "<think>\n")
    said = [{"role": "user", "content": "What does the parser do with '<think>' in model output?"}]
    mentioned = render_chat(QWEN3_THINKING_TEMPLATE, said + [{"role": "assistant", "content": "It opens <think> mode"},
                                                              {"role": "user", "content": "and then?"}])
    assert not prompt_opens_think(mentioned) and prompt_opens_think(mentioned + "<think>\n\n")


def test_reply_start_is_where_the_generation_prompt_begins():
    """The tokens before the generation prompt, or None when the text or the tokens do not split there."""
    def encode(s: str) -> list[int]:  # one token per character, but "\n\n" is one token
        return [ord(c) for c in s.replace("\n\n", "\x00")]

    msgs = [{"role": "user", "content": "hi"}]
    for thinking in (True, False):
        text = render_chat(QWEN3_THINKING_TEMPLATE, msgs, enable_thinking=thinking)
        history = render_chat(QWEN3_THINKING_TEMPLATE, msgs, add_generation_prompt=False)
        ids = encode(text)
        assert reply_start(text, history, ids, encode) == len(encode(history))
    assert reply_start(text, text, ids, encode) is None  # no generation prompt
    assert reply_start(text, "<|im_start|>system", ids, encode) is None  # not a prefix
    assert history.endswith("\n")  # and a tail that starts with one merges with it into one "\n\n" token
    assert reply_start(history + "\nx", history, encode(history + "\nx"), encode) is None


def test_helpers_and_sandbox():
    """strftime_now, tojson arguments, raise_exception; the sandbox blocks attribute escapes."""
    tpl = "{{ strftime_now('%Y') }}|{{ x | tojson(indent=2) }}|{{ y | tojson }}"
    out = render_chat(tpl, [], x={"a": [1]}, y="é")
    year, a, b = out.split("|")
    assert year.isdigit() and json.loads(a) == {"a": [1]} and "\n" in a and b == '"é"'
    with pytest.raises(ConfigError):
        render_chat("{{ raise_exception('no') }}", [])
    with pytest.raises(Exception):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])


def test_mid_conversation_system_rendered_in_place():
    """TPLFIX on: the strict template renders a later system message as a system turn in place;
    TPLFIX off: the raw template's error surfaces."""
    sys_text = "note " + str(np.random.default_rng().integers(1e9))
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "system", "content": sys_text},
            {"role": "user", "content": "u2"}]
    out = render_chat(STRICT, msgs)
    assert f"<|im_start|>assistant\na1<|im_end|>\n<|im_start|>system\n{sys_text}<|im_end|>\n<|im_start|>user\nu2" in out
    assert "\ue000" not in out and "\ue001" not in out
    with pytest.raises(ConfigError, match="System message must be first"):
        render_chat(STRICT, msgs, tplfix=False)
    assert render_chat(STRICT, msgs[:3]) == render_chat(STRICT, msgs[:3], tplfix=False)


def test_reasoning_effort_remap():
    """Efforts map to the nearest value the template lists; TPLFIX off passes them raw."""
    assert accepted_efforts(STRICT) == ["low", "high"] and accepted_efforts(QWEN3_THINKING_TEMPLATE) == []
    assert [remap_effort(e, STRICT) for e in ("none", "low", "medium", "high", "xhigh")] == \
        ["low", "low", "high", "high", "high"]
    msgs = [{"role": "user", "content": "q"}]
    assert render_chat(STRICT, msgs, reasoning_effort="xhigh").endswith("effort=high")
    with pytest.raises(ConfigError, match="bad effort"):
        render_chat(STRICT, msgs, reasoning_effort="medium", tplfix=False)
    with pytest.raises(ConfigError):
        remap_effort("max", STRICT)
    off = render_chat(QWEN3_THINKING_TEMPLATE, msgs, reasoning_effort="none")
    assert off.endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("in_think", [False, True])
def test_reasoning_split_whole_and_streamed(in_think):
    """Any chunking of the output gives the same (content, reasoning) as the whole text: content is
    exactly the concatenated stream deltas (the non-streamed answer must equal the streamed one)."""
    rng = np.random.default_rng()
    reasoning = "Let me think: 2 < 3 and <b> is a tag " + str(rng.integers(1e6))
    content = "The answer is 42 </thinking> ok"
    text = ("" if in_think else "<think>\n") + reasoning + "\n</think>\n\n" + content
    assert split_reasoning(text, in_think=in_think) == (content, reasoning)
    for _ in range(20):
        cuts = sorted(rng.choice(len(text), int(rng.integers(1, 12)), replace=False))
        p, r, c = ReasoningParser(in_think=in_think), "", ""
        for piece in np.split(np.array(list(text)), cuts):
            dr, dc = p.push("".join(piece))
            r, c = r + dr, c + dc
        dr, dc = p.flush()
        assert (c + dc, (r + dr).strip()) == (content, reasoning)
    assert split_reasoning("plain answer <think> not reasoning ") == ("plain answer <think> not reasoning ", "")
    assert split_reasoning("<think>unfinished", in_think=False) == ("", "unfinished")
