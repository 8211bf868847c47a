"""/v1/chat/completions and /v1/completions (also without /v1, as llama-server): request → prompt
ids → slot → JSON or SSE, with reasoning_content, tool_calls (vkflash.server.tools) and logprobs
(vkflash.server.logprobs).

Each SSE event is its own chunk written to the socket as it is made (no coalescing: TTFT is the
first token's time; a hidden 8 KB buffer once held back the first 55 tokens). A client that goes away cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from vkflash.engine.api import Finish, InvalidRequest, SamplingParams, TokenEvent
from vkflash.engine.generate import check_prompt
from vkflash.engine.grammar import Grammar
from vkflash.errors import DeviceError, VkflashError
from vkflash.model.chat import EFFORTS, ReasoningParser, prompt_opens_think, render_chat, reply_start, split_reasoning
from vkflash.server.backend import Loaded
from vkflash.server.errors import ApiError
from vkflash.server.logprobs import Piece, ScoredToken, chat_entries, completion_logprobs
from vkflash.server.schemas import ChatMessage, ChatRequest, CompletionRequest, SamplingFields
from vkflash.server.slot import Job, QueueFull, ShuttingDown, Started
from vkflash.server.state import ServerState
from vkflash.server.structured import request_grammar
from vkflash.server.tools import ToolCallParser, split_tool_calls

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class JobStream(StreamingResponse):
    """An SSE response that cancels its job however the response ends (even before it starts), and
    sends an SSE comment after every `keepalive_s` without an event (0: never) so proxies keep it open."""

    def __init__(self, job: Job, content: AsyncIterator[str], keepalive_s: float = 0.0) -> None:
        super().__init__(with_keepalive(content, keepalive_s) if keepalive_s > 0 else content,
                         media_type="text/event-stream", headers=SSE_HEADERS)
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.abort()


KEEPALIVE = ": keep-alive\n\n"


async def with_keepalive(content: AsyncIterator[str], every_s: float) -> AsyncIterator[str]:
    """The events of `content`, with a keep-alive comment whenever none came for `every_s` seconds
    (a long prefill sends nothing until its first token)."""
    it = aiter(content)
    nxt: asyncio.Task[str] | None = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({nxt}, timeout=every_s)
            if not done:
                yield KEEPALIVE
                continue
            try:
                ev = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield ev
    finally:
        if nxt is not None:
            nxt.cancel()


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


SURROGATE = re.compile("[\ud800-\udfff]")
# render_chat's own arguments: a chat_template_kwargs key of these names would collide with them
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "tplfix", "source")


def _has_surrogate(v: Any) -> bool:
    """Whether a parsed JSON value holds a lone UTF-16 surrogate (JSON allows "\ud800"; Unicode text does not)."""
    if isinstance(v, str):
        return SURROGATE.search(v) is not None
    if isinstance(v, dict):
        return any(_has_surrogate(k) or _has_surrogate(x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return any(_has_surrogate(x) for x in v)
    if isinstance(v, BaseModel):
        return _has_surrogate(dict(v)) or _has_surrogate(v.model_extra or {})
    return False


def check_text(req: BaseModel) -> None:
    """A 400 naming the field whose text holds a lone surrogate (it could be neither tokenized nor echoed)."""
    for name, value in [*dict(req).items(), *(req.model_extra or {}).items()]:
        if _has_surrogate(value):
            raise ApiError(400, f"{name}: the text holds a lone UTF-16 surrogate (not valid Unicode)", param=name,
                           code="invalid_value")


def sampling_params(req: SamplingFields, state: ServerState, max_tokens: int | None, n_ctx: int,
                    bias: tuple[tuple[int, float], ...] = ()) -> SamplingParams:
    """SamplingParams from the request, with the TEMP knob as the default temperature and
    llama-server's special values: `seed` -1 is random (no seed), `repeat_last_n` -1 the whole context."""
    if req.n != 1:
        raise ApiError(400, "n must be 1 (one generation slot)", param="n")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    temp = req.temperature if req.temperature is not None else float(state.settings["TEMP"])
    return SamplingParams(temperature=temp, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                          seed=None if req.seed == -1 else req.seed, max_tokens=max_tokens, stop=stop,
                          repetition_penalty=req.repeat_penalty if req.repeat_penalty is not None
                          else req.repetition_penalty,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          penalty_last_n=n_ctx if req.repeat_last_n == -1 else req.repeat_last_n,
                          ignore_eos=req.ignore_eos, logit_bias=bias,
                          cache_prompt=req.cache_prompt)


async def sampling_params_of(req: SamplingFields, state: ServerState, loaded: Loaded,
                             max_tokens: int | None) -> SamplingParams:
    """sampling_params with the request's logit_bias (text keys are tokenized off the event loop)."""
    bias = await run_in_threadpool(logit_bias, req.logit_bias, loaded)
    return sampling_params(req, state, max_tokens, loaded.info.n_ctx, bias)


def _bias_error(msg: str) -> ApiError:
    return ApiError(400, f"logit_bias: {msg}", param="logit_bias", code="invalid_value")


def logit_bias(raw: dict[str, Any] | list[Any] | None, loaded: Loaded) -> tuple[tuple[int, float], ...]:
    """llama-server's logit_bias: {"token id": bias} or [[token id or text, bias], …]; a text key
    stands for each of its tokens; a bias of false or ≤ -100 bans the token (-inf)."""
    if not raw:
        return ()
    items = list(raw.items()) if isinstance(raw, dict) else raw
    out: dict[int, float] = {}
    for item in items:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise _bias_error("a list entry must be a [token, bias] pair")
        key, value = item
        if value is False:
            bias = float("-inf")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            bias = float("-inf") if value <= -100 else float(value)
        else:
            raise _bias_error(f"the bias of {key!r} must be a number or false (got {value!r})")
        if isinstance(key, int) and not isinstance(key, bool):
            ids = [key]
        elif isinstance(key, str) and re.fullmatch(r"-?\d+", key.strip()):
            ids = [int(key)]
        elif isinstance(key, str):
            ids = loaded.tokenizer.encode(key, False, False)
        else:
            raise _bias_error(f"a key must be a token id or text (got {key!r})")
        for t in ids:
            if not 0 <= t < loaded.info.n_vocab:
                raise _bias_error(f"token id {t} is outside the vocabulary 0..{loaded.info.n_vocab - 1}")
            out[t] = bias
    return tuple(out.items())


def chosen_tools(req: ChatRequest) -> list[dict[str, Any]] | None:
    """The tools the template shows, by tool_choice: "none" → none; "auto" / "required" → all of
    them; {"type": "function", "function": {"name": n}} → that one (the grammar of structured.py
    forces the call for "required" and a named function)."""
    choice, tools = req.tool_choice, req.tools or []
    if choice is None or choice == "auto":
        return tools or None
    if choice == "none":
        return None
    if not tools:
        raise ApiError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
    if choice == "required":
        return tools
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        named = [t for t in tools if isinstance(t.get("function"), dict) and t["function"].get("name") == name]
        if not named:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                           param="tool_choice", code="invalid_value")
        return named
    raise ApiError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": …}}", param="tool_choice",
                   code="invalid_value")


def render(req: ChatRequest, state: ServerState, loaded: Loaded, tools: list[dict[str, Any]] | None,
           generation_prompt: bool = True) -> str:
    """The request's prompt text by the chat template (run off the event loop: a long conversation
    takes a while); a request the template cannot render is a 400."""
    messages = [message_dict(m) for m in req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    for k in RESERVED_KWARGS:
        if k in kwargs:
            raise ApiError(400, f"chat_template_kwargs.{k}: set by the request itself, not a template option",
                           param="chat_template_kwargs", code="invalid_value")
    asked = kwargs.pop("reasoning_effort", None)
    if asked is not None and asked not in EFFORTS:
        raise ApiError(400, f"chat_template_kwargs.reasoning_effort must be one of {'|'.join(EFFORTS)} "
                       f"(got {asked!r})", param="chat_template_kwargs", code="invalid_value")
    effort = req.reasoning_effort or asked or state.settings["REASONING"] or None
    kwargs = loaded.tokenizer.template_tokens() | kwargs  # the request's kwargs may set them
    try:
        return render_chat(loaded.info.chat_template, messages, tools=tools, add_generation_prompt=generation_prompt,
                           enable_thinking=kwargs.pop("enable_thinking", None), reasoning_effort=effort,
                           tplfix=bool(state.settings["TPLFIX"]), **kwargs)
    except VkflashError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_value") from None
    except Exception as e:  # noqa: BLE001 — the template failed on what the request holds
        raise ApiError(400, f"chat template error: {type(e).__name__}: {e}", param="messages",
                       code="invalid_value") from None


def checkpoint_at(req: ChatRequest, state: ServerState, loaded: Loaded, tools: list[dict[str, Any]] | None,
                  text: str, ids: list[int]) -> int | None:
    """Where the prompt's state is kept for the conversation's next turn: before its generation prompt
    (None, the prompt's end, when the template cannot render the conversation without one)."""
    try:
        history = render(req, state, loaded, tools, generation_prompt=False)
    except ApiError:
        return None
    return reply_start(text, history, ids, lambda s: loaded.tokenizer.encode(s, False, True))


def check_tool_calls(calls: list[dict[str, Any]]) -> None:
    """An assistant turn's tool calls must be `{"function": {"name": str, "arguments": str | object}}`."""
    for c in calls:
        f = c.get("function")
        ok = isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"] \
            and isinstance(f.get("arguments", ""), (str, dict))
        if not ok:
            raise ApiError(400, "messages: each tool_calls entry must be {\"function\": {\"name\": a string, "
                           "\"arguments\": a JSON string or object}}", param="messages", code="invalid_value")


def message_dict(m: ChatMessage) -> dict[str, Any]:
    """A message as the template sees it: text content, `developer` as `system`."""
    if isinstance(m.content, list):
        parts = []
        for p in m.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ApiError(400, f"unsupported content part of type {p.get('type')!r}: only text",
                               param="messages")
            parts.append(p["text"])
        content = "".join(parts)
    else:
        content = m.content or ""
    if m.tool_calls is not None:
        check_tool_calls(m.tool_calls)
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    for k in ("reasoning_content", "tool_calls", "tool_call_id", "name"):
        if getattr(m, k) is not None:
            d[k] = getattr(m, k)
    return d


@dataclass
class Prepared:
    """A validated request ready for the slot, and how its output is shaped: reasoning split
    (`split`, `in_think` when the prompt opened <think>), tool-call parsing, log-probabilities, and
    the grammar the output must match (structured output)."""

    ids: list[int]
    params: SamplingParams
    in_think: bool = False
    split: bool = False
    tools: bool = False
    top_logprobs: int | None = None
    grammar: Grammar | None = None
    checkpoint_at: int | None = None  # the prompt position whose state is kept for the next turn


def piece_of(loaded: Loaded) -> Piece:
    """Token id → its bytes, special tokens spelled out (what logprobs entries show)."""
    return lambda t: loaded.tokenizer.token_bytes(t, special=True)


def chat_top_logprobs(req: ChatRequest) -> int | None:
    """How many alternatives per token a chat request wants (None: no logprobs at all)."""
    if req.logprobs:
        return req.top_logprobs or 0
    if req.top_logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return None


def admit(state: ServerState, prep: Prepared, field: str) -> Job:
    """Check the prompt against the context and queue the job (503 when the queue is full); an
    error names the request's `field` that held the prompt ("messages" or "prompt")."""
    loaded = state.ready()
    try:
        check_prompt(len(prep.ids), loaded.info.n_ctx)
    except InvalidRequest as e:
        code = "invalid_value" if not prep.ids else "context_length_exceeded"
        raise ApiError(400, str(e), param=field, code=code) from None
    assert state.slot is not None
    try:
        return state.slot.submit(prep.ids, prep.params, prep.top_logprobs, prep.grammar, prep.checkpoint_at)
    except QueueFull:
        state.metrics.reject()
        raise ApiError(503, f"the server is busy: 1 generation running and {state.slot.depth} waiting",
                       code="queue_full", headers={"Retry-After": "1"}) from None
    except ShuttingDown as e:
        raise ApiError(503, str(e), code="shutting_down") from None


async def collect(job: Job, request: Request) -> tuple[str, Finish, list[ScoredToken]]:
    """Run a non-streamed job to its end (text, finish, scored tokens if it asked for logprobs);
    a client disconnect cancels it."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.abort()

    watcher = asyncio.create_task(watch())
    parts: list[str] = []
    scored: list[ScoredToken] = []
    fin = Finish("error", error=RuntimeError("no finish"))
    try:
        async for ev in job.stream():
            if isinstance(ev, TokenEvent):
                parts.append(ev.text)
                if isinstance(ev, ScoredToken):
                    scored.append(ev)
            elif isinstance(ev, Finish):
                fin = ev
    finally:
        watcher.cancel()
    parts.append(fin.text)
    return "".join(parts), fin, scored


def failure(fin: Finish) -> ApiError:
    """The error answer of a generation that ended in an error: 503 when the server is going away
    (shut down, device lost), else 500."""
    if isinstance(fin.error, ShuttingDown):
        return ApiError(503, str(fin.error), code="shutting_down")
    status = 503 if isinstance(fin.error, DeviceError) else 500
    return ApiError(status, f"generation failed: {fin.error}", code="generation_failed")


def raise_for(fin: Finish) -> None:
    """A generation that ended in an error becomes a 5xx answer."""
    if fin.reason == "error":
        raise failure(fin)


def finish_reason(fin: Finish, n_calls: int) -> str:
    """OpenAI's finish_reason: `tool_calls` when the output ended normally after making calls."""
    return "tool_calls" if n_calls and fin.reason == "stop" else fin.reason


def usage(fin: Finish) -> dict[str, Any]:
    """OpenAI usage object (cached_tokens: prompt tokens reused from the last sequence)."""
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.timings.cache_n}}


def finish_fields(fin: Finish, include_usage: bool) -> dict[str, Any]:
    """What a stream's finish chunk carries beside its choice: timings, and usage (where older
    llama-server clients read it) unless include_usage sends it in a last chunk of its own, as a
    second copy would be counted twice by clients that sum the usage of every chunk."""
    timings = {"timings": fin.timings.to_json()}
    return timings if include_usage else {"usage": usage(fin), **timings}


def error_event(fin: Finish) -> str:
    """The SSE event of a generation that failed mid-stream."""
    return sse(failure(fin).body())


def make_router(state: ServerState) -> APIRouter:
    """The OpenAI-compatible completion routes over `state`."""
    router = APIRouter()

    @router.post("/chat/completions", summary="Alias of /v1/chat/completions (llama-server)")
    @router.post("/v1/chat/completions", summary="Chat completion (OpenAI), streamed with stream=true")
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        loaded = state.ready()
        if not req.messages:
            raise ApiError(400, "messages must hold at least one message", param="messages")
        check_text(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = await sampling_params_of(req, state, loaded, max_tokens)
        tools = chosen_tools(req)
        text = await run_in_threadpool(render, req, state, loaded, tools)
        ids = await run_in_threadpool(loaded.tokenizer.encode, text, True, True)
        split = req.reasoning_format == "auto"
        grammar = await run_in_threadpool(request_grammar, req, loaded.tokenizer, loaded.info.n_vocab, tools,
                                          req.tool_choice, prompt_opens_think(text))
        keep = await run_in_threadpool(checkpoint_at, req, state, loaded, tools, text, ids)
        prep = Prepared(ids, params, split and prompt_opens_think(text), split, bool(tools), chat_top_logprobs(req),
                        grammar, keep)
        job = admit(state, prep, "messages")
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), loaded.info.model_id
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return JobStream(job, chat_stream(job, cid, created, model, prep, include_usage, piece_of(loaded)),
                             state.settings["SSE_KEEPALIVE"])
        out, fin, scored = await collect(job, request)
        raise_for(fin)
        msg: dict[str, Any] = {"role": "assistant", "content": out}
        if split:
            msg["content"], reasoning = split_reasoning(out, prep.in_think)
            if reasoning:
                msg["reasoning_content"] = reasoning
        calls = []
        if prep.tools:
            content, calls = split_tool_calls(msg["content"])
            if calls:
                msg["content"] = content or None
                msg["tool_calls"] = [c.to_json() for c in calls]
        logprobs = None if prep.top_logprobs is None else {"content": chat_entries(scored, piece_of(loaded))}
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                             "choices": [{"index": 0, "message": msg, "finish_reason": finish_reason(fin, len(calls)),
                                          "logprobs": logprobs}],
                             "usage": usage(fin), "timings": fin.timings.to_json()})

    @router.post("/completions", summary="Alias of /v1/completions (llama-server)")
    @router.post("/v1/completions", summary="Text completion (OpenAI legacy), streamed with stream=true")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        loaded = state.ready()
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        check_text(req)
        params = await sampling_params_of(req, state, loaded, req.max_tokens)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request (batches are not supported)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await run_in_threadpool(loaded.tokenizer.encode, prompt, True, True)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < loaded.info.n_vocab]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary 0..{loaded.info.n_vocab - 1}",
                               param="prompt")
        grammar = await run_in_threadpool(request_grammar, req, loaded.tokenizer, loaded.info.n_vocab)
        job = admit(state, Prepared(ids, params, top_logprobs=req.logprobs, grammar=grammar), "prompt")
        cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), loaded.info.model_id
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return JobStream(job, text_stream(job, cid, created, model, include_usage,
                                              piece_of(loaded) if req.logprobs is not None else None),
                             state.settings["SSE_KEEPALIVE"])
        out, fin, scored = await collect(job, request)
        raise_for(fin)
        logprobs = None if req.logprobs is None else completion_logprobs(scored, piece_of(loaded))
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": 0, "text": out, "finish_reason": fin.reason, "logprobs": logprobs}],
                             "usage": usage(fin), "timings": fin.timings.to_json()})

    return router


async def chat_stream(job: Job, cid: str, created: int, model: str, prep: Prepared, include_usage: bool,
                      piece: Piece) -> AsyncIterator[str]:
    """SSE chunks of a chat completion: role, then content / reasoning_content / tool_calls deltas
    (each carrying the logprobs of the tokens since the last chunk, if asked), then the finish
    (finish_fields) and, with include_usage, a usage chunk without choices."""
    pending: list[ScoredToken] = []
    reasoning_parser = ReasoningParser(in_think=prep.in_think) if prep.split else None
    tool_parser = ToolCallParser() if prep.tools else None
    n_calls = 0

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        logprobs = None
        if pending:
            logprobs = {"content": chat_entries(pending, piece)}
            pending.clear()
        return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}], **extra})

    def delta_of(text: str, final: bool = False) -> dict[str, Any]:
        nonlocal n_calls
        reasoning, content = "", text
        if reasoning_parser is not None:
            reasoning, content = reasoning_parser.push(text)
            if final:
                r2, c2 = reasoning_parser.flush()
                reasoning, content = reasoning + r2, content + c2
        calls = []
        if tool_parser is not None:
            content, calls = tool_parser.push(content)
            if final:
                c2, more = tool_parser.flush()
                content, calls = content + c2, calls + more
        d: dict[str, Any] = {}
        if reasoning:
            d["reasoning_content"] = reasoning
        if content:
            d["content"] = content
        if calls:
            d["tool_calls"] = [c.to_json(n_calls + i) for i, c in enumerate(calls)]
            n_calls += len(calls)
        return d

    async for ev in job.stream():
        if isinstance(ev, Started):
            yield chunk({"role": "assistant", "content": ""})
        elif isinstance(ev, TokenEvent):
            if isinstance(ev, ScoredToken):
                pending.append(ev)
            if d := delta_of(ev.text):
                yield chunk(d)
        else:
            if ev.reason == "error":
                yield error_event(ev)
            else:
                d = delta_of(ev.text, final=True)
                if d or pending:
                    yield chunk(d)
                yield chunk({}, finish_reason(ev, n_calls), **finish_fields(ev, include_usage))
                if include_usage:
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [], "usage": usage(ev)})
            yield sse("[DONE]")


async def text_stream(job: Job, cid: str, created: int, model: str, include_usage: bool,
                      piece: Piece | None) -> AsyncIterator[str]:
    """SSE chunks of a text completion: text deltas (with the logprobs of the tokens since the last
    chunk when `piece` is given), then the finish (finish_fields) and, with include_usage, a usage chunk
    without choices."""
    pending: list[ScoredToken] = []
    offset = 0

    def chunk(text: str, finish: str | None = None, **extra: Any) -> str:
        nonlocal offset
        logprobs = None
        if piece is not None:
            logprobs = completion_logprobs(pending, piece, offset)
            offset += sum(len(s.text) for s in pending)
            pending.clear()
        return sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}], **extra})

    async for ev in job.stream():
        if isinstance(ev, TokenEvent):
            if isinstance(ev, ScoredToken):
                pending.append(ev)
            if ev.text:
                yield chunk(ev.text)
        elif isinstance(ev, Finish):
            if ev.reason == "error":
                yield error_event(ev)
            else:
                if ev.text or pending:
                    yield chunk(ev.text)
                yield chunk("", ev.reason, **finish_fields(ev, include_usage))
                if include_usage:
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": usage(ev)})
            yield sse("[DONE]")
