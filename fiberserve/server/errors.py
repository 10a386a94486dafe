"""One error shape for every endpoint (OpenAI's): ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from fiberserve.engine import InvalidParameter, QueueFull, RequestFailed
from fiberserve.engine.sequence import Sequence

T = TypeVar("T")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers


def error_body(message: str, kind: str, param: str | None = None, code: int | str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def failure_body(request_id: str, seq: Sequence) -> dict:
    """The error event of a streamed sequence that failed: a server error, or the client's where its own
    constraint could not be met (``seq.error_status`` 400)."""
    kind = "invalid_request_error" if seq.error_status < 500 else "server_error"
    return error_body(f"request {request_id} failed: {seq.error}", kind, code=seq.error_status)


def failure(request_id: str, seq: Sequence) -> ApiError:
    """The HTTP error of a non-streamed request whose sequence ``seq`` failed (see :func:`failure_body`)."""
    return ApiError(seq.error_status, f"request {request_id} failed: {seq.error}")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.kind, err.param, err.status), err.status, headers=err.headers)


def translated(build: Callable[[], T], rename: dict[str, str], whole: str) -> T:
    """``build()``, a request translated into another's body (the Anthropic and Responses APIs' into the chat
    API's): its refusals as a 400 naming the field (``whole`` where a validation error names none)."""
    try:
        return build()
    except InvalidParameter as exc:
        raise from_engine(exc, rename) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or whole
        raise ApiError(400, f"{field}: {first['msg']}", field) from None


def from_engine(exc: Exception, rename: dict[str, str] | None = None) -> ApiError:
    """Map the engine's refusals to HTTP: bad parameters 400, a full queue 503 with Retry-After, a failed
    request its sequence's status (:func:`failure`)."""
    if isinstance(exc, InvalidParameter):
        field = (rename or {}).get(exc.field, exc.field)
        message = str(exc).replace(exc.field, field, 1)
        return ApiError(400, message, field)
    if isinstance(exc, QueueFull):
        return ApiError(503, str(exc), kind="overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, RequestFailed):
        return failure(exc.request_id, exc.seq)
    raise exc


async def handle_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc)


async def handle_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or "body"
    if first.get("type") == "json_invalid":
        message = "the body is not valid JSON (or not UTF-8)"
        field = "body"
    else:
        message = f"{field}: {first.get('msg', 'invalid value')}"
    return error_response(ApiError(400, message, field))


async def handle_http_error(request: Request, exc) -> JSONResponse:
    """Routing errors (404 unknown path, 405 wrong method) in the same shape as every other error."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind))


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Never a stack trace to the client; the log has it.
    import logging

    logging.getLogger("fiberserve.server").exception("unhandled error on %s", request.url.path)
    return error_response(ApiError(500, "internal server error"))
