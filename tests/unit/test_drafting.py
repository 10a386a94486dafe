"""Prompt lookup drafting (no model): what it proposes, that it follows a growing sequence, and how it learns
how often its drafts come true."""

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
    lookup = PromptLookup(8)
    # "7 8" occurs twice before the end; the latest is followed by 5 6, the earlier by 1 2
    seq = Tokens([7, 8, 1, 2, 3, 9, 7, 8, 5, 6, 4, 0, 7, 8])
    assert lookup.propose(seq, 2) == [5, 6]
    # the 3-gram "0 7 8" never occurred before, but "9 7 8" did: longer matches win when they exist
    seq.ids[-3:] = [9, 7, 8]
    assert PromptLookup(8).propose(seq, 3) == [5, 6, 4]


def test_a_short_period_is_drafted_as_repeating():
    assert PromptLookup(8).propose(Tokens([4, 1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]


def test_no_draft_without_an_earlier_match_or_room():
    assert PromptLookup(8).propose(Tokens([1, 2, 3, 4, 5]), 4) == []
    assert PromptLookup(8).propose(Tokens([5, 1, 5]), 4) == []  # one-token matches do not draft
    assert PromptLookup(8).propose(Tokens([1, 2, 1, 2]), 0) == []


def test_the_index_follows_the_sequence_as_it_grows():
    seq, lookup = Tokens([1, 2, 3]), PromptLookup(8)
    assert lookup.propose(seq, 2) == []
    seq.ids += [4, 1, 2]
    assert lookup.propose(seq, 2) == [3, 4]
    seq.ids += [3, 7, 1, 2]
    assert lookup.propose(seq, 2) == [3, 7]  # the latest continuation replaces the earlier one
    assert lookup.tokens == seq.ids


def test_acceptance_is_learnt_from_the_tokens_that_came_after_each_proposal():
    seq, lookup = Tokens([1, 2, 3, 1, 2]), PromptLookup(4)
    assert lookup.propose(seq, 2) == [3, 1] and lookup.acceptance == 0.5  # nothing checked yet
    assert lookup.propose(seq, 2) == [3, 1] and lookup.acceptance == 0.5  # no new token: nothing to check
    seq.ids += [3, 1, 2]  # the whole proposal [3, 1, 2, 3] up to what came: 3 checks come true
    lookup.propose(seq, 1)
    assert lookup.acceptance == (0.9 * 1 + 3) / (0.9 * 2 + 3)
    seq.ids += [9]  # the proposal [3, 1, 2, 3] was wrong at once: one check that did not come true
    assert lookup.propose(seq, 4) == []
    assert lookup.acceptance == (0.9 * 3.9 + 0) / (0.9 * 4.8 + 1)
    seq.ids += [5]  # there was no proposal: nothing is checked
    lookup.propose(seq, 4)
    assert lookup.acceptance == 3.51 / 5.32
