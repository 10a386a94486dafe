"""``tool_choice: "auto"`` under ``--tool-call-parser hermes``: the model chooses between text and calls, and
writes each call as Hermes-format models (Qwen2.5, Hermes 2 and 3, ...) are trained to, a JSON object in tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Nothing constrains the output here (unlike ``required`` and named choices, ``tools.py``).  As vLLM's ``hermes``
parser reads it:

- the message's content is the text before the first ``<tool_call>`` (None when that is only whitespace); text
  between or after the calls is dropped;
- a call ends at the first ``</tool_call>`` outside its JSON strings (vLLM's ends at the first one);
- each call's ``arguments`` is its JSON object as ``json.dumps`` writes it (``"parameters"`` is read as
  ``"arguments"``, and arguments written as a JSON string are parsed); a last call without its closing tag
  still counts; a pair of tags may also hold a list of calls, as SmolLM2's function-calling prompt asks;
- an output with a call that does not parse is answered as text, whole; ``finish_reason`` is ``"tool_calls"``
  when there are calls and the output stopped by itself.

Streamed (:class:`HermesStream`), content goes out as it is generated, except a tail that could be the start of
``<tool_call>``; each call goes out whole, id, name and arguments in one delta, once its closing tag arrives.
A streamed call that does not parse goes out as content (calls sent before it cannot be taken back).
"""

from __future__ import annotations

import json

from fiberserve.server.tool_call_scanner import JsonStrings, PartialCall

START, END = "<tool_call>", "</tool_call>"


def call_of(written: object) -> PartialCall | None:
    """``{"name": str, "arguments": object}`` as a call, else None."""
    if not isinstance(written, dict) or not isinstance(written.get("name"), str):
        return None
    arguments = written.get("arguments", written.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return PartialCall(written["name"], json.dumps(arguments, ensure_ascii=False))


def parse_calls(body: str) -> list[PartialCall] | None:
    """The calls written between one pair of tags: a call object, or a non-empty list of them (the format
    SmolLM2's function-calling prompt asks for); None if any does not parse."""
    try:
        written = json.loads(body)
    except json.JSONDecodeError:
        return None
    calls = [call_of(w) for w in (written if isinstance(written, list) and written else [written])]
    parsed = [call for call in calls if call is not None]
    return parsed if len(parsed) == len(calls) else None


def _call_end(text: str, begin: int, strings: JsonStrings) -> tuple[int, int]:
    """Where the call body from ``begin`` ends: (the index of its ``</tool_call>``, or -1; where to read on).

    The closing tag is the first one outside the body's JSON strings (``strings`` carries that state between
    calls on a growing text); a tail that may be its start is left unread."""
    for i in range(begin, len(text)):
        if not strings.in_string and text[i] == "<":
            if text.startswith(END, i):
                return i, i
            if END.startswith(text[i:]):
                return -1, i
        strings.read(text[i])
    return -1, len(text)


def split_calls(text: str) -> tuple[str | None, list[PartialCall]] | None:
    """A whole output's content and calls; None where it is text (no call, or one that does not parse)."""
    first = start = text.find(START)
    if first < 0:
        return None
    calls = []
    while start >= 0:
        body = start + len(START)
        end, _ = _call_end(text, body, JsonStrings())
        written = parse_calls(text[body:end] if end >= 0 else text[body:])
        if written is None:
            return None
        calls += written
        start = text.find(START, end + len(END)) if end >= 0 else -1
    content = text[:first]
    return (content if content.strip() else None), calls


def _tag_start(text: str) -> int:
    """Where the longest tail of ``text`` that begins ``<tool_call>`` starts (len(text): no such tail)."""
    for begin in range(max(0, len(text) - len(START) + 1), len(text)):
        if START.startswith(text[begin:]):
            return begin
    return len(text)


class HermesStream:
    """One streamed choice's output, fed in any pieces: :meth:`feed` returns the content to send now and the
    calls completed; :meth:`finish` what is left once the output ends."""

    def __init__(self) -> None:
        self.pending = ""  # text not yet classified: a possible tag's start, or a call's body so far
        self.in_call = False
        self.strings = JsonStrings()  # inside a call: where its JSON strings are, up to
        self.read = 0  # this index of pending
        self.called = False  # a call has begun: from then on only calls are sent
        self.held: str | None = ""  # leading whitespace, sent only if content follows it (None: sent)
        self.calls_made = 0

    def feed(self, text: str) -> tuple[str, list[PartialCall]]:
        self.pending += text
        content: list[str] = []
        calls: list[PartialCall] = []
        while True:
            if self.in_call:
                end, self.read = _call_end(self.pending, self.read, self.strings)
                if end < 0:
                    break
                self._close(self.pending[: end + len(END)], content, calls)
                self.pending = self.pending[end + len(END) :]
                continue
            start = self.pending.find(START)
            cut = start if start >= 0 else _tag_start(self.pending)
            if not self.called:
                content.append(self.pending[:cut])
            self.pending = self.pending[cut:]
            if start < 0:
                break
            self.pending, self.in_call, self.called = self.pending[len(START) :], True, True
            self.strings, self.read = JsonStrings(), 0
        return self._content("".join(content)), calls

    def finish(self) -> tuple[str, list[PartialCall]]:
        rest, self.pending = self.pending, ""
        content: list[str] = []
        calls: list[PartialCall] = []
        if self.in_call:
            self._close(rest, content, calls)
        elif not self.called:
            content.append(rest)
        text = self._content("".join(content))
        if self.held and not self.called:  # an output of whitespace alone is its own content, as unstreamed
            text, self.held = self.held + text, None
        return text, calls

    def _close(self, written: str, content: list[str], calls: list[PartialCall]) -> None:
        """The call written after ``<tool_call>`` (its closing tag too, if it came) becomes a call, or content."""
        self.in_call = False
        parsed = parse_calls(written.removesuffix(END))
        if parsed is None:
            content.append(START + written)
        else:
            calls += parsed
            self.calls_made += len(parsed)

    def _content(self, text: str) -> str:
        """Leading whitespace is held back until something else follows it, so that an output that is only calls
        has no content, streamed or not."""
        if self.held is None:
            return text
        if not text.strip():
            self.held += text
            return ""
        text, self.held = self.held + text, None
        return text
