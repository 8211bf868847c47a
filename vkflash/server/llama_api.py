"""llama-server's own endpoints, where coding agents and tools written against it need them:
/infill (fill-in-the-middle), /apply-template, /tokenize, /props, /slots and /metrics (with its
`llamacpp:*` names beside vkflash's own).

Request and response shapes follow llama-server (tools/server/README.md); what vkflash cannot
report (several sampler settings it does not have) is left out rather than invented.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

import vkflash
from vkflash.engine.api import Finish, SamplingParams, TokenEvent
from vkflash.engine.guard import memory_gauges
from vkflash.model.chat import render_chat
from vkflash.model.tokenizer import Tokenizer
from vkflash.server.backend import Loaded
from vkflash.server.errors import ApiError
from vkflash.server.metrics import Live
from vkflash.server.openai_api import JobStream, Prepared, admit, check_text, chosen_tools, collect, error_event, \
    raise_for, render, sampling_params_of, sse
from vkflash.server.schemas import ChatRequest, InfillRequest, TokenizeRequest
from vkflash.server.slot import Job, Started
from vkflash.server.state import ServerState
from vkflash.server.structured import request_grammar, special_ids

# FIM token texts by role, as llama.cpp's vocabulary loader recognizes them (first found wins)
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>"),
    "sep": ("<|file_sep|>", "<fim-sep>", "<file_sep>"),
}
# what separates extra chunks when the vocabulary has no file separator (llama-server's)
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


def fim_tokens(tok: Tokenizer) -> dict[str, int]:
    """Role → id of the vocabulary's FIM tokens (pre, suf, mid; rep and sep where present)."""
    ids = special_ids(tok)
    return {role: next(ids[t] for t in texts if t in ids) for role, texts in FIM_TEXTS.items()
            if any(t in ids for t in texts)}


def infill_prompt(tok: Tokenizer, req: InfillRequest, n_batch: int, n_ctx: int, n_predict: int) -> list[int]:
    """llama-server's format_infill: the repo-level FIM layout
    [rep]myproject\\n [sep]file\\n text … [sep]filename\\n [pre]prefix+prompt [suf]suffix [mid],
    the prefix (last 3/4 of a batch) and suffix (first 1/4) cut to fit one batch, the extra chunks
    to what the context leaves (the latest kept). 400 when the vocabulary has no FIM tokens."""
    fim = fim_tokens(tok)
    missing = [FIM_TEXTS[r][0] for r in ("pre", "suf", "mid") if r not in fim]
    if missing:
        raise ApiError(400, f"/infill needs a fill-in-the-middle model; this vocabulary lacks {', '.join(missing)}",
                       code="not_supported")

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=False)

    extra: list[int] = []
    if "rep" in fim:
        extra += [fim["rep"], *enc("myproject\n")]
    for chunk in req.input_extra:
        extra += [fim["sep"], *enc(chunk.filename + "\n")] if "sep" in fim else enc(CHUNK_SEPARATOR)
        extra += enc(chunk.text)
    if "sep" in fim:
        extra += [fim["sep"], *enc("filename\n")]
    prompt = tok.encode(req.prompt, add_special=True, parse_special=True)  # as llama-server tokenizes prompts
    prefix, suffix = enc(req.input_prefix), enc(req.input_suffix)
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    head = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return [*extra[len(extra) - n_extra:], *head, fim["pre"], *prefix[len(prefix) - n_prefix:], *prompt,
            fim["suf"], *suffix[:n_suffix], fim["mid"]]


def params_json(p: SamplingParams) -> dict[str, Any]:
    """A job's sampling parameters under llama-server's names (/props, /slots)."""
    return {"n_predict": p.max_tokens if p.max_tokens is not None else -1,
            "seed": p.seed if p.seed is not None else 0xFFFFFFFF, "temperature": p.temperature,
            "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "repeat_last_n": p.penalty_last_n,
            "repeat_penalty": p.repetition_penalty, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "stop": list(p.stop), "ignore_eos": p.ignore_eos,
            "max_tokens": p.max_tokens if p.max_tokens is not None else -1,
            "samplers": ["penalties", "temperature", "top_k", "top_p", "min_p"]}


def default_params(state: ServerState) -> SamplingParams:
    """What a request that sets nothing samples with (the TEMP knob and the request defaults)."""
    return SamplingParams(temperature=float(state.settings["TEMP"]))


_MARK = "vkflash-probe-7c1e"


@functools.lru_cache(maxsize=8)
def template_caps(template: str) -> dict[str, bool]:
    """llama-server's chat_template_caps, found as minja finds them: render probe conversations and
    see whether the probe text comes out."""
    user = {"role": "user", "content": "hi"}

    def call(name: str, args: Any) -> dict[str, Any]:
        return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": args}}

    def shows(messages: list[dict[str, Any]], want: tuple[str, ...] = (_MARK,), **kw: Any) -> bool:
        try:
            out = render_chat(template, messages, tplfix=False, **kw)
        except Exception:  # noqa: BLE001 — a template that fails on the probe does not support it
            return False
        return all(w in out for w in want)

    tool = {"type": "function", "function": {"name": _MARK, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    asked = [user, {"role": "assistant", "content": None, "tool_calls": [call(_MARK + "a", {"x": 1})]}]
    return {
        "supports_system_role": shows([{"role": "system", "content": _MARK}, user]),
        "supports_tools": shows([user], tools=[tool]),
        "supports_tool_calls": shows(asked, (_MARK + "a",)),
        "supports_parallel_tool_calls": shows(
            [user, {"role": "assistant", "content": None,
                    "tool_calls": [call(_MARK + "a", {}), call(_MARK + "b", {})]}],
            (_MARK + "a", _MARK + "b")),
        "supports_object_arguments": shows(asked, ('"x"',)),
        "supports_tool_responses": shows([*asked, {"role": "tool", "tool_call_id": f"call_{_MARK}a",
                                                   "content": _MARK}]),
        "supports_preserve_reasoning": shows([user, {"role": "assistant", "content": "ok", "reasoning_content": _MARK},
                                              {"role": "user", "content": "more"}]),
        "supports_string_content": shows([{"role": "user", "content": _MARK}]),
        "supports_typed_content": shows([{"role": "user", "content": [{"type": "text", "text": _MARK}]}]),
    }


def _piece(tok: Tokenizer, t: int) -> str | list[int]:
    """A token's piece as llama-server shows it: text if it is valid UTF-8, else its bytes."""
    b = tok.token_bytes(t, special=True)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


def _stop_type(fin: Finish) -> str:
    """llama-server's stop_type of a finish (a stop string and the end token both read "eos")."""
    return {"stop": "eos", "length": "limit"}.get(fin.reason, "none")


def make_router(state: ServerState) -> APIRouter:
    """llama-server's endpoints over `state`."""
    router = APIRouter()

    def slot_json(loaded: Loaded) -> dict[str, Any]:
        slot = state.slot
        job: Job | None = slot.current if slot is not None else None
        p = job.params if job is not None else default_params(state)
        fwd = loaded.fwd
        return {"id": 0, "id_task": id(job) if job is not None else -1, "n_ctx": loaded.info.n_ctx,
                "speculative": "mtp" in loaded.info.backend, "is_processing": job is not None,
                "params": params_json(p), "n_prompt_tokens": len(job.prompt) if job is not None else 0,
                "n_past": fwd.n_past,
                "next_token": {"has_next_token": job is not None, "n_decoded": job.n_decoded if job else 0,
                               "n_remain": -1 if p.max_tokens is None else p.max_tokens - (job.n_decoded if job else 0),
                               "stopping_word": ""}}

    @router.get("/props", summary="Server and model properties (llama-server style)")
    async def props() -> JSONResponse:
        loaded = state.ready()
        i, s, tok = loaded.info, state.settings, loaded.tokenizer
        caps = await run_in_threadpool(template_caps, i.chat_template)

        def text(t: int | None) -> str:
            return tok.tokens[t] if t is not None else ""

        return JSONResponse({
            "default_generation_settings": dict(slot_json(loaded), is_processing=False, id_task=-1,
                                                params=params_json(default_params(state))),
            "total_slots": 1, "queue_depth": state.options.queue_depth, "model_path": i.model_path,
            "model_alias": i.model_id, "arch": i.arch, "backend": i.backend, "n_ctx": i.n_ctx, "n_vocab": i.n_vocab,
            "n_ctx_train": i.n_ctx_train, "chat_template": i.chat_template, "chat_template_caps": caps,
            "bos_token": text(tok.bos_id), "eos_token": text(tok.eos_id), "reasoning": s["REASONING"] or "default",
            "build_info": f"vkflash {vkflash.__version__}", "modalities": {"vision": False, "video": False,
                                                                          "audio": False},
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
            "infill": bool({"pre", "suf", "mid"} <= fim_tokens(tok).keys())})

    @router.get("/slots", summary="The generation slot: its state and the running job's parameters (read-only)")
    async def slots(request: Request) -> JSONResponse:
        loaded = state.ready()
        one = slot_json(loaded)
        if request.query_params.get("fail_on_no_slot") not in (None, "", "0", "false") and one["is_processing"]:
            raise ApiError(503, "no slot available", code="unavailable")
        return JSONResponse([one])

    @router.post("/tokenize", summary="Text → token ids (parse_special: special-token text becomes its token)")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        tok = state.ready().tokenizer
        check_text(req)
        ids = await run_in_threadpool(tok.encode, req.content, req.add_special, req.parse_special)
        if req.with_pieces:
            pieces = await run_in_threadpool(lambda: [{"id": t, "piece": _piece(tok, t)} for t in ids])
            return JSONResponse({"tokens": pieces})
        return JSONResponse({"tokens": ids})

    @router.post("/apply-template", summary="Chat messages → the prompt the chat template renders")
    async def apply_template(req: ChatRequest) -> JSONResponse:
        loaded = state.ready()
        if not req.messages:
            raise ApiError(400, "messages must hold at least one message", param="messages")
        check_text(req)
        return JSONResponse({"prompt": await run_in_threadpool(render, req, state, loaded, chosen_tools(req))})

    @router.post("/infill", summary="Fill in the middle (llama-server): code between input_prefix and input_suffix")
    async def infill(req: InfillRequest, request: Request) -> Any:
        loaded = state.ready()
        max_tokens = req.max_tokens if req.n_predict is None else (None if req.n_predict < 0 else req.n_predict)
        check_text(req)
        params = await sampling_params_of(req, state, loaded, max_tokens)
        ids = await run_in_threadpool(infill_prompt, loaded.tokenizer, req, loaded.info.ubatch, loaded.info.n_ctx,
                                      max_tokens if max_tokens is not None else -1)
        grammar = await run_in_threadpool(request_grammar, req, loaded.tokenizer, loaded.info.n_vocab)
        job = admit(state, Prepared(ids, params, grammar=grammar), "prompt")
        model = loaded.info.model_id
        settings = params_json(params)

        def final(content: str, fin: Finish) -> dict[str, Any]:
            return {"index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": True, "model": model,
                    "tokens_predicted": fin.completion_tokens, "tokens_evaluated": fin.prompt_tokens,
                    "generation_settings": settings, "prompt": loaded.tokenizer.decode(ids, special=True),
                    "has_new_line": "\n" in content, "truncated": False, "stop_type": _stop_type(fin),
                    "stopping_word": "", "tokens_cached": 0, "timings": fin.timings.to_json()}

        if req.stream:
            return JobStream(job, infill_stream(job, final), state.settings["SSE_KEEPALIVE"])
        out, fin, _ = await collect(job, request)
        raise_for(fin)
        return JSONResponse(final(out, fin))

    @router.get("/metrics", summary="Prometheus metrics (vkflash_* and llama-server's llamacpp:*)",
                response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        slot = state.slot
        fwd = state.loaded.fwd if state.loaded else None
        gauges = {
            "healthy": ("1 when the server can generate", float(state.health.status == "ok")),
            "queue_depth": ("requests waiting for the slot", float(slot.waiting if slot else 0)),
            "queue_capacity": ("requests that may wait", float(state.options.queue_depth)),
            "slot_busy": ("1 while a generation runs", float(slot.busy if slot else 0)),
            "kv_fill_ratio": ("fraction of the context in use", slot.kv_fill() if slot else 0.0),
            "guard_tier": ("deep-context guard steps in force (0: none)", float(getattr(fwd, "guard_tier", 0))),
            **memory_gauges(fwd),
        }
        live = Live(processing=int(slot.busy) if slot else 0, deferred=slot.waiting if slot else 0,
                    kv_tokens=fwd.n_past if fwd is not None else 0, n_ctx=fwd.n_ctx if fwd is not None else 0)
        return PlainTextResponse(state.metrics.render(gauges, live), media_type="text/plain; version=0.0.4")

    return router


async def infill_stream(job: Job, final: Callable[[str, Finish], dict[str, Any]]) -> AsyncIterator[str]:
    """llama-server's /completion stream: {"content": delta, "stop": false} per token, then the final
    object with "stop": true (no [DONE], as llama-server)."""
    async for ev in job.stream():
        if isinstance(ev, Started):
            continue
        if isinstance(ev, TokenEvent):
            if ev.text:
                yield sse({"index": 0, "content": ev.text, "tokens": [ev.token], "stop": False, "id_slot": 0})
        elif ev.reason == "error":
            yield error_event(ev)
        else:
            yield sse(final(ev.text, ev))

