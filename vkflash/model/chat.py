"""Chat templates: sandboxed jinja2 rendering of `tokenizer.chat_template`, fixes for strict
templates (mid-conversation system messages, reasoning-effort values), and splitting model
output into `content` and `reasoning_content` (`<think>…</think>`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable, Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vkflash.errors import ConfigError

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_MARK_L, _MARK_R = "\ue000", "\ue001"  # private-use sentinels around rewritten system messages

# Qwen3-style ChatML template with tools, reasoning_content and `enable_thinking` (written for vkflash)
QWEN3_THINKING_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- if not loop.first %}{{ '<|im_start|>system\\n' + m.content + '<|im_end|>\\n' }}{% endif %}
{%- elif m.role == 'user' %}
{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content or '' %}
{%- set reasoning = m.reasoning_content or '' %}
{%- if not reasoning and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_user and reasoning %}{{ '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{% endif %}
{{- content }}
{%- for tc in m.tool_calls or [] %}
{%- set f = tc.function if tc.function is defined else tc %}
{{- ('\\n' if content or not loop.first else '') + '<tool_call>\\n{"name": "' + f.name + '", "arguments": ' }}
{{- (f.arguments if f.arguments is string else f.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}
"""


def _raise(msg: str) -> None:
    """`raise_exception` as templates call it."""
    raise TemplateError(msg)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF-style tojson: no ASCII escaping by default, indent/separators/sort_keys honoured."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str):
    """Compile a template in the immutable sandbox with the helpers real templates use."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ConfigError(f"chat template does not compile: {e}") from None


def accepted_efforts(source: str) -> list[str]:
    """Reasoning-effort values a template mentions as string literals (empty: it ignores them)."""
    if "reasoning_effort" not in source:
        return []
    return [e for e in EFFORTS if re.search(rf"['\"]{e}['\"]", source)]


def remap_effort(effort: str, source: str) -> str:
    """The accepted value nearest to effort (ties go to the higher effort); unchanged if none listed."""
    if effort not in EFFORTS:
        raise ConfigError(f"reasoning effort must be one of {'|'.join(EFFORTS)}, not {effort!r}")
    ok = accepted_efforts(source)
    if not ok or effort in ok:
        return effort
    i = EFFORTS.index(effort)
    return min(ok, key=lambda e: (abs(EFFORTS.index(e) - i), -EFFORTS.index(e)))


def reply_start(text: str, history: str, ids: Sequence[int], encode: Callable[[str], list[int]]) -> int | None:
    """How many of a chat prompt's tokens `ids` (of `text`) come before its generation prompt, given
    `history`, the same conversation rendered without one: the next turn repeats the prompt up to
    there, but not always the generation prompt (a template may drop an empty think block from past
    turns, and a reply's first characters may merge with its last token). None when the text or the
    tokens (`encode`: text → ids without BOS, special tokens parsed) do not split there cleanly."""
    if not history or len(history) >= len(text) or not text.startswith(history):
        return None
    tail = encode(text[len(history):])
    return len(ids) - len(tail) if 0 < len(tail) < len(ids) and list(ids[len(ids) - len(tail):]) == tail else None


def render_chat(source: str, messages: list[dict], *, tools: list[dict] | None = None,
                add_generation_prompt: bool = True, enable_thinking: bool | None = None,
                reasoning_effort: str | None = None, tplfix: bool = True,
                bos_token: str = "", eos_token: str = "", **extra: Any) -> str:
    """Render a chat template. With tplfix (knob TPLFIX, default on) a template that rejects
    a system message after index 0 gets it rendered in place, and reasoning_effort is remapped
    to the nearest value the template accepts; tplfix=False uses the raw template and values."""
    ctx: dict[str, Any] = dict(extra, messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token)
    if tools:
        ctx["tools"] = tools
    if reasoning_effort is not None:
        ctx["reasoning_effort"] = remap_effort(reasoning_effort, source) if tplfix else reasoning_effort
        if tplfix and reasoning_effort == "none" and enable_thinking is None and "enable_thinking" in source:
            enable_thinking = False
    if enable_thinking is not None:
        ctx["enable_thinking"] = enable_thinking
    tpl = _compile(source)
    try:
        return tpl.render(**ctx)
    except TemplateError as e:
        mid = [i for i, m in enumerate(messages) if m.get("role") == "system" and i > 0]
        if not tplfix or not mid:
            raise ConfigError(f"chat template error: {e}") from None
    return _render_mid_system(tpl, ctx, mid)


def _render_mid_system(tpl, ctx: dict[str, Any], mid: list[int]) -> str:
    """Render system messages after index 0 as user turns, then rename that turn's role word
    in the output back to `system` (ChatML, Llama-3 and similar headers print the role)."""
    msgs = [dict(m) for m in ctx["messages"]]
    for i in mid:
        msgs[i] = dict(msgs[i], role="user", content=f"{_MARK_L}{msgs[i].get('content') or ''}{_MARK_R}")
    try:
        text = tpl.render(**dict(ctx, messages=msgs))
    except TemplateError as e:
        raise ConfigError(f"chat template error (even with system messages rewritten): {e}") from None
    out, pos = [], 0
    while (a := text.find(_MARK_L, pos)) >= 0:
        b = text.find(_MARK_R, a)
        head_from = max(pos, a - 64)
        k = text.rfind("user", head_from, a)
        if k >= 0:
            out.append(text[pos:k] + "system" + text[k + 4:a])
        else:
            out.append(text[pos:a])
        out.append(text[a + 1:b])
        pos = b + 1
    out.append(text[pos:])
    return "".join(out)


def prompt_opens_think(prompt: str) -> bool:
    """True when the rendered prompt's generation prompt opens a <think> block (the prompt ends with
    `<think>` and whitespace; llama.cpp's thinking_forced_open): generation starts inside it. A
    `<think>` the conversation merely mentions, unclosed, is text."""
    return prompt.rstrip().endswith(THINK_OPEN)


def split_reasoning(text: str, in_think: bool = False) -> tuple[str, str]:
    """(content, reasoning_content) of a complete model output, split exactly as the stream splits
    it (in_think if the prompt opened <think>); only the reasoning is trimmed, so content equals
    the concatenated stream deltas."""
    p = ReasoningParser(in_think=in_think)
    r1, c1 = p.push(text)
    r2, c2 = p.flush()
    return c1 + c2, (r1 + r2).strip()


@dataclass
class ReasoningParser:
    """Streaming split of output into reasoning and content: a `<think>` block opening the
    output (or opened by the prompt) is reasoning, everything else content; tags may straddle chunks."""

    in_think: bool = False
    _state: str = field(default="start", init=False)  # start | think | content
    _buf: str = field(default="", init=False)
    _strip_lead: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.in_think:
            self._state = "think"

    def push(self, chunk: str) -> tuple[str, str]:
        """(reasoning delta, content delta) after this chunk."""
        self._buf += chunk
        reasoning, content = "", ""
        while True:
            if self._state == "think":
                k = self._buf.find(THINK_CLOSE)
                if k < 0:
                    keep = held_suffix(self._buf, (THINK_CLOSE,))
                    reasoning += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                reasoning += self._buf[:k]
                self._buf = self._buf[k + len(THINK_CLOSE):]
                self._state, self._strip_lead = "content", True
            elif self._state == "start":
                lead = self._buf.lstrip()
                if not lead or (THINK_OPEN.startswith(lead) and lead != THINK_OPEN):
                    break  # only whitespace or a partial <think> so far
                if lead.startswith(THINK_OPEN):
                    self._buf, self._state = lead[len(THINK_OPEN):], "think"
                else:
                    self._state = "content"
            else:
                if self._strip_lead:
                    self._buf = self._buf.lstrip("\n")
                    self._strip_lead = not self._buf
                content += self._buf
                self._buf = ""
                break
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """Emit what is still held back at the end of generation."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self._state == "think" else ("", rest)


def held_suffix(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some tag: what a stream must
    hold back until it knows whether a tag (</think>, <tool_call>, a stop string) begins there."""
    best = 0
    for s in tags:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
