"""Anthropic's Messages API: ``POST /v1/messages`` (streamed with Anthropic's events) and
``/v1/messages/count_tokens``.

A Messages request is served as the chat request it means (``anthropic_protocol.py``), with the chat API's
prompt, parameters and renderer (``openai_api.prepare_chat``); the answer's message becomes content blocks:
``thinking`` (under ``--reasoning-parser``), ``text`` and ``tool_use``.  Streamed, each delta of the chat answer
becomes the events of its block (``content_block_start``, ``content_block_delta`` with ``thinking_delta``,
``text_delta`` or ``input_json_delta``, ``content_block_stop``), between ``message_start`` and
``message_delta`` / ``message_stop``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fiberserve.engine import Request as EngineRequest
from fiberserve.engine.sequence import FinishReason
from fiberserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from fiberserve.server.errors import failure_body, translated
from fiberserve.server.openai_api import prepare_chat
from fiberserve.server.state import ServerState
from fiberserve.server.tools import template_tools

router = APIRouter(prefix="/v1")

#: The chat API's finish reasons as Anthropic's stop reasons (an aborted answer ended its turn early).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
_NAMES = {"max_new_tokens": "max_tokens", "prompt": "messages", "stop": "stop_sequences"}


def _state(request: Request) -> ServerState:
    return request.app.state.fiberserve


def _stop(finish: str | None, matched: str | int | None) -> tuple[str | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a chat answer's finish reason."""
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish or "", finish), None


def _blocks(message: dict) -> list[dict]:
    """A chat answer's message as content blocks."""
    blocks: list[dict] = []
    if message.get("reasoning_content") is not None:
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        blocks.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"], "input": json.loads(function["arguments"])}
        )
    return blocks


def _usage(request: EngineRequest) -> dict:
    return {
        "input_tokens": len(request.prompt_ids),
        "output_tokens": sum(len(s.output_ids) for s in request.seqs),
        "cache_read_input_tokens": max(s.cached_tokens for s in request.seqs),
    }


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


@router.post("/messages")
async def messages(body: MessagesRequest, request: Request) -> Response:
    state = _state(request)
    state.ready_service()
    adapter = state.check_model(body.model)
    prompt, params, render = prepare_chat(state, translated(body.chat_request, _NAMES, "messages"))
    message_id = f"msg_{uuid.uuid4().hex}"
    [engine_request] = state.submit(request, [prompt], params, [message_id], _NAMES, adapter)
    head = {"id": message_id, "type": "message", "role": "assistant", "model": state.name_of(adapter)}
    if body.stream:
        return StreamingResponse(_stream(state, request, engine_request, render, head), media_type="text/event-stream")
    outputs = await state.collect(request, [engine_request])
    if outputs is None:
        return Response(status_code=499)  # the client left; nobody reads this
    output = outputs[0].outputs[0]
    choice = render.choice(state, 0, output, outputs[0])
    stop_reason, stop_sequence = _stop(choice["finish_reason"], output.matched_stop)
    answer = {**head, "content": _blocks(choice["message"]), "stop_reason": stop_reason}
    return JSONResponse(answer | {"stop_sequence": stop_sequence, "usage": _usage(engine_request)})


class _BlockEvents:
    """Turns the chat answer's streamed deltas into content-block events, one block open at a time."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type

    def start(self, block: dict) -> list[str]:
        events = self.stop()
        self.index, self.open = self.index + 1, block["type"]
        return [*events, _event("content_block_start", {"index": self.index, "content_block": block})]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def delta(self, kind: str, delta: dict) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": {"type": kind, **delta}})

    def of(self, delta: dict) -> list[str]:
        events: list[str] = []
        if thinking := delta.get("reasoning_content"):
            if self.open != "thinking":
                events += self.start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self.delta("thinking_delta", {"thinking": thinking}))
        if text := delta.get("content"):
            if self.open != "text":
                events += self.start({"type": "text", "text": ""})
            events.append(self.delta("text_delta", {"text": text}))
        for entry in delta.get("tool_calls") or []:
            function = entry["function"]
            if "id" in entry:  # a new call
                events += self.start({"type": "tool_use", "id": entry["id"], "name": function["name"], "input": {}})
            if function.get("arguments"):
                events.append(self.delta("input_json_delta", {"partial_json": function["arguments"]}))
        return events


async def _stream(state: ServerState, http: Request, request: EngineRequest, render, head: dict) -> AsyncIterator[str]:
    started = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(request)}
    yield _event("message_start", {"message": started})
    blocks = _BlockEvents()
    async for batch in state.merged_events([request], http):
        events: list[str] = []
        for seq, event in batch:
            if event.finished and seq.finish_reason is FinishReason.ERROR:
                error = failure_body(seq.request_id, seq)["error"]
                events.append(_event("error", {"error": {"type": "api_error", "message": error["message"]}}))
                continue
            finish = seq.finish_reason.value if event.finished and seq.finish_reason else None
            choice = render.delta_choice(0, event.delta, finish)
            if choice is not None:
                events += blocks.of(choice["delta"])
            if event.finished:
                stop_reason, stop_sequence = _stop(
                    choice["finish_reason"] if choice else finish, seq.output.matched_stop
                )
                delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
                usage = {"output_tokens": len(seq.output_ids)}
                events += [*blocks.stop(), _event("message_delta", {"delta": delta, "usage": usage})]
                events.append(_event("message_stop", {}))
        if events:
            yield "".join(events)


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    """``{"input_tokens"}``: the prompt's tokens, as ``/v1/messages`` renders it."""
    state = _state(request)
    state.ready_service()
    state.check_model(body.model)
    chat = translated(body.chat, _NAMES, "messages")
    variables = translated(chat.template_variables, _NAMES, "chat_template_kwargs")
    return {"input_tokens": len(state.encode_chat(chat.messages, True, template_tools(chat.tools), variables))}
