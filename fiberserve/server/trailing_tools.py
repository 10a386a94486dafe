"""``tool_choice: "auto"`` for the families whose calls, once begun, run to the end of the output (vLLM's parser
names):

- ``llama3_json`` (Llama 3.1-3.3): the whole answer is the calls, JSON objects ``{"name": ..., "parameters":
  {...}}`` separated by ``;``, after ``<|python_tag|>`` or not;
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` objects, or (newer
  tokenizers) ``[TOOL_CALLS]name[ARGS]{...}`` once per call;
- ``pythonic`` (Llama 4, Gemma 3 and others prompted for it): the whole answer is a Python list of calls with
  literal keyword arguments, ``[get_weather(city="Paris"), ...]``;
- ``functiongemma`` (Gemma 3 270M's FunctionGemma and models trained on its tokens): content, then one
  ``<start_function_call>call:name{key:value,...}<end_function_call>`` per call, a string value between two
  ``<escape>`` tokens, any other value a number, ``true``, ``false``, ``null``, a ``{...}`` object or a ``[...]``
  list written the same way; the ``<start_function_response>`` that may follow the calls is not part of them.

As with ``hermes`` (``hermes_tools.py``): each call's ``arguments`` is its JSON object as ``json.dumps`` writes it;
content that is only whitespace is None; an output whose calls do not parse is answered as text, whole.
Streamed (:class:`TrailingCallStream`), content goes out as it is generated, except what may begin the calls;
the calls go out whole when the output ends.  Streamed or not, the same text is read the same way: the whole
output is read by the same stream (:func:`split_trailing_calls`).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from fiberserve.server.hermes_tools import call_of, parse_calls
from fiberserve.server.tool_call_scanner import PartialCall


@dataclass(frozen=True)
class TrailingCalls:
    """A family's format: what may begin its calls, whether only at the answer's start, and how its calls
    (from the marker to the end of the output) are read: None where they do not parse."""

    markers: tuple[str, ...]
    at_start_only: bool
    parse: Callable[[str], list[PartialCall] | None]


def _llama3_json(text: str) -> list[PartialCall] | None:
    body, decoder, at = text.removeprefix("<|python_tag|>"), json.JSONDecoder(), 0
    calls: list[PartialCall] = []
    while True:
        while at < len(body) and (body[at].isspace() or (calls and body[at] == ";")):
            at += 1
        if at == len(body):
            return calls or None
        try:
            written, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        if (call := call_of(written)) is None:
            return None
        calls.append(call)


MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def _mistral(text: str) -> list[PartialCall] | None:
    calls = []
    for part in text.split(MISTRAL_CALLS)[1:]:
        if MISTRAL_ARGS in part:  # name[ARGS]{...}
            name, _, arguments = part.partition(MISTRAL_ARGS)
            parsed = call_of({"name": name.strip(), "arguments": arguments.strip()})
            written = [parsed] if parsed is not None else None
        else:
            written = parse_calls(part.strip())
        if not written:
            return None
        calls += written
    return calls or None


def _pythonic(text: str) -> list[PartialCall] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except ValueError:
            return None
        if len(arguments) != len(node.keywords):
            return None
        calls.append(PartialCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


GEMMA_CALL, GEMMA_CALL_END, GEMMA_ESCAPE = "<start_function_call>", "<end_function_call>", "<escape>"
GEMMA_RESPONSE = "<start_function_response>"
_GEMMA_NAME = re.compile(r"\s*call:([\w.\-]+)\{")
_GEMMA_KEY = re.compile(r"\s*([^\s:,{}\[\]<>]+)\s*:")
_GEMMA_SCALAR = re.compile(r"\s*([^,{}\[\]<>]*)")


class _GemmaValues:
    """A reader of FunctionGemma's values from ``at`` in ``text``; each method returns the value and where it
    ends, and raises ValueError where the text is not one."""

    def __init__(self, text: str) -> None:
        self.text = text

    def skip(self, at: int, token: str) -> int:
        while at < len(self.text) and self.text[at].isspace():
            at += 1
        if not self.text.startswith(token, at):
            raise ValueError(f"expected {token!r} at {at}")
        return at + len(token)

    def peek(self, at: int) -> str:
        return self.text[at:].lstrip()[:1]

    def fields(self, at: int) -> tuple[dict[str, object], int]:
        """``key:value,...}`` after an object's ``{``."""
        fields: dict[str, object] = {}
        while self.peek(at) != "}":
            if fields:
                at = self.skip(at, ",")
            if (key := _GEMMA_KEY.match(self.text, at)) is None:
                raise ValueError(f"expected a key at {at}")
            fields[key.group(1)], at = self.value(key.end())
        return fields, self.skip(at, "}")

    def value(self, at: int) -> tuple[object, int]:
        rest = self.text[at:].lstrip()
        at = len(self.text) - len(rest)
        if rest.startswith(GEMMA_ESCAPE):
            end = self.text.find(GEMMA_ESCAPE, at + len(GEMMA_ESCAPE))
            if end < 0:
                raise ValueError("a string that does not end")
            return self.text[at + len(GEMMA_ESCAPE) : end], end + len(GEMMA_ESCAPE)
        if rest.startswith("{"):
            return self.fields(at + 1)
        if rest.startswith("["):
            items: list[object] = []
            at += 1
            while self.peek(at) != "]":
                if items:
                    at = self.skip(at, ",")
                item, at = self.value(at)
                items.append(item)
            return items, self.skip(at, "]")
        scalar = _GEMMA_SCALAR.match(self.text, at)
        assert scalar is not None  # the pattern matches the empty string
        word = scalar.group(1).strip()
        if not word:
            raise ValueError(f"expected a value at {at}")
        try:
            return json.loads(word), scalar.end()  # a number, true, false or null
        except json.JSONDecodeError:
            return word, scalar.end()  # an unquoted word: a string


def _functiongemma(text: str) -> list[PartialCall] | None:
    values, calls, at = _GemmaValues(text), [], 0
    while text[at:].strip() and not text[at:].lstrip().startswith(GEMMA_RESPONSE):
        try:
            at = values.skip(at, GEMMA_CALL)
            if (name := _GEMMA_NAME.match(text, at)) is None:
                return None
            arguments, at = values.fields(name.end())
            at = values.skip(at, GEMMA_CALL_END)
        except ValueError:
            return None
        calls.append(PartialCall(name.group(1), json.dumps(arguments, ensure_ascii=False)))
    return calls or None


#: Each ``--tool-call-parser`` of this kind and its format.
FORMATS = {
    "llama3_json": TrailingCalls(("<|python_tag|>", "{"), at_start_only=True, parse=_llama3_json),
    "mistral": TrailingCalls((MISTRAL_CALLS,), at_start_only=False, parse=_mistral),
    "pythonic": TrailingCalls(("[",), at_start_only=True, parse=_pythonic),
    "functiongemma": TrailingCalls((GEMMA_CALL,), at_start_only=False, parse=_functiongemma),
}


#: What in a chat template shows each family's call format, for ``--tool-call-parser auto``: the first found
#: names the parser.
TEMPLATE_SIGNS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    (GEMMA_CALL, "functiongemma"),
)


def parser_for_template(template: str | None) -> str:
    """The tool-call parser a chat template's own call format asks for; ``none`` where it shows none."""
    return next((parser for sign, parser in TEMPLATE_SIGNS if template and sign in template), "none")


class TrailingCallStream:
    """One streamed choice's output, fed in any pieces: :meth:`feed` returns the content to send now;
    :meth:`finish` the content left and the calls, once the output ends."""

    def __init__(self, calls: TrailingCalls) -> None:
        self.format = calls
        self.pending = ""  # text not yet sent: leading whitespace, a possible marker's start, or the calls
        self.calling = False  # the calls have begun: everything from here on is theirs
        self.answering = False  # content other than whitespace went out: (at_start_only) no calls can follow
        self.calls_made = 0

    def feed(self, text: str) -> tuple[str, list[PartialCall]]:
        self.pending += text
        if self.calling:
            return "", []
        if self.format.at_start_only and not self.answering:
            stripped = self.pending.lstrip()
            if any(stripped.startswith(m) for m in self.format.markers):
                self.calling = True
                return "", []
            if not stripped or any(m.startswith(stripped) for m in self.format.markers):
                return "", []  # whitespace, or maybe a marker: wait for more
            self.answering = True
        if self.format.at_start_only:
            sent, self.pending = self.pending, ""
            return sent, []
        at = min((i for m in self.format.markers if (i := self.pending.find(m)) >= 0), default=-1)
        cut = at if at >= 0 else len(self.pending) - _partial_marker(self.pending, self.format.markers)
        sent = self.pending[:cut]
        if not self.answering and not sent.strip():
            sent = ""  # leading whitespace waits for what follows it
        else:
            self.answering, self.pending = True, self.pending[cut:]
        if at >= 0:
            self.calling, self.pending = True, self.pending[self.pending.find(self.format.markers[0]) :]
        return sent, []

    def finish(self) -> tuple[str, list[PartialCall]]:
        rest, self.pending = self.pending, ""
        if not self.calling:
            return rest, []
        body = rest.lstrip() if self.format.at_start_only else rest
        calls = self.format.parse(body)
        if calls is None:
            return rest, []
        self.calls_made += len(calls)
        return "", calls


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin one of ``markers``."""
    for size in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0


def split_trailing_calls(calls: TrailingCalls, text: str) -> tuple[str | None, list[PartialCall]] | None:
    """A whole output's content (None: only whitespace) and calls; None where it is text (no calls, or calls
    that do not parse)."""
    stream = TrailingCallStream(calls)
    sent, _ = stream.feed(text)
    rest, parsed = stream.finish()
    if not parsed:
        return None
    content = sent + rest
    return (content if content.strip() else None), parsed
