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

How long a draft is adapts to each sequence, as transformers' assisted
generation does ("heuristic" schedule): a sequence starts with short drafts,
each draft kept whole doubles the next one (up to the server's limit), and each
draft the model rejects shortens the next by ``DRAFT_SHRINK``.  Text that
repeats soon drafts at the limit, while text whose drafts keep failing drafts
one token, so a batch carries few rows that are thrown away.
"""

from __future__ import annotations

from typing import Protocol

#: Shortest and longest n-grams matched.  One-token matches draft too often on text that does not repeat
#: (measured on SmolLM2 chat answers: 2.91 rows per step for 1.32 tokens with n >= 1, 1.61 for 1.24 with n >= 2).
MIN_NGRAM, MAX_NGRAM = 2, 3

#: A sequence's first draft length, and how much each rejected draft shortens the next.  Chosen by simulating
#: the schedules on SmolLM2's own greedy outputs (12 benchmark prompts, 12 chat answers) with forward pass times
#: measured per row on 2 AVX2 cores: starting at 2, doubling and shrinking by 2 gave, against a fixed 4, the same
#: to +12% (int4 at 4 sequences on chat answers: 0.93x -> 1.04x of no drafting; bf16 at one sequence on the
#: benchmark: 2.48x -> 2.42x-2.46x); fixed lengths either waste rows on chat or leave tokens on repeating text.
FIRST_DRAFT_TOKENS, DRAFT_SHRINK = 2, 2


class TokenSource(Protocol):
    num_tokens: int

    def token_slice(self, start: int, end: int) -> list[int]: ...


class PromptLookup:
    """One sequence's n-gram index and draft length; ``propose`` reads the tokens the sequence gained since the
    last call, ``feedback`` adapts the length to how its drafts fared.

    Contract: the sequence's tokens only grow (true of prompt and output tokens; drafts never enter them).
    """

    def __init__(self, limit: int, first: int = FIRST_DRAFT_TOKENS) -> None:
        """``limit``: the longest draft; ``first``: the first draft's length (at most ``limit``)."""
        self.limit = limit
        self.length = min(first, limit)  #: the next draft's length, before the caller's bound
        self.tokens: list[int] = []
        #: For each n, the n-grams seen, each mapped to the index just after its latest occurrence that has a
        #: token after it.
        self.continuation: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_NGRAM, MAX_NGRAM + 1)}

    def _index(self, seq: TokenSource) -> None:
        tokens = self.tokens
        for token in seq.token_slice(len(tokens), seq.num_tokens):
            end = len(tokens)
            for n, table in self.continuation.items():
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end
            tokens.append(token)

    def propose(self, seq: TokenSource, k: int) -> list[int]:
        """Up to ``min(k, self.length)`` tokens that may follow ``seq``'s tokens; empty when its last n tokens
        never occurred before for any n in [MIN_NGRAM, MAX_NGRAM]."""
        self._index(seq)
        tokens, end, k = self.tokens, len(self.tokens), min(k, self.length)
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

    def feedback(self, drafted: int, kept: int) -> None:
        """A draft of ``drafted`` tokens was checked and its first ``kept`` were kept: all of them doubles the
        next draft's length (up to ``limit``), fewer shortens it by ``DRAFT_SHRINK`` (to 1 at least)."""
        if kept >= drafted:
            self.length = min(self.limit, 2 * self.length)
        else:
            self.length = max(1, self.length - DRAFT_SHRINK)
