"""A sequence's own rules: stop tokens, stop strings across pieces, length, and its token slices (no model)."""

from __future__ import annotations

import random

from fiberserve.engine.sampling_params import SamplingParams
from fiberserve.engine.sequence import FinishReason, Sequence, append_token
from fiberserve.model.tokenizer import IncrementalDetokenizer


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def make(params: SamplingParams, prompt=(97,)) -> Sequence:
    tok = CharTokenizer()
    return Sequence("r", 0, list(prompt), params, IncrementalDetokenizer(tok, list(prompt)), frozenset({3}), 100)


def feed(seq: Sequence, text: str) -> list[str]:
    deltas = []
    for ch in text:
        event = append_token(seq, ord(ch), None)
        deltas.append(event.delta)
        if event.finished:
            break
    return deltas


def test_stop_string_spanning_tokens_is_cut_and_never_streamed():
    seq = make(SamplingParams(max_new_tokens=50, stop=["END"]))
    deltas = feed(seq, "hello ENDgame")
    assert seq.finish_reason is FinishReason.STOP and seq.output.matched_stop == "END"
    assert seq.output.text == "hello " and "".join(deltas) == "hello "
    assert all("E" not in d for d in deltas)  # the stop text was held back, never shown


def test_stop_string_kept_when_asked_and_ignored_below_the_minimum_length():
    seq = make(SamplingParams(max_new_tokens=50, stop=["END"], include_stop_str=True))
    deltas = feed(seq, "hello ENDgame")
    assert seq.finish_reason is FinishReason.STOP and seq.output.text == "".join(deltas) == "hello END"
    seq = make(SamplingParams(max_new_tokens=50, stop=["END"], min_new_tokens=5))
    deltas = feed(seq, "ENDhello ENDgame")  # the first END completes at 3 tokens, below the minimum
    assert seq.finish_reason is FinishReason.STOP and seq.output.text == "".join(deltas) == "ENDhello "


def test_held_back_text_is_released_when_it_is_not_a_stop():
    seq = make(SamplingParams(max_new_tokens=8, stop=["xyz"]))
    deltas = feed(seq, "abcxyabc")
    assert seq.finish_reason is FinishReason.LENGTH
    assert "".join(deltas) == seq.output.text == "abcxyabc"


def test_stop_token_contributes_no_text_and_eos_can_be_ignored():
    seq = make(SamplingParams(max_new_tokens=10))
    feed(seq, "ab\x03cd")
    assert (seq.output.text, seq.finish_reason, seq.output.matched_stop) == ("ab", FinishReason.STOP, 3)
    seq = make(SamplingParams(max_new_tokens=4, ignore_eos=True))
    feed(seq, "ab\x03cd")
    assert seq.finish_reason is FinishReason.LENGTH and len(seq.output_ids) == 4


def test_stop_regex_ends_the_output_with_its_match_kept_and_waits_for_min_tokens():
    seq = make(SamplingParams(max_new_tokens=50, stop=["END"], stop_regex=[r"[0-9]{2}"]))
    deltas = feed(seq, "ab1c23de")
    assert (seq.output.text, seq.finish_reason, seq.output.matched_stop) == ("ab1c23", FinishReason.STOP, r"[0-9]{2}")
    assert "".join(deltas) == "ab1c23"  # held text (a possible "END") released with the match
    seq = make(SamplingParams(max_new_tokens=50, min_new_tokens=5, stop_regex=["x"]))
    feed(seq, "axbcdxyz")
    assert (seq.output.text, seq.finish_reason) == ("axbcd", FinishReason.STOP)  # a match counts from the 5th token on


def test_token_slice_equals_slicing_all_tokens():
    rng = random.Random(3)
    seq = make(SamplingParams())
    for _ in range(3000):
        seq.prompt_ids = [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        seq.output_ids = [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        full = seq.prompt_ids + seq.output_ids
        a = rng.randrange(len(full))
        b = rng.randrange(a, len(full) + 1)
        assert seq.token_slice(a, b) == full[a:b]


def test_greedy_sampling_picks_the_first_maximum_and_survives_nan_rows():
    import torch

    from fiberserve import kernels
    from fiberserve.engine.sampler import sample

    kernels.load()  # the sampler's argmax kernel serves once the model has built the kernels
    greedy = SamplingParams(temperature=0)
    torch.manual_seed(7)
    logits = torch.randn(3, 4000)
    logits[1, 10] = logits[1, 3000] = 50.0  # a tie: the first index wins, as with torch.argmax
    picked = [token for token, _ in sample(logits, [make(greedy) for _ in range(3)], [3, 3, 3])]
    assert picked == logits.argmax(-1).tolist() and picked[1] == 10
    logits[2] = float("nan")  # no kernel pick for a NaN row: torch's argmax decides the whole batch
    picked = [token for token, _ in sample(logits, [make(greedy) for _ in range(3)], [3, 3, 3])]
    assert picked == logits.argmax(-1).tolist()
