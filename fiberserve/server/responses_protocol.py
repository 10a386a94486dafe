"""OpenAI's Responses API bodies (``POST /v1/responses``) and what they mean as a chat request
(``ChatCompletionRequest``), which the engine serves the same way.

``instructions`` is the system message; ``input`` a string (one user message) or items: messages (``role`` user,
system, developer or assistant; ``content`` a string or ``input_text`` / ``output_text`` parts), an earlier
``function_call`` (an assistant's call) and its ``function_call_output`` (the tool's answer); ``reasoning`` items
are left out of the prompt, as the templates leave an earlier answer's thinking.  ``tools`` are flat functions
(``{"type": "function", "name", "parameters"}``), ``tool_choice`` the chat API's; ``max_output_tokens`` its
``max_tokens``; ``reasoning.effort`` its ``reasoning_effort``; ``text.format`` its ``response_format``.  With
``previous_response_id`` the stored conversation of that response comes first (``responses_store.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from fiberserve.engine.sampling_params import InvalidParameter
from fiberserve.server.protocol import ChatCompletionRequest, ChatMessage

_ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``.  Keys of its own that the chat API defines (``top_k``, ``guided_regex``, ...) are
    passed on to it, and refused by it where it refuses them."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: StrictBool = True
    stream: StrictBool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "required", "none"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    # Refused: what the Responses API does beyond a model's answer.
    background: StrictBool | None = None
    conversation: Any = None
    include: list[str] | None = None

    def input_messages(self) -> list[ChatMessage]:
        """This request's own input as chat messages (InvalidParameter naming an item that cannot be one)."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        return [m for i, item in enumerate(self.input) if (m := _message(item, f"input.{i}")) is not None]

    def chat_request(self, history: list[ChatMessage]) -> ChatCompletionRequest:
        """The same request as the chat API's, after the ``history`` of ``previous_response_id``."""
        for key in ("background", "conversation"):
            if getattr(self, key):
                raise InvalidParameter(key, "is not supported")
        if self.include:
            raise InvalidParameter("include", "is not supported")
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        body: dict[str, Any] = {
            **(self.model_extra or {}),
            "messages": _with_calls_merged([*system, *history, *self.input_messages()]),
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "tools": [_function(t, f"tools.{i}") for i, t in enumerate(self.tools or [])] or None,
            "tool_choice": _tool_choice(self.tool_choice),
            "reasoning_effort": (self.reasoning or {}).get("effort"),
            "response_format": _response_format((self.text or {}).get("format")),
        }
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


def _text(content: str | list[dict[str, Any]], field: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidParameter(f"{field}.{j}", f"a {part.get('type')!r} part is not supported: text only")
        texts.append(part["text"])
    return "".join(texts)


def _message(item: dict[str, Any], field: str) -> ChatMessage | None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidParameter(f"{field}.role", f"must be one of {', '.join(_ROLES)}")
        return ChatMessage(role=role, content=_text(item.get("content") or "", f"{field}.content"))
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}  # fmt: skip
        return ChatMessage(role="assistant", content=None, tool_calls=[call])
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output or [], f"{field}.output")
        return ChatMessage(role="tool", content=text, tool_call_id=item.get("call_id"))
    if kind == "reasoning":
        return None
    raise InvalidParameter(f"{field}.type", f"a {kind!r} item is not supported")


def _with_calls_merged(messages: list[ChatMessage]) -> list[ChatMessage]:
    """An assistant's text and the calls that follow it (separate items here) as one assistant message."""
    merged: list[ChatMessage] = []
    for message in messages:
        last = merged[-1] if merged else None
        if message.tool_calls and last is not None and last.role == "assistant":
            last.tool_calls = [*(last.tool_calls or []), *message.tool_calls]
        else:
            merged.append(message)
    return merged


def _function(tool: dict[str, Any], field: str) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidParameter(f"{field}.type", f"a {tool.get('type')!r} tool is not supported: functions only")
    spec = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": spec}


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidParameter("tool_choice", "must be auto, required, none or {'type': 'function', 'name': ...}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as the chat API's ``response_format`` (the schema flat here, nested there)."""
    if spec is None or spec.get("type") in (None, "text"):
        return None
    if spec.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": spec.get("schema")}}
    return spec
