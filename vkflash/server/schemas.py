"""Request bodies of the HTTP API as strict pydantic models: they validate every request (a wrong
type is a 400, never a silent coercion) and they are what the published OpenAPI schema shows.

Unknown fields are accepted and ignored, as OpenAI clients send many we have no use for; null for
a field that has a default means that default (OpenAI clients send `"top_p": null` for "not set").
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vkflash.server.logprobs import MAX_TOP


class _Strict(BaseModel):
    """Strict types, extra fields allowed, null for an optional field meaning its default."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """Drop the nulls of fields that have a default, so they take it; a required field's null stays a 400."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class ChatMessage(_Strict):
    """One conversation turn; content is text or a list of `{"type": "text", "text": …}` parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(_Strict):
    """`include_usage`: a last chunk with `usage` and no choices."""

    include_usage: bool = False


class SamplingFields(_Strict):
    """Sampling and stopping fields shared by chat and text completions (OpenAI + llama-server names)."""

    model: str | None = Field(default=None, description="any name: the one served model answers (as llama-server)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, description="output cap; beyond the context: finish_reason length")
    temperature: float | None = Field(default=None, description="0: greedy; omitted: the TEMP knob")
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    repetition_penalty: float = 1.0
    repeat_penalty: float | None = Field(default=None, description="llama-server name of repetition_penalty")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = Field(
        default=None, description='{"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": …}}: '
        "the output matches it")
    grammar: str | None = Field(default=None, description="llama-server: a GBNF grammar the output matches")
    json_schema: dict[str, Any] | None = Field(default=None,
                                               description="llama-server: a JSON schema the output matches")
    logit_bias: dict[str, Any] | list[Any] | None = Field(
        default=None, description="{\"token id\": bias} or [[token id or text, bias], …]; false or ≤ -100 bans")
    cache_prompt: bool = Field(default=True, description="reuse the prefix this prompt shares with the last one "
                               "(timings.cache_n, usage.prompt_tokens_details.cached_tokens); false: prefill it all")


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="function tools; `<tool_call>` blocks in the output become tool_calls")
    tool_choice: str | dict[str, Any] | None = Field(
        default=None, description="\"none\": no tools shown nor parsed; \"auto\": all tools, the model chooses; "
        "\"required\": all tools, the output forced to be calls of them; {\"type\": \"function\", \"function\": "
        "{\"name\": …}}: that tool only, one call of it forced")
    logprobs: bool = Field(default=False, description="report each output token's log-probability")
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP, description="alternatives per token (needs logprobs)")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    reasoning_format: Literal["auto", "none"] = Field(
        default="auto", description="auto: <think> output goes to reasoning_content; none: all of it in content")
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a raw prompt (text or token ids), no chat template."""

    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP,
                                 description="report each token's log-probability and this many alternatives")


class TokenizeRequest(_Strict):
    """POST /tokenize (llama-server's fields)."""

    content: str
    add_special: bool = False
    parse_special: bool = Field(default=True, description="false: special-token text is tokenized as plain text")
    with_pieces: bool = False


class ExtraChunk(_Strict):
    """One `input_extra` entry of /infill: another file's text as context."""

    text: str = ""
    filename: str = "tmp"


class InfillRequest(SamplingFields):
    """POST /infill (llama-server): fill in between input_prefix and input_suffix."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = Field(default="", description="text appended to the prefix, right before the cursor")
    n_predict: int | None = Field(default=None, description="llama-server name of max_tokens (-1: no cap)")


class DetokenizeRequest(_Strict):
    """POST /detokenize."""

    tokens: list[int]
