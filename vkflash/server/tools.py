"""Qwen-style tool calls: `<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks in the
model's content become OpenAI `tool_calls`; the rest stays content.

One streaming parser serves both paths (the non-streamed answer is the parser run over the whole
text), so streamed deltas always concatenate to the non-streamed message. Whitespace that only
separates content from a call is dropped; a block whose body is not a JSON object with a string
`name` is left in the content as written (the model did not make a valid call).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from vkflash.model.chat import held_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: a fresh id, the function name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI object; with an index it is a streamed `delta.tool_calls` entry."""
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def parse_call(body: str) -> ToolCall | None:
    """The call a block body holds, or None if it is not `{"name": str, "arguments": …}` JSON."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], utf8_safe(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))


def utf8_safe(text: str) -> str:
    """JSON text with each lone surrogate (the model wrote "\\ud83d") spelled as that escape again:
    the same JSON value, non-ASCII kept readable, and no UTF-8 reply that fails to encode."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class ToolCallParser:
    """Streaming split of content into text and tool calls; tags may straddle chunks."""

    _buf: str = field(default="", init=False)
    _in_call: bool = field(default=False, init=False)
    _strip_lead: bool = field(default=False, init=False)  # just after a call: drop leading whitespace

    def push(self, chunk: str) -> tuple[str, list[ToolCall]]:
        """(content delta, calls completed) after this chunk."""
        self._buf += chunk
        out, calls = "", []
        while True:
            if self._in_call:
                k = self._buf.find(CLOSE)
                if k < 0:
                    break
                body, self._buf, self._in_call = self._buf[:k], self._buf[k + len(CLOSE):], False
                call = parse_call(body)
                if call is None:
                    out += OPEN + body + CLOSE
                else:
                    calls.append(call)
                    self._strip_lead = True
                continue
            if self._strip_lead:
                self._buf = self._buf.lstrip()
                self._strip_lead = not self._buf
            k = self._buf.find(OPEN)
            if k >= 0:
                out += self._buf[:k].rstrip()
                self._buf, self._in_call = self._buf[k + len(OPEN):], True
                continue
            keep = held_suffix(self._buf, (OPEN,))
            head = self._buf[: len(self._buf) - keep]
            text = head.rstrip()  # trailing whitespace waits: it may only separate content from a call
            out += text
            self._buf = self._buf[len(text):]
            break
        return out, calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """At the end of output: held text; an unclosed block is a call if its body is complete."""
        rest, self._buf = self._buf, ""
        if not self._in_call:
            return rest, []
        call = parse_call(rest)
        return ("", [call]) if call is not None else (OPEN + rest, [])


def split_tool_calls(content: str) -> tuple[str, list[ToolCall]]:
    """(content without the calls, calls) of a whole output, exactly as the stream splits it."""
    p = ToolCallParser()
    c1, calls = p.push(content)
    c2, more = p.flush()
    return c1 + c2, calls + more
