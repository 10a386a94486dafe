"""Reads tool-call outputs as they are generated: :class:`JsonSpacing` and :class:`CallScanner`.

A ``required`` output is ``[{"name": ..., "parameters": {...}}, ...]``, and the grammar (``tools.tool_grammar``)
guarantees it is that JSON, so the scanner only tracks where each call's name and parameters lie: nesting depth,
strings and their escapes, and the keys of each call object.  It reads every character once, however the text
arrives (:meth:`CallScanner.feed`), and at any point :attr:`CallScanner.calls` holds each call begun so far: its
name once that string is complete, and its arguments so far.  The arguments are the parameters' JSON text as
generated, spaced by :class:`JsonSpacing`: a call's arguments only ever grow, so streamed in pieces they add up to
the arguments the whole answer carries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_OPEN, _CLOSE = "[{", "]}"
_CALL_DEPTH = 2  # inside the array (1), inside a call object (2)


class JsonStrings:
    """Where each character of JSON text falls: inside a string (its quotes included) or between tokens."""

    def __init__(self) -> None:
        self.in_string = self._escaped = False

    def read(self, char: str) -> bool:
        """Take the next character; True if it belongs to a string."""
        if self.in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self.in_string = False
            return True
        self.in_string = char == '"'
        return self.in_string


class JsonSpacing:
    """JSON text, fed in any pieces, with ``json.dumps``'s whitespace between tokens: none, and one space after
    each ``,`` and ``:`` (the model often pretty-prints).  Strings are copied as they are."""

    def __init__(self) -> None:
        self._strings = JsonStrings()

    def feed(self, piece: str) -> str:
        out = []
        for char in piece:
            if not self._strings.read(char):
                if char.isspace():
                    continue
                if char in ",:":
                    char += " "
            out.append(char)
        return "".join(out)


@dataclass
class PartialCall:
    name: str | None = None
    arguments: str = ""
    spacing: JsonSpacing = field(default_factory=JsonSpacing, repr=False)


class CallScanner:
    """Feed the output's text in any pieces; :attr:`calls` is what has been read so far."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[PartialCall] = []
        self._depth = 0
        self._strings = JsonStrings()
        self._expect_key = False  # at the call object's level: the next string is a key
        self._key: str | None = None  # the key whose value is being read
        self._key_start = -1  # where the key string being read starts
        self._value_start = -1  # where the current value starts (-1: not begun)

    def feed(self, piece: str) -> None:
        start = len(self.text)
        self.text += piece
        for at in range(start, len(self.text)):
            self._read(at, self.text[at])

    @property
    def _in_arguments(self) -> bool:
        return self._key == "parameters" and self._value_start >= 0

    def _keep(self, char: str) -> None:
        """Add a character of the parameters' text to the call's arguments."""
        call = self.calls[-1]
        call.arguments += call.spacing.feed(char)

    def _read(self, at: int, char: str) -> None:
        if self._strings.in_string:  # a character of a string, or its closing quote
            self._strings.read(char)
            if self._in_arguments:
                self._keep(char)
            if not self._strings.in_string and self._depth == _CALL_DEPTH:
                self._string_closed(at)
            return
        if self._strings.read(char):  # an opening quote
            if self._depth == _CALL_DEPTH and self._expect_key:
                self._key_start = at
                return
        elif char.isspace():
            return
        at_call_level = self._depth == _CALL_DEPTH
        if char in _CLOSE:
            self._depth -= 1
            if self._in_arguments and self._depth >= _CALL_DEPTH:
                self._keep(char)
            if self._value_start >= 0 and self._depth == _CALL_DEPTH:
                self._end_value(at + 1)
            elif self._value_start >= 0 and self._depth == 1:  # a bare value (a number) ends at the '}'
                self._end_value(at)
            return
        if at_call_level and char == ":":
            self._expect_key = False
            return
        if at_call_level and char == ",":
            if self._value_start >= 0:
                self._end_value(at)
            self._expect_key = True
            return
        if char == "{" and self._depth == 1:
            self.calls.append(PartialCall())
            self._expect_key = True
        if at_call_level:
            self._begin_value(at)
        if self._in_arguments:
            self._keep(char)
        if char in _OPEN:
            self._depth += 1

    def _string_closed(self, at: int) -> None:
        if self._expect_key:
            self._key = json.loads(self.text[self._key_start : at + 1])
        else:
            self._end_value(at + 1)

    def _begin_value(self, at: int) -> None:
        if self._value_start < 0:
            self._value_start = at

    def _end_value(self, end: int) -> None:
        if self._key == "name":
            self.calls[-1].name = json.loads(self.text[self._value_start : end])
        self._key, self._value_start = None, -1
