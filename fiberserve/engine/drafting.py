"""Draft tokens for speculative decoding by prompt lookup (vLLM's and SGLang's "ngram" method).

The draft is what followed the latest earlier occurrence of the sequence's
last n tokens, longest n first.  Where that continuation runs into the end
of the sequence (a pattern repeating with a short period), it goes on with
the draft itself, so a repeating pattern is drafted as repeating.

No model runs: drafting is a dictionary lookup per step.  The runner checks
the draft in the same forward pass as the sequence's next token (one row per
drafted token) and keeps the drafted tokens up to the first the model would
not have picked, so the output is exactly what decoding one token at a time
gives; see ``FlightItem.accept``.

Each lookup also learns how often its drafts come true (``acceptance``): at
every proposal it checks the previous one against the tokens the sequence
gained since, whether that draft was computed or not (a sequence's tokens
are the same either way: see ``FlightItem.accept``).  So a sequence that drafts nothing, because
its drafts did not look worth their rows, still learns when its text starts
repeating.  The scheduler weighs that rate against what rows cost (policy 5).
"""

from __future__ import annotations

from typing import Protocol

#: Shortest and longest n-grams matched.  One-token matches draft too often on text that does not repeat, spending
#: rows on drafts that rarely come true.
MIN_NGRAM, MAX_NGRAM = 2, 3

#: The acceptance estimate starts at PRIOR_KEPT / PRIOR_CHECKED (one even guess), and every check scales the
#: counts so far by ACCEPTANCE_DECAY first: the estimate follows about the last ten checks, as text starts or
#: stops repeating.
PRIOR_KEPT, PRIOR_CHECKED, ACCEPTANCE_DECAY = 1.0, 2.0, 0.9


class TokenSource(Protocol):
    @property
    def num_tokens(self) -> int: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


class PromptLookup:
    """One sequence's n-gram index and acceptance estimate; ``propose`` reads the tokens the sequence gained
    since the last call.

    Contract: the sequence's tokens only grow (true of prompt and output tokens; drafts never enter them).
    """

    def __init__(self, limit: int) -> None:
        """``limit``: the longest draft proposed (and checked for ``acceptance``)."""
        self.limit = limit
        self.tokens: list[int] = []
        #: For each n, the n-grams seen, each mapped to the index just after its latest occurrence that has a
        #: token after it.
        self.continuation: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_NGRAM, MAX_NGRAM + 1)}
        self.kept, self.checked = PRIOR_KEPT, PRIOR_CHECKED
        self._last: tuple[int, list[int]] | None = None  #: where the latest proposal was made, and what it was

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft token comes true once those before it did (in (0, 1))."""
        return self.kept / self.checked

    def propose(self, seq: TokenSource, k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``seq``'s tokens; empty when its last n tokens never occurred
        before for any n in [MIN_NGRAM, MAX_NGRAM]."""
        self._index(seq)
        end = len(self.tokens)
        if self._last is None or self._last[0] != end:
            self._check_last()
            self._last = (end, self._lookup(self.limit))
        return self._last[1][: max(0, k)]

    def _index(self, seq: TokenSource) -> None:
        tokens = self.tokens
        for token in seq.token_slice(len(tokens), seq.num_tokens):
            end = len(tokens)
            for n, table in self.continuation.items():
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end
            tokens.append(token)

    def _lookup(self, k: int) -> list[int]:
        tokens, end = self.tokens, len(self.tokens)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if k <= 0 or end <= n:
                continue
            start = self.continuation[n].get(tuple(tokens[end - n :]))
            if start is not None:
                draft: list[int] = []
                for i in range(start, start + k):
                    draft.append(tokens[i] if i < end else draft[i - end])
                return draft
        return []

    def _check_last(self) -> None:
        """Score the latest proposal against the tokens that came after it: each draft token up to the first
        wrong one is a check that came true, the wrong one a check that did not; tokens not yet known say
        nothing."""
        if self._last is None:
            return
        where, draft = self._last
        came = self.tokens[where : where + len(draft)]
        kept = 0
        while kept < len(came) and came[kept] == draft[kept]:
            kept += 1
        checked = kept + (kept < len(came))
        if checked:
            self.kept = ACCEPTANCE_DECAY * self.kept + kept
            self.checked = ACCEPTANCE_DECAY * self.checked + checked
