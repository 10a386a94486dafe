"""Stop regexes: RE2's linear-time matching over a bounded tail, with the whole text's meaning (no model)."""

from __future__ import annotations

import random
import re

import pytest

from fiberserve.engine.sampling_params import InvalidParameter, SamplingParams
from fiberserve.engine.sequence import FinishReason, Sequence, append_token
from fiberserve.engine.stop_regex import WINDOW, StopRegexError, compile_stop_regex
from fiberserve.model.tokenizer import IncrementalDetokenizer
from tests.unit.test_sequence import CharTokenizer


def first_stop_by_tail(pattern: str, text: str, piece_sizes: list[int]) -> int | None:
    """Feed ``text`` in pieces; the length of the text at the first check that finds a match, if any."""
    stop = compile_stop_regex(pattern)
    end = 0
    for size in piece_sizes:
        end = min(len(text), end + size)
        if stop.search_tail(text[:end], size):
            return end
        if end == len(text):
            break
    return None


def first_stop_by_whole_text(pattern: str, text: str, piece_sizes: list[int]) -> int | None:
    end = 0
    for size in piece_sizes:
        end = min(len(text), end + size)
        if re.search(pattern, text[:end]):
            return end
        if end == len(text):
            break
    return None


@pytest.mark.parametrize(
    "pattern",
    [r"[0-9]{2}", r"^ab", r"\bcat\b", r"x$", r"(ab|ba){2,3}", r"a\s*,\s*b", r"c.{0,40}d", r"^\w+ \w+$", r"(?i)DOG"],
)
def test_the_tail_finds_the_first_match_the_whole_text_finds(pattern):
    """Bounded patterns: checking the tail after each piece stops at the same point as re over the whole text."""
    rng = random.Random(pattern)
    for _ in range(200):
        text = "".join(rng.choice("abcdx0123 ,tgoDOG") for _ in range(rng.randrange(1, 120)))
        sizes = [rng.randrange(1, 5) for _ in range(len(text))]
        assert first_stop_by_tail(pattern, text, sizes) == first_stop_by_whole_text(pattern, text, sizes), text


def test_a_catastrophic_pattern_costs_linear_time_and_is_still_exact():
    # Python's backtracking re takes ~2**n steps for (a+)+b over n a's; RE2 answers at once.
    stop = compile_stop_regex(r"(a+)+b")
    text = "a" * 100_000
    assert not stop.search_tail(text, len(text))
    assert stop.search_tail(text + "b", 1)
    assert compile_stop_regex(r"(a+)+$").search_tail(text, 1)


def test_an_unbounded_pattern_matches_within_the_window():
    stop = compile_stop_regex(r"a.*b")
    assert stop.reach == WINDOW
    near = "x" * 5000 + "a" + "y" * (WINDOW - 10) + "b"
    assert stop.search_tail(near, 1)
    far = "a" + "y" * (WINDOW + 10) + "b"  # the match spans more than the window: not seen
    assert not stop.search_tail(far, 1)


def test_reach_is_the_longest_match():
    assert compile_stop_regex(r"[0-9]{2}").reach == 2
    assert compile_stop_regex(r"abc|de").reach == 3
    assert compile_stop_regex(r"\b").reach == 1
    assert compile_stop_regex(r"x{1000}y{1000}").reach == WINDOW


@pytest.mark.parametrize("pattern", [r"(a)\1", r"a(?=b)", r"(?<!x)y"])
def test_backtracking_only_syntax_is_refused_by_name(pattern):
    with pytest.raises(StopRegexError, match="RE2"):
        compile_stop_regex(pattern)
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(stop_regex=[pattern]).validate()
    assert info.value.field == "stop_regex" and "RE2" in str(info.value)
    with pytest.raises(InvalidParameter):
        SamplingParams(stop_regex=["("]).validate()


def test_a_sequence_checks_only_what_each_token_adds_after_the_whole_text_at_min_tokens():
    tok = CharTokenizer()
    params = SamplingParams(max_new_tokens=400, min_new_tokens=300, stop_regex=[r"^a{3}"])
    seq = Sequence("r", 0, [98], params, IncrementalDetokenizer(tok, [98]), frozenset({3}), 1000)
    for i in range(300):  # "aaa" at the start: no check before 300 tokens, then the whole text
        event = append_token(seq, ord("a") if i < 3 else ord("z"), None)
    assert event.finished and seq.finish_reason is FinishReason.STOP and seq.output.matched_stop == r"^a{3}"
    seq = Sequence(
        "r",
        0,
        [98],
        SamplingParams(max_new_tokens=50, stop_regex=[r"^a{3}"]),
        IncrementalDetokenizer(tok, [98]),
        frozenset({3}),
        100,
    )
    for ch in "zaaaa":  # ^ anchors at the start of the output only
        event = append_token(seq, ord(ch), None)
    assert not event.finished
