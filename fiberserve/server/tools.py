"""Tool calls for chat completions, made the way vLLM makes them without a model-specific parser: the grammar
machinery (engine/grammar.py) constrains the output to the call's JSON, so the call always parses.

``tool_choice``:

- ``"none"`` (the default without tools): a plain answer.  The tools still reach the chat template, as in vLLM.
- ``{"type": "function", "function": {"name": N}}``: the output is N's arguments, a JSON object matching N's
  ``parameters`` schema; the answer is one call to N, ``finish_reason`` ``"stop"`` (as OpenAI answers a forced
  function).
- ``"required"``: the output is a JSON array of ``{"name", "parameters"}`` objects, each a listed tool with its
  arguments (one object only with ``parallel_tool_calls: false``); ``finish_reason`` ``"tool_calls"``.
- ``"auto"`` (the default with tools) is refused with a 400: choosing between text and a call takes the
  model's own tool-call format and a parser for it, which this server does not have (vLLM answers the same
  without ``--tool-call-parser``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fiberserve.engine.grammar import GrammarSpec
from fiberserve.engine.sampling_params import InvalidParameter

#: What a function without ``parameters`` takes: nothing (OpenAI's "empty parameter list").
NO_PARAMETERS = {"type": "object", "properties": {}}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionSpec(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object


class ToolSpec(_Lenient):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_mode(tools: list[ToolSpec] | None, choice: ToolChoice | None) -> str | None:
    """``"named"``, ``"required"`` or None (a plain answer); :class:`InvalidParameter` for what is refused."""
    if not tools:
        if choice is not None and choice != "none":
            raise InvalidParameter("tools", "tool_choice other than 'none' needs tools")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidParameter("tools", "function names must be unique")
    if choice is None or choice == "auto":
        raise InvalidParameter(
            "tool_choice",
            "'auto' (the default when tools are given) needs a tool-call parser for this model, which this server "
            "does not have; use 'required', a named function, or 'none'",
        )
    if choice == "none":
        return None
    if choice == "required":
        return "required"
    if choice.function.name not in names:
        raise InvalidParameter("tool_choice", f"function {choice.function.name!r} is not among the tools")
    return "named"


def template_tools(tools: list[ToolSpec] | None) -> list[dict] | None:
    """The tools as a chat template takes them."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def tool_grammar(tools: list[ToolSpec], choice: ToolChoice, parallel: bool) -> GrammarSpec:
    """The grammar a ``required`` or named ``tool_choice`` puts on the output (see the module's docstring)."""
    if isinstance(choice, NamedToolChoice):
        function = next(t.function for t in tools if t.function.name == choice.function.name)
        return GrammarSpec("json_schema", json.dumps(function.parameters or NO_PARAMETERS), "tools")
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return GrammarSpec("json_schema", json.dumps(schema), "tools")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(index: int | None, name: str, arguments: str) -> dict:
    """One entry of a message's ``tool_calls`` (with its ``index``, as a streamed delta carries it)."""
    call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def parse_required(text: str) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON) of each call in a ``required`` output; None if it is cut short (the grammar
    guarantees the rest)."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [(c["name"], json.dumps(c["parameters"])) for c in calls]


class ToolCallRenderer:
    """Turns one choice's output into its message, or its streamed text into deltas, for a tool mode."""

    def __init__(self, mode: str, name: str | None) -> None:
        self.mode, self.name = mode, name
        self.texts: dict[int, str] = {}

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The answer's message and finish reason for an output ``text``."""
        if self.mode == "named":
            return {"role": "assistant", "content": None, "tool_calls": [tool_call(None, self.name, text)]}, finish
        calls = parse_required(text)
        if calls is None:  # cut short: what there is, as text
            return {"role": "assistant", "content": text}, finish
        message = {"role": "assistant", "content": None, "tool_calls": [tool_call(None, n, a) for n, a in calls]}
        return message, "tool_calls" if finish == "stop" else finish

    def delta(self, index: int, text: str, finish: str | None, first: bool) -> tuple[dict, str | None] | None:
        """The streamed delta for a choice's next ``text``, and its finish reason; None to hold it back (a
        ``required`` output goes out whole when it ends, once it parses)."""
        if self.mode == "named":
            if first:
                call = tool_call(0, self.name, text)
                return {"role": "assistant", "content": None, "tool_calls": [call]}, finish
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), finish
        self.texts[index] = self.texts.get(index, "") + text
        if finish is None:
            return None
        message, finish = self.message(self.texts.pop(index), finish)
        if "tool_calls" in message:
            message["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        return message, finish
