"""Structured output: a request's `response_format` (json_object / json_schema), llama-server's
`grammar` (GBNF) and `json_schema` fields, and a forced tool call (tool_choice "required" or a named
function) become one llguidance grammar the output must match (vkflash.engine.grammar).

A chat whose prompt opened `<think>` keeps its reasoning: the grammar then starts after `</think>`.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from vkflash.engine.api import InvalidRequest
from vkflash.engine.grammar import Grammar
from vkflash.model.tokenizer import NORMAL, Tokenizer
from vkflash.server.errors import ApiError
from vkflash.server.schemas import SamplingFields
from vkflash.server.tools import CLOSE, OPEN

# reasoning text up to the first </think> (llguidance regex: anything, and not containing it)
_REASON = r'REASON: /(?s:.*)/ & ~/(?s:.*)<\/think>(?s:.*)/'


@functools.lru_cache(maxsize=4)
def special_ids(tok: Tokenizer) -> dict[str, int]:
    """Text → id of the vocabulary's special (control / user-defined) tokens, lowest id first."""
    out: dict[str, int] = {}
    for i, (t, ty) in enumerate(zip(tok.tokens, tok.types)):
        if ty != NORMAL:
            out.setdefault(t, i)
    return out


def _lit(tok: Tokenizer, text: str) -> str:
    """A Lark terminal for `text`: the special token where the vocabulary has one, else the string."""
    return text if text in special_ids(tok) and " " not in text else json.dumps(text)


def _schema_source(req: SamplingFields) -> tuple[str, str | dict[str, Any], str] | None:
    """(kind, text, param) of the request's one structured-output field, or None; two is a 400."""
    given: list[tuple[str, str | dict[str, Any], str]] = []
    if req.grammar is not None:
        given.append(("gbnf", req.grammar, "grammar"))
    if req.json_schema is not None:
        given.append(("json_schema", req.json_schema, "json_schema"))
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            given.append(("json_schema", rf.get("schema") or {"type": "object"}, "response_format"))
        elif kind == "json_schema":
            wrapper = rf.get("json_schema")
            if not isinstance(wrapper, dict):
                raise ApiError(400, "response_format.json_schema must be an object with a `schema`",
                               param="response_format")
            given.append(("json_schema", wrapper.get("schema", {}), "response_format"))
        elif kind != "text":
            raise ApiError(400, f"response_format.type {kind!r} is not one of text, json_object, json_schema",
                           param="response_format")
    if len(given) > 1:
        raise ApiError(400, f"{given[0][2]} and {given[1][2]} both constrain the output: give one",
                       param=given[1][2])
    return given[0] if given else None


def _tool_schema(tool: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(name, schema of its `{"name": …, "arguments": …}` call object) of an OpenAI function tool."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, "each tool must be {\"type\": \"function\", \"function\": {\"name\": …}}", param="tools")
    params = fn.get("parameters") or {"type": "object"}
    return fn["name"], {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False}


def _forced_tool_lark(tok: Tokenizer, tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> str | None:
    """The Lark grammar of tool calls a tool_choice forces ("required": one or more of the tools, a
    named function: exactly one call of it); None when the choice forces nothing."""
    schemas = dict(_tool_schema(t) for t in tools)
    if choice == "required":
        chosen, many = list(schemas.values()), True
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in schemas:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        chosen, many = [schemas[name]], False
    else:
        return None
    schema = dict(chosen[0] if len(chosen) == 1 else {"anyOf": chosen},
                  **{"x-guidance": {"whitespace_flexible": False}})
    call = f'call: {_lit(tok, OPEN)} "\\n" %json {json.dumps(schema)} "\\n" {_lit(tok, CLOSE)}'
    repeat = ' ("\\n" call)*' if many else ""
    return f"start: call{repeat}\n{call}\n"


def _grammars(source: str) -> list[dict[str, Any]]:
    """The grammar list of an llguidance source (a JSON grammar set, or Lark text)."""
    if source.lstrip().startswith("{"):
        return list(json.loads(source)["grammars"])
    return [{"lark_grammar": source}]


def after_reasoning(tok: Tokenizer, source: str) -> str:
    """The grammar `source` preceded by free reasoning text and `</think>` (a prompt that opened <think>)."""
    body = _grammars(source)
    body[0] = dict(body[0], name="body")
    top = f'start: REASON {_lit(tok, "</think>")} /[ \\r\\n]{{0,4}}/ @body\n{_REASON}\n'
    return json.dumps({"grammars": [{"lark_grammar": top}, *body]})


def request_grammar(req: SamplingFields, tok: Tokenizer, n_vocab: int, tools: list[dict[str, Any]] | None = None,
                    tool_choice: str | dict[str, Any] | None = None, in_think: bool = False) -> Grammar | None:
    """The grammar a request's output must match, or None; a bad schema or grammar is a 400."""
    src = _schema_source(req)
    forced = _forced_tool_lark(tok, tools, tool_choice or "auto") if tools else None  # each tool's shape checked
    if src is not None and forced is not None:
        raise ApiError(400, f"{src[2]} and a forced tool_choice both constrain the output: give one",
                       param="tool_choice")
    if src is None and forced is None:
        return None
    try:
        if forced is not None:
            g = Grammar.compile("lark", forced, tok, n_vocab, "tools")
        else:
            kind, text, param = src  # type: ignore[misc]
            g = Grammar.compile(kind, text, tok, n_vocab, param)  # type: ignore[arg-type]
        if in_think:
            g = Grammar.compile("llguidance", after_reasoning(tok, g.source), tok, n_vocab, "grammar")
    except InvalidRequest as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_grammar") from None
    return g
