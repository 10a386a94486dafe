"""Tool calls for chat completions, made the way vLLM makes them without a model-specific parser: the grammar
machinery (engine/grammar.py) constrains the output to the call's JSON, so the call always parses.

``tool_choice``:

- ``"none"`` (the default without tools): a plain answer.  The tools still reach the chat template, as in vLLM.
- ``{"type": "function", "function": {"name": N}}``: the output is N's arguments, a JSON object matching N's
  ``parameters`` schema; the answer is one call to N, ``finish_reason`` ``"stop"`` (as OpenAI answers a forced
  function).
- ``"required"``: the output is a JSON array of ``{"name", "parameters"}`` objects, each a listed tool with its
  arguments (one object only with ``parallel_tool_calls: false``); ``finish_reason`` ``"tool_calls"``.  Streamed,
  each call goes out as soon as its name is complete, then its arguments piece by piece, as vLLM streams them
  (``tool_call_scanner.py``).

In both modes a call's ``arguments`` is the parameters' JSON text as generated, with ``json.dumps``'s spacing
(``JsonSpacing``), streamed or not.
- ``"auto"`` (the default with tools): the model chooses between text and calls, in its own format, which
  ``--tool-call-parser`` names (``hermes``: ``hermes_tools.py``; ``llama3_json``, ``mistral``, ``pythonic``,
  ``functiongemma``: ``trailing_tools.py``).  Without one it is refused with a 400, as vLLM
  refuses it without ``--enable-auto-tool-choice --tool-call-parser``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fiberserve.engine.grammar import GrammarSpec
from fiberserve.engine.sampling_params import InvalidParameter
from fiberserve.server.hermes_tools import HermesStream, split_calls
from fiberserve.server.tool_call_scanner import CallScanner, JsonSpacing, PartialCall
from fiberserve.server.trailing_tools import FORMATS, TrailingCallStream, split_trailing_calls

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


def tool_mode(tools: list[ToolSpec] | None, choice: ToolChoice | None, parser: str = "none") -> str | None:
    """``"named"``, ``"required"``, ``"auto"`` (under a ``parser``) or None (a plain answer);
    :class:`InvalidParameter` for what is refused."""
    if not tools:
        if choice is not None and choice != "none":
            raise InvalidParameter("tools", "tool_choice other than 'none' needs tools")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidParameter("tools", "function names must be unique")
    if (choice is None or choice == "auto") and parser != "none":
        return "auto"
    if choice is None or choice == "auto":
        raise InvalidParameter(
            "tool_choice",
            "'auto' (the default when tools are given) needs the server started with --tool-call-parser (the "
            "model family's call format: hermes, llama3_json, mistral, pythonic or functiongemma); use 'required', "
            "a named function, or 'none'",
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


def _called(finish: str | None) -> str | None:
    """An answer with calls that stopped by itself ends with ``"tool_calls"``, as OpenAI's do."""
    return "tool_calls" if finish == "stop" else finish


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(index: int | None, name: str | None, arguments: str) -> dict:
    """One entry of a message's ``tool_calls`` (with its ``index``, as a streamed delta carries it)."""
    call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def required_calls(text: str) -> list[PartialCall] | None:
    """The calls of a whole ``required`` output (raw arguments, see the module docstring); None if it is cut
    short (the grammar guarantees the rest)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return None
    scanner = CallScanner()
    scanner.feed(text)
    return scanner.calls


class ToolCallRenderer:
    """Turns one choice's output into its message, or its streamed text into deltas, for a tool mode."""

    def __init__(self, mode: str, name: str | None, parser: str = "hermes") -> None:
        """``parser``: the ``--tool-call-parser`` that reads an ``auto`` mode's calls."""
        self.mode, self.name = mode, name
        self.trailing = FORMATS.get(parser)  # the parser's format, where it is not hermes
        self.spacings: dict[int, JsonSpacing] = {}  # per streamed choice (named mode)
        self.scanners: dict[int, CallScanner] = {}  # per streamed choice (required mode)
        self.sent: dict[int, list[int]] = {}  # per streamed choice: how much of each call's arguments went out
        self.auto_streams: dict[int, HermesStream | TrailingCallStream] = {}  # per streamed choice (auto mode)

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The answer's message and finish reason for an output ``text``."""
        if self.mode == "auto":
            split = split_calls(text) if self.trailing is None else split_trailing_calls(self.trailing, text)
            if split is None:
                return {"role": "assistant", "content": text}, finish
            content, calls = split
            tool_calls = [tool_call(None, c.name, c.arguments) for c in calls]
            return {"role": "assistant", "content": content, "tool_calls": tool_calls}, _called(finish)
        if self.mode == "named":
            call = tool_call(None, self.name, JsonSpacing().feed(text))
            return {"role": "assistant", "content": None, "tool_calls": [call]}, finish
        required = required_calls(text)
        if required is None:  # cut short: what there is, as text
            return {"role": "assistant", "content": text}, finish
        tool_calls = [tool_call(None, c.name, c.arguments) for c in required]
        message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
        return message, _called(finish)

    def delta(self, index: int, text: str, finish: str | None, first: bool) -> tuple[dict, str | None] | None:
        """The streamed delta for a choice's next ``text``, and its finish reason; None when there is nothing to
        send yet.  Each call's first entry carries its id and name; later ones, more of its arguments."""
        if self.mode == "named":
            return self._named_delta(index, text, finish, first)
        if self.mode == "auto":
            return self._auto_delta(index, text, finish, first)
        scanner = self.scanners.setdefault(index, CallScanner())
        sent = self.sent.setdefault(index, [])
        scanner.feed(text)
        entries = []
        for i, call in enumerate(scanner.calls):
            if call.name is None:  # named once its name is complete; the calls after it are not begun
                break
            if i == len(sent):
                entries.append(tool_call(i, call.name, call.arguments))
                sent.append(len(call.arguments))
            elif len(call.arguments) > sent[i]:
                entries.append({"index": i, "function": {"arguments": call.arguments[sent[i] :]}})
                sent[i] = len(call.arguments)
        delta: dict = {"role": "assistant", "content": None} if first else {}
        if entries:
            delta["tool_calls"] = entries
        if finish is None:
            return (delta, None) if delta else None
        del self.scanners[index], self.sent[index]
        return delta, _called(finish) if required_calls(scanner.text) is not None else finish

    def _auto_delta(self, index: int, text: str, finish: str | None, first: bool) -> tuple[dict, str | None] | None:
        stream = self.auto_streams.setdefault(
            index, HermesStream() if self.trailing is None else TrailingCallStream(self.trailing)
        )
        before = stream.calls_made
        content, calls = stream.feed(text)
        if finish is not None:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
            del self.auto_streams[index]
        delta: dict = {"role": "assistant", "content": content} if first else {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [tool_call(before + i, c.name, c.arguments) for i, c in enumerate(calls)]
        if finish is None:
            return (delta, None) if delta else None
        return delta, _called(finish) if stream.calls_made else finish

    def _named_delta(self, index: int, text: str, finish: str | None, first: bool) -> tuple[dict, str | None] | None:
        arguments = self.spacings.setdefault(index, JsonSpacing()).feed(text)
        if finish is not None:
            del self.spacings[index]
        if first:
            return {"role": "assistant", "content": None, "tool_calls": [tool_call(0, self.name, arguments)]}, finish
        if not arguments:
            return ({}, finish) if finish is not None else None
        return {"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}, finish
