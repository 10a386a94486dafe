"""ASGI middleware: API key check, body size limit, and one log line + metrics per request."""

from __future__ import annotations

import hmac
import json
import logging
import time

from fiberserve.server.errors import error_body
from fiberserve.server.state import ServerState, sanitize

log = logging.getLogger("fiberserve.access")


async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class _BodyTooLarge(Exception):
    pass


#: Where the built-in chat page is served (``--webui``).
WEBUI_PATH = "/"


class GuardMiddleware:
    """Refuses unauthorized requests (401) and oversized bodies (413) before any endpoint runs.

    Logs one line per request when its response has been sent completely:
    method, path, status, latency, prompt and completion tokens, request id.
    """

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self.expected = f"Bearer {key}".encode() if key else None
        # The chat page holds no data: it is served to anyone, and its requests carry the key the user types.
        self.open_paths = {*state.config.open_paths, *((WEBUI_PATH,) if state.config.webui else ())}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        outcome = {"status": 500}
        scope.setdefault("state", {})

        async def logged_send(message):
            if message["type"] == "http.response.start":
                outcome["status"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self._log(scope, path, outcome["status"], started)

        if self.expected and path not in self.open_paths:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await _send_json(
                    logged_send,
                    401,
                    error_body("a valid API key is required: Authorization: Bearer <key>", "authentication_error"),
                    [(b"www-authenticate", b"Bearer")],
                )
        if scope.get("method") == "POST" and b"json" not in headers.get(b"content-type", b""):
            # Every body here is JSON: accept it from clients that omit the header (curl -d).
            headers[b"content-type"] = b"application/json"
            scope["headers"] = list(headers.items())
        limit = self.state.config.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _send_json(
                logged_send,
                413,
                error_body(
                    f"body: {int(declared)} bytes is over the limit of {limit} bytes", "invalid_request_error", "body"
                ),
            )
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, logged_send)
        except _BodyTooLarge:
            await _send_json(
                logged_send, 413, error_body(f"body: over the limit of {limit} bytes", "invalid_request_error", "body")
            )

    def _log(self, scope, path: str, status: int, started: float) -> None:
        state = scope.get("state") or {}
        latency = time.perf_counter() - started
        metrics = self.state.metrics
        if metrics is not None and path != "/metrics":
            metrics.requests.labels(path if path in _KNOWN else "other", str(status)).inc()
        ids = state.get("request_ids") or []
        log.info(
            "%s %s %d %.1fms prompt_tokens=%s completion_tokens=%s%s",
            scope.get("method"),
            sanitize(path, 100),
            status,
            latency * 1000,
            state.get("prompt_tokens", 0),
            state.get("completion_tokens", 0),
            f" rid={sanitize(ids[0])}" + (f" (+{len(ids) - 1})" if len(ids) > 1 else "") if ids else "",
        )


_KNOWN = {
    "/generate",
    "/health",
    "/get_model_info",
    "/model_info",
    "/get_server_info",
    "/server_info",
    "/flush_cache",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/metrics",
}
