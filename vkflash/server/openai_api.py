"""/v1/chat/completions and /v1/completions: request → prompt ids → slot → JSON or SSE, with
reasoning_content, tool_calls (vkflash.server.tools) and logprobs (vkflash.server.logprobs).

Each SSE event is its own chunk written to the socket as it is made (no coalescing: TTFT is the
first token's time, LESSONS "Serving"). A client that goes away cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from vkflash.engine.api import Finish, InvalidRequest, SamplingParams, TokenEvent
from vkflash.engine.generate import check_prompt
from vkflash.errors import DeviceError, VkflashError
from vkflash.model.chat import ReasoningParser, prompt_opens_think, render_chat
from vkflash.server.backend import Loaded
from vkflash.server.errors import ApiError
from vkflash.server.logprobs import Piece, ScoredToken, chat_entries, completion_logprobs
from vkflash.server.schemas import ChatMessage, ChatRequest, CompletionRequest, SamplingFields
from vkflash.server.slot import Job, QueueFull, Started
from vkflash.server.state import ServerState
from vkflash.server.tools import ToolCallParser, split_tool_calls

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class JobStream(StreamingResponse):
    """An SSE response that cancels its job however the response ends (even before it starts)."""

    def __init__(self, job: Job, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel.set()


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def check_model(req: SamplingFields, loaded: Loaded) -> None:
    """The request's `model`, if given, must name the served model (id or file name)."""
    names = {loaded.info.model_id, Path(loaded.info.model_path).name}
    if req.model is not None and req.model not in names:
        raise ApiError(404, f"model {req.model!r} is not served here; available: {loaded.info.model_id!r}",
                       param="model", code="model_not_found")


def sampling_params(req: SamplingFields, state: ServerState, max_tokens: int | None) -> SamplingParams:
    """SamplingParams from the request, with the TEMP knob as the default temperature."""
    if req.n != 1:
        raise ApiError(400, "n must be 1 (one generation slot)", param="n")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    temp = req.temperature if req.temperature is not None else float(state.settings["TEMP"])
    return SamplingParams(temperature=temp, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
                          max_tokens=max_tokens, stop=stop,
                          repetition_penalty=req.repeat_penalty if req.repeat_penalty is not None
                          else req.repetition_penalty,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          penalty_last_n=req.repeat_last_n, ignore_eos=req.ignore_eos, cache_prompt=req.cache_prompt)


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
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    for k in ("reasoning_content", "tool_calls", "tool_call_id", "name"):
        if getattr(m, k) is not None:
            d[k] = getattr(m, k)
    return d


@dataclass
class Prepared:
    """A validated request ready for the slot, and how its output is shaped: reasoning split
    (`split`, `in_think` when the prompt opened <think>), tool-call parsing, log-probabilities."""

    ids: list[int]
    params: SamplingParams
    in_think: bool = False
    split: bool = False
    tools: bool = False
    top_logprobs: int | None = None


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


def admit(state: ServerState, prep: Prepared) -> Job:
    """Check the prompt against the context and queue the job (503 when the queue is full)."""
    loaded = state.ready()
    try:
        check_prompt(len(prep.ids), loaded.info.n_ctx)
    except InvalidRequest as e:
        raise ApiError(400, str(e), param=e.param, code="context_length_exceeded") from None
    assert state.slot is not None
    try:
        return state.slot.submit(prep.ids, prep.params, prep.top_logprobs)
    except QueueFull:
        state.metrics.reject()
        raise ApiError(503, f"the server is busy: 1 generation running and {state.slot.depth} waiting",
                       code="queue_full", headers={"Retry-After": "1"}) from None


async def collect(job: Job, request: Request) -> tuple[str, Finish, list[ScoredToken]]:
    """Run a non-streamed job to its end (text, finish, scored tokens if it asked for logprobs);
    a client disconnect cancels it."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel.set()

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


def split_output(text: str, in_think: bool) -> tuple[str, str]:
    """(content, reasoning) of a whole output, split exactly as the stream splits it; only the
    reasoning is trimmed, so content equals the concatenated stream deltas."""
    p = ReasoningParser(in_think=in_think)
    r1, c1 = p.push(text)
    r2, c2 = p.flush()
    return c1 + c2, (r1 + r2).strip()


def raise_for(fin: Finish) -> None:
    """A generation that ended in an error becomes a 5xx answer."""
    if fin.reason == "error":
        status = 503 if isinstance(fin.error, DeviceError) else 500
        raise ApiError(status, f"generation failed: {fin.error}", code="generation_failed")


def finish_reason(fin: Finish, n_calls: int) -> str:
    """OpenAI's finish_reason: `tool_calls` when the output ended normally after making calls."""
    return "tool_calls" if n_calls and fin.reason == "stop" else fin.reason


def usage(fin: Finish) -> dict[str, Any]:
    """OpenAI usage object (cached_tokens: prompt tokens reused from the last sequence)."""
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.timings.cache_n}}


def error_event(fin: Finish) -> str:
    """The SSE event of a generation that failed mid-stream."""
    err = ApiError(503 if isinstance(fin.error, DeviceError) else 500, f"generation failed: {fin.error}",
                   code="generation_failed")
    return sse(err.body())


def make_router(state: ServerState) -> APIRouter:
    """The OpenAI-compatible completion routes over `state`."""
    router = APIRouter()

    @router.post("/v1/chat/completions", summary="Chat completion (OpenAI), streamed with stream=true")
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        loaded = state.ready()
        check_model(req, loaded)
        if not req.messages:
            raise ApiError(400, "messages must hold at least one message", param="messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, state, max_tokens)
        messages = [message_dict(m) for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        effort = req.reasoning_effort or state.settings["REASONING"] or None
        try:
            text = render_chat(loaded.info.chat_template, messages, tools=req.tools,
                               enable_thinking=kwargs.pop("enable_thinking", None), reasoning_effort=effort,
                               tplfix=bool(state.settings["TPLFIX"]), **kwargs)
        except VkflashError as e:
            raise ApiError(400, str(e), param="messages") from None
        ids = await run_in_threadpool(loaded.tokenizer.encode, text, True, True)
        split = req.reasoning_format == "auto"
        prep = Prepared(ids, params, split and prompt_opens_think(text), split,
                        bool(req.tools) and req.tool_choice != "none", chat_top_logprobs(req))
        job = admit(state, prep)
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), loaded.info.model_id
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return JobStream(job, chat_stream(job, cid, created, model, prep, include_usage, piece_of(loaded)))
        out, fin, scored = await collect(job, request)
        raise_for(fin)
        msg: dict[str, Any] = {"role": "assistant", "content": out}
        if split:
            msg["content"], reasoning = split_output(out, prep.in_think)
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

    @router.post("/v1/completions", summary="Text completion (OpenAI legacy), streamed with stream=true")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        loaded = state.ready()
        check_model(req, loaded)
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        params = sampling_params(req, state, req.max_tokens)
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
        job = admit(state, Prepared(ids, params, top_logprobs=req.logprobs))
        cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), loaded.info.model_id
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return JobStream(job, text_stream(job, cid, created, model, include_usage,
                                              piece_of(loaded) if req.logprobs is not None else None))
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
    (each carrying the logprobs of the tokens since the last chunk, if asked), then the finish."""
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
                yield chunk({}, finish_reason(ev, n_calls), usage=usage(ev), timings=ev.timings.to_json())
                if include_usage:
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [], "usage": usage(ev)})
            yield sse("[DONE]")


async def text_stream(job: Job, cid: str, created: int, model: str, include_usage: bool,
                      piece: Piece | None) -> AsyncIterator[str]:
    """SSE chunks of a text completion: text deltas (with the logprobs of the tokens since the last
    chunk when `piece` is given), then the finish."""
    pending: list[ScoredToken] = []
    offset = 0

    def chunk(text: str, finish: str | None = None, **extra: Any) -> str:
        nonlocal offset
        logprobs = None
        if piece is not None:
            logprobs = completion_logprobs(pending, piece, offset)
            offset += sum(len(t) for t in logprobs["tokens"])
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
                yield chunk("", ev.reason, usage=usage(ev), timings=ev.timings.to_json())
                if include_usage:
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": usage(ev)})
            yield sse("[DONE]")
