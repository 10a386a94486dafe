"""Prompt lookup drafting (no model): what it proposes, that it follows a growing sequence, and how long its
drafts are."""

from __future__ import annotations

from dataclasses import dataclass, field

from fiberserve.engine.drafting import FIRST_DRAFT_TOKENS, PromptLookup


@dataclass
class Tokens:
    ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.ids[start:end]


def test_drafts_what_followed_the_latest_occurrence_of_the_longest_suffix():
    lookup = PromptLookup(8, first=8)
    # "7 8" occurs twice before the end; the latest is followed by 5 6, the earlier by 1 2
    seq = Tokens([7, 8, 1, 2, 3, 9, 7, 8, 5, 6, 4, 0, 7, 8])
    assert lookup.propose(seq, 2) == [5, 6]
    # the 3-gram "0 7 8" never occurred before, but "9 7 8" did: longer matches win when they exist
    seq.ids[-3:] = [9, 7, 8]
    assert PromptLookup(8, first=8).propose(seq, 3) == [5, 6, 4]


def test_a_short_period_is_drafted_as_repeating():
    assert PromptLookup(8, first=8).propose(Tokens([4, 1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]


def test_no_draft_without_an_earlier_match_or_room():
    assert PromptLookup(8, first=8).propose(Tokens([1, 2, 3, 4, 5]), 4) == []
    assert PromptLookup(8, first=8).propose(Tokens([5, 1, 5]), 4) == []  # one-token matches do not draft
    assert PromptLookup(8, first=8).propose(Tokens([1, 2, 1, 2]), 0) == []


def test_the_index_follows_the_sequence_as_it_grows():
    seq, lookup = Tokens([1, 2, 3]), PromptLookup(8, first=8)
    assert lookup.propose(seq, 2) == []
    seq.ids += [4, 1, 2]
    assert lookup.propose(seq, 2) == [3, 4]
    seq.ids += [3, 7, 1, 2]
    assert lookup.propose(seq, 2) == [3, 7]  # the latest continuation replaces the earlier one
    assert lookup.tokens == seq.ids


def test_drafts_start_short_double_while_kept_and_shrink_when_rejected():
    seq, lookup = Tokens([1, 2, 3] * 8), PromptLookup(limit=8)
    assert lookup.propose(seq, 8) == [1, 2, 3][:FIRST_DRAFT_TOKENS]
    lengths = []
    for drafted, kept in ((2, 2), (4, 4), (8, 8), (8, 3), (6, 0), (4, 0), (2, 1), (1, 0), (1, 1)):
        assert lookup.length == drafted  # the length the caller was offered
        lookup.feedback(drafted, kept)
        lengths.append(lookup.length)
    assert lengths == [4, 8, 8, 6, 4, 2, 1, 1, 2]
    assert len(lookup.propose(seq, 8)) == 2 and lookup.propose(seq, 1) == [1]  # the caller's bound still holds
    assert PromptLookup(limit=1).length == 1  # a limit below the first length caps it
