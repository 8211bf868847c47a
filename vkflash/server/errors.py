"""OpenAI-style error objects: every failure a client can see is `{"error": {message, type, param,
code}}` with a status that says whose fault it was (4xx: the request; 5xx/503: the server)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

TYPES = {401: "authentication_error", 503: "unavailable_error"}  # other 4xx: invalid_request_error, 5xx: server_error


class ApiError(Exception):
    """An error answer: HTTP status, message, offending parameter, machine code, extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        kind = TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        """As an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """A 400 naming the first bad field of a pydantic/FastAPI validation failure."""
    if not errors:
        return ApiError(400, "invalid request")
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}",
                        code="invalid_json")
    field = ".".join(loc) or "body"
    got = e.get("input")
    shown = repr(got) if not isinstance(got, dict) else "an object"
    if len(shown) > 60:
        shown = shown[:57] + "..."
    msg = f"{field}: {e.get('msg', 'invalid')}" + ("" if e.get("type") == "missing" else f" (got {shown})")
    return ApiError(400, msg, param=loc[0] if loc else None, code="invalid_value")


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}}}


def document_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI schema as the server answers: a bad body is a 400 with an error object (FastAPI's
    generated 422 and its validation schemas never happen here)."""
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    comps["ErrorResponse"] = ERROR_SCHEMA
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            responses = op.get("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {"description": "Invalid request", **ref}
    return schema
