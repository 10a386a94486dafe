"""OpenAI's Responses API: ``POST /v1/responses`` (streamed with its events) and ``GET /v1/responses/{id}``.

A request is served as the chat request it means (``responses_protocol.py``), with the chat API's prompt,
parameters and renderer (``openai_api.prepare_chat``); the answer's message becomes output items: ``reasoning``
(under ``--reasoning-parser``), ``message`` (``output_text``) and ``function_call``.  A response stored (``store``,
the default) can be read back and continued by ``previous_response_id`` while the server keeps it
(``responses_store.py``).  Streamed, each delta of the chat answer becomes the events of its item
(``response.output_item.added``, ``...delta``, ``...done``, ``response.output_item.done``) between
``response.created`` and ``response.completed``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fiberserve.engine import Request as EngineRequest
from fiberserve.engine.sequence import FinishReason
from fiberserve.server.errors import ApiError, failure_body, translated
from fiberserve.server.openai_api import prepare_chat
from fiberserve.server.protocol import ChatCompletionRequest, ChatMessage
from fiberserve.server.responses_protocol import ResponsesRequest
from fiberserve.server.responses_store import ResponseStore, StoredResponse
from fiberserve.server.state import ServerState

router = APIRouter(prefix="/v1")

_NAMES = {"max_new_tokens": "max_output_tokens", "prompt": "input"}


def _state(request: Request) -> ServerState:
    return request.app.state.fiberserve


def _store(request: Request) -> ResponseStore:
    app_state = request.app.state
    if not hasattr(app_state, "responses"):
        app_state.responses = ResponseStore()
    return app_state.responses


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """One response's object as it grows: its head, its output items, and what it stores."""

    def __init__(self, body: ResponsesRequest, chat: ChatCompletionRequest, model: str) -> None:
        self.id = _new_id("resp")
        self.body, self.chat = body, chat
        self.head = {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "model": model,
            "instructions": body.instructions,
            "previous_response_id": body.previous_response_id,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "store": body.store,
            "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "metadata": {},
            "error": None,
        }
        self.output: list[dict] = []

    def body_of(self, status: str, request: EngineRequest | None = None, finish: str | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        usage = None
        if request is not None:
            prompt, produced = len(request.prompt_ids), sum(len(s.output_ids) for s in request.seqs)
            usage = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": max(s.cached_tokens for s in request.seqs)},
                "output_tokens": produced,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + produced,
            }
        status = "incomplete" if incomplete and status == "completed" else status
        return {**self.head, "status": status, "incomplete_details": incomplete, "output": self.output, "usage": usage}

    def keep(self, store: ResponseStore, answered: dict) -> None:
        """Keep the ``answered`` object and the conversation with this answer (``store``, the default), for a
        later read or ``previous_response_id``; the instructions are not carried over, as OpenAI's are not."""
        if not self.body.store:
            return
        answer = [m for item in self.output if (m := _as_message(item)) is not None]
        conversation = self.chat.messages[1:] if self.body.instructions else self.chat.messages
        store.put(self.id, StoredResponse(answered, [*conversation, *answer]))


def _as_message(item: dict) -> ChatMessage | None:
    if item["type"] == "message":
        return ChatMessage(role="assistant", content="".join(part["text"] for part in item["content"]))
    if item["type"] == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
        return ChatMessage(role="assistant", content=None, tool_calls=[call])
    return None


def _items(message: dict) -> list[dict]:
    """A chat answer's message as output items."""
    items: list[dict] = []
    if message.get("reasoning_content") is not None:
        text = message["reasoning_content"]
        items.append({"type": "reasoning", "id": _new_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": text}]})  # fmt: skip
    if message.get("content"):
        items.append(_message_item(message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(_call_item(call["id"], function["name"], function["arguments"], "completed"))
    return items


def _message_item(text: str, status: str, item_id: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status, "role": "assistant",
            "content": [part] if text or status == "completed" else []}  # fmt: skip


def _call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = _state(request)
    state.ready_service()
    adapter = state.check_model(body.model)
    store = _store(request)
    history: list[ChatMessage] = []
    if body.previous_response_id is not None:
        kept = store.get(body.previous_response_id)
        if kept is None:
            message = f"previous_response_id: no response {body.previous_response_id!r} is kept here"
            raise ApiError(404, message, "previous_response_id", kind="not_found")
        history = [m.model_copy() for m in kept.conversation]
    chat = translated(lambda: body.chat_request(history), _NAMES, "input")
    prompt, params, render = prepare_chat(state, chat)
    response = _Response(body, chat, state.name_of(adapter))
    [engine_request] = state.submit(request, [prompt], params, [response.id], _NAMES, adapter)
    if body.stream:
        events = _stream(state, request, engine_request, render, response, store)
        return StreamingResponse(events, media_type="text/event-stream")
    outputs = await state.collect(request, [engine_request])
    if outputs is None:
        return Response(status_code=499)  # the client left; nobody reads this
    choice = render.choice(state, 0, outputs[0].outputs[0], outputs[0])
    response.output = _items(choice["message"])
    answered = response.body_of("completed", engine_request, choice["finish_reason"])
    response.keep(store, answered)
    return JSONResponse(answered)


@router.get("/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict:
    """A stored response's object; 404 once it is not kept."""
    _state(request).ready_service()
    stored = _store(request).get(response_id)
    if stored is None:
        raise ApiError(404, f"response_id: no response {response_id!r} is kept here", "response_id", kind="not_found")
    return stored.body


class _ItemEvents:
    """Turns the chat answer's streamed deltas into the output items' events, one item open at a time."""

    def __init__(self, response: _Response) -> None:
        self.response = response
        self.sequence = 0
        self.open: dict | None = None  # the open item, as it grows

    def event(self, kind: str, **data: Any) -> str:
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.sequence, **data})}\n\n"

    def _where(self) -> dict:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.response.output) - 1}

    def start(self, item: dict) -> list[str]:
        events = self.close()
        self.open = item
        self.response.output.append(item)
        events.append(self.event("response.output_item.added", output_index=len(self.response.output) - 1, item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            item["content"] = [part]
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def close(self) -> list[str]:
        item, events = self.open, list[str]()
        if item is None:
            return events
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", **where, content_index=0, text=part["text"]))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
        else:
            done = {"arguments": item["arguments"]}
            events.append(self.event("response.function_call_arguments.done", **where, **done))
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.open = None
        return events

    def of(self, delta: dict) -> list[str]:
        events: list[str] = []
        if thinking := delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                item = {"type": "reasoning", "id": _new_id("rs"), "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}]}  # fmt: skip
                events += self.start(item)
            assert self.open is not None
            self.open["content"][0]["text"] += thinking
            events.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=thinking))
        if text := delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self.start(_message_item("", "in_progress"))
            assert self.open is not None
            self.open["content"][0]["text"] += text
            where = self._where()
            events.append(self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]))
        for entry in delta.get("tool_calls") or []:
            function = entry["function"]
            if "id" in entry:  # a new call
                events += self.start(_call_item(entry["id"], function["name"], "", "in_progress"))
            if arguments := function.get("arguments"):
                assert self.open is not None
                self.open["arguments"] += arguments
                events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events


async def _stream(
    state: ServerState, http: Request, request: EngineRequest, render, response: _Response, store: ResponseStore
) -> AsyncIterator[str]:
    items = _ItemEvents(response)
    yield items.event("response.created", response=response.body_of("in_progress"))
    yield items.event("response.in_progress", response=response.body_of("in_progress"))
    async for batch in state.merged_events([request], http):
        events: list[str] = []
        for seq, event in batch:
            if event.finished and seq.finish_reason is FinishReason.ERROR:
                error = failure_body(seq.request_id, seq)["error"]
                failed = response.body_of("failed", request) | {"error": {"code": "server_error", **error}}
                events.append(items.event("response.failed", response=failed))
                continue
            finish = seq.finish_reason.value if event.finished and seq.finish_reason else None
            choice = render.delta_choice(0, event.delta, finish)
            if choice is not None:
                events += items.of(choice["delta"])
            if event.finished:
                events += items.close()
                done = response.body_of("completed", request, choice["finish_reason"] if choice else finish)
                response.keep(store, done)
                kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
                events.append(items.event(kind, response=done))
        if events:
            yield "".join(events)
