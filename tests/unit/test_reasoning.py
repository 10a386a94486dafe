"""The reasoning parsers: a whole output's split, and the same split however its text is streamed."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fiberserve.server.reasoning import MARKERS, ReasoningStream, split_reasoning

R1, QWEN3 = MARKERS["deepseek_r1"], MARKERS["qwen3"]


@pytest.mark.parametrize(
    "markers,text,reasoning,content",
    [
        (R1, "<think>\nWeighing it.</think>\n\nThe answer.", "\nWeighing it.", "The answer."),
        (R1, "Weighing it.</think>The answer.", "Weighing it.", "The answer."),  # <think> was in the prompt
        (R1, "Still weighing", "Still weighing", ""),  # cut short while thinking
        (R1, "a</think>b</think>c", "a", "b</think>c"),  # only the first end marker ends the thinking
        (QWEN3, "  <think>Weighing.</think>\n\nThe answer.", "Weighing.", "The answer."),
        (QWEN3, "The answer.", None, "The answer."),  # thinking switched off
        (QWEN3, "Weighing.</think>The answer.", None, "Weighing.</think>The answer."),
        (QWEN3, "<think>Still weighing", "Still weighing", ""),
        (QWEN3, "<thi", None, "<thi"),  # a marker's beginning that never completes is text
    ],
)
def test_a_whole_output_splits_into_its_reasoning_and_its_content(markers, text, reasoning, content):
    assert split_reasoning(markers, text) == (reasoning, content)


#: Outputs made of the markers, their pieces and other text.
OUTPUTS = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "th", "ink", ">", " ", "\n", "a"])).map("".join)


@pytest.mark.parametrize("markers", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
@given(text=OUTPUTS, cuts=st.lists(st.integers(0, 60)))
def test_streamed_pieces_add_up_to_the_whole_output_s_split(markers, text, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    stream = ReasoningStream(markers)
    shares = [stream.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    reasoning = "".join(r for r, _ in shares)
    content = "".join(c for _, c in shares)
    assert ((reasoning if stream.thought else None), content) == split_reasoning(markers, text)
    assert not reasoning or stream.thought
