"""Stop regular expressions (SGLang's ``stop_regex``), matched in time linear in a bounded tail of the text.

A pattern is compiled by RE2 (``google-re2``), whose automata never backtrack: ``(a+)+b`` over a long run of
``a`` costs what ``a+b`` does, so no request's pattern can stall the event loop that streams every other
request.  RE2's syntax is Python's without backreferences and lookaround; a pattern that uses them is refused.

Each check looks only at the text that may hold a match ending in the characters added since the last check:
the new characters and the pattern's reach before them.  The reach is the longest text a match can span, or
:data:`WINDOW` characters for a pattern with no bound (``a.*b``): a match of such a pattern is found only
where it lies within the last :data:`WINDOW` characters when it completes.  The character before the tail is
kept as context, so ``^`` and ``\\b`` mean what they mean over the whole text.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import re2

if sys.version_info >= (3, 11):
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
else:  # pragma: no cover
    import sre_constants
    import sre_parse

#: The longest text, in characters, that a match of a pattern with no bound of its own may span.
WINDOW = 1024


@dataclass(frozen=True)
class StopRegex:
    """One compiled stop pattern; ``reach`` bounds the characters a match spans (at most :data:`WINDOW`)."""

    pattern: str
    compiled: Any
    reach: int

    def search_tail(self, text: str, fresh: int) -> bool:
        """Whether ``text`` has a match ending in its last ``fresh`` characters (those not checked before)."""
        start = max(0, len(text) - fresh - self.reach + 1)
        if start == 0:
            return self.compiled.search(text) is not None
        return self.compiled.search(text[start - 1 :], 1) is not None


class StopRegexError(ValueError):
    """A pattern RE2 does not compile; the message says why."""


@functools.lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> StopRegex:
    """The compiled pattern (cached: clients repeat theirs); :class:`StopRegexError` if RE2 refuses it."""
    options = re2.Options()
    options.log_errors = False
    try:
        compiled = re2.compile(pattern, options)
    except re2.error as exc:
        message = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise StopRegexError(
            f"{pattern!r} does not compile as an RE2 (linear-time) regular expression: {message}"
        ) from None
    return StopRegex(pattern, compiled, _reach(pattern))


def _reach(pattern: str) -> int:
    """The longest match of ``pattern`` in characters, at most :data:`WINDOW` (the window where unbounded or
    where Python's parser reads RE2's syntax differently)."""
    try:
        longest = sre_parse.parse(pattern).getwidth()[1]
    except Exception:  # RE2-only syntax such as \pL or \C: no bound known
        return WINDOW
    return WINDOW if longest >= sre_constants.MAXREPEAT else max(1, min(int(longest), WINDOW))
