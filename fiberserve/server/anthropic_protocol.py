"""Anthropic's Messages API bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``) and what they mean as
a chat request (``ChatCompletionRequest``), which the engine serves the same way.

The conversation maps onto the chat template's messages: ``system`` (a string or text blocks) first; a user's
text blocks as its content and each ``tool_result`` block as a ``tool`` message answering its call; an
assistant's text blocks as its content and its ``tool_use`` blocks as its ``tool_calls`` (earlier ``thinking``
blocks are left out, as the templates leave them).  ``tools`` (``input_schema``) become functions;
``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` the chat API's ``auto`` / ``required`` / named /
``none``; ``thinking`` ``enabled`` / ``disabled`` the template's ``enable_thinking``.  Images and documents are
refused by name: the models served read text.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from fiberserve.engine.sampling_params import InvalidParameter
from fiberserve.server.protocol import ChatCompletionRequest, ChatMessage


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class CountTokensRequest(BaseModel):
    """``/v1/messages/count_tokens``: the prompt a Messages request would have."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None

    def chat(self, **sampling: Any) -> ChatCompletionRequest:
        """The same request as the chat API's (InvalidParameter for a block that cannot be a message)."""
        messages = ([ChatMessage(role="system", content=_text(self.system, "system"))] if self.system else []) + [
            m for i, message in enumerate(self.messages) for m in _chat_messages(message, f"messages.{i}")
        ]
        tools = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in self.tools or []
        ]
        body: dict[str, Any] = {"messages": messages, "tools": tools or None, **sampling}
        if (choice := self.tool_choice) is not None:
            if choice.type == "tool" and not choice.name:
                raise InvalidParameter("tool_choice.name", "is required with type 'tool'")
            named = {"type": "function", "function": {"name": choice.name}}
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none", "tool": named}[choice.type]
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type == "enabled"}
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``.  Keys of its own that the chat API defines (``min_p``, ``guided_regex``, ...) are
    passed on to it, and refused by it where it refuses them."""

    model_config = ConfigDict(extra="allow")

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    output_config: dict[str, Any] | None = None  # refused: its structured formats and effort are Claude's
    container: Any = None  # refused: no code-execution container here

    def chat_request(self) -> ChatCompletionRequest:
        for key in ("output_config", "container"):
            if getattr(self, key) is not None:
                raise InvalidParameter(key, "is not supported")
        return self.chat(
            **(self.model_extra or {}),
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stream=self.stream,
        )


def _text(content: str | list[dict[str, Any]], field: str) -> str:
    """Text content: a string, or text blocks joined."""
    if isinstance(content, str):
        return content
    for i, block in enumerate(content):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise InvalidParameter(f"{field}.{i}", f"a {block.get('type')!r} block is not supported here: text only")
    return "".join(block["text"] for block in content)


def _chat_messages(message: AnthropicMessage, field: str) -> list[ChatMessage]:
    """One Anthropic message as the chat template's messages."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[ChatMessage] = []
    for i, block in enumerate(message.content):
        kind, where = block.get("type"), f"{field}.content.{i}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append({"id": block.get("id"), "type": "function", "function": {"name": block.get("name"),
                                                                                  "arguments": arguments}})  # fmt: skip
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content") or ""
            result = _text(content, f"{where}.content") if isinstance(content, list | str) else str(content)
            results.append(ChatMessage(role="tool", content=result, tool_call_id=block.get("tool_use_id")))
        elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue
        else:
            raise InvalidParameter(where, f"a {kind!r} block is not supported in a {message.role}'s message")
    if message.role == "assistant":
        return [ChatMessage(role="assistant", content="".join(texts) or None, tool_calls=calls or None)]
    return results + ([ChatMessage(role="user", content="".join(texts))] if texts or not results else [])
