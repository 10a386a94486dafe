"""Constrained decoding's pieces without a model: specs, the choice regex, the compiler's cache and errors."""

from __future__ import annotations

import pytest

from fiberserve.engine.grammar import GrammarCompiler, GrammarSpec, GrammarState, choice_regex
from fiberserve.engine.sampling_params import InvalidParameter


def test_choice_regex_escapes_every_special_character():
    assert choice_regex(["a.b", "x|y", "(z)"]) == r"(a\.b|x\|y|\(z\))"


def test_compiler_keeps_the_last_grammars_and_names_the_field_of_a_bad_one(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    first = compiler.compile(GrammarSpec("regex", "a0", "regex"))
    assert compiler.compile(GrammarSpec("regex", "a0", "regex")) is first
    for i in range(1, GrammarCompiler.CACHED + 1):
        compiler.compile(GrammarSpec("regex", f"a{i}", "regex"))
    assert compiler.compile(GrammarSpec("regex", "a0", "regex")) is not first  # evicted, compiled again
    with pytest.raises(InvalidParameter) as err:
        compiler.compile(GrammarSpec("json_schema", '{"type": "no-such-type"}', "guided_json"))
    assert err.value.field == "guided_json" and "no-such-type" in str(err.value)
    assert ".cc:" not in str(err.value)  # xgrammar's time and source location are cut off


def test_a_state_masks_all_but_the_grammar_and_ends_with_it(tokenizer):
    import torch

    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    state = GrammarState(compiler.compile(GrammarSpec("regex", "ab", "regex")), frozenset())
    text = ""
    while not state.complete:
        row = torch.zeros(tokenizer.vocab_size)
        state.mask(row)
        allowed = (row == 0).nonzero().flatten().tolist()
        pieces = [tokenizer.decode([t]) for t in allowed]
        assert pieces and all(piece and "ab".startswith(text + piece) for piece in pieces)
        assert state.accept(allowed[0])
        text += tokenizer.decode([allowed[0]])
    assert text == "ab"
