"""Prompt lookup drafting (no model): what it proposes, and that it follows a growing sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

from fiberserve.engine.drafting import PromptLookup


@dataclass
class Tokens:
    ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.ids[start:end]


def test_drafts_what_followed_the_latest_occurrence_of_the_longest_suffix():
    lookup = PromptLookup()
    # "7 8" occurs twice before the end; the latest is followed by 5 6, the earlier by 1 2
    seq = Tokens([7, 8, 1, 2, 3, 9, 7, 8, 5, 6, 4, 0, 7, 8])
    assert lookup.propose(seq, 2) == [5, 6]
    # the 3-gram "0 7 8" never occurred before, but "9 7 8" did: longer matches win when they exist
    seq.ids[-3:] = [9, 7, 8]
    assert PromptLookup().propose(seq, 3) == [5, 6, 4]


def test_a_short_period_is_drafted_as_repeating():
    assert PromptLookup().propose(Tokens([4, 1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]


def test_no_draft_without_an_earlier_match_or_room():
    assert PromptLookup().propose(Tokens([1, 2, 3, 4, 5]), 4) == []
    assert PromptLookup().propose(Tokens([5, 1, 5]), 4) == []  # one-token matches do not draft
    assert PromptLookup().propose(Tokens([1, 2, 1, 2]), 0) == []


def test_the_index_follows_the_sequence_as_it_grows():
    seq, lookup = Tokens([1, 2, 3]), PromptLookup()
    assert lookup.propose(seq, 2) == []
    seq.ids += [4, 1, 2]
    assert lookup.propose(seq, 2) == [3, 4]
    seq.ids += [3, 7, 1, 2]
    assert lookup.propose(seq, 2) == [3, 7]  # the latest continuation replaces the earlier one
    assert lookup.tokens == seq.ids
