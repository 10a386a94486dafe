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


def allowed_tokens(compiler: GrammarCompiler, regex: str, steps: int) -> list[list[int]]:
    """The tokens a regex's grammar allows at each of its first ``steps`` steps, taking the first allowed."""
    import torch

    state, allowed = GrammarState(compiler.compile(GrammarSpec("regex", regex, "regex")), frozenset()), []
    for _ in range(steps):
        row = torch.zeros(compiler._vocab_size)
        state.mask(row)
        allowed.append((row == 0).nonzero().flatten().tolist())
        assert state.accept(allowed[-1][0])
    return allowed


def test_the_vocabulary_is_saved_once_and_read_back_as_it_was_read(tokenizer, tmp_path):
    """The first start saves xgrammar's view of the vocabulary, named after the xgrammar version; a later one
    reads it and constrains exactly as the tokenizer's own reading does; a damaged file is read again and
    replaced."""
    import importlib.metadata

    saved = tmp_path / "cache" / "grammar-vocabulary.json"
    written = tmp_path / "cache" / f"grammar-vocabulary-xgrammar-{importlib.metadata.version('xgrammar')}.json"
    first = GrammarCompiler(tokenizer, tokenizer.vocab_size, saved)
    first.prepare()
    assert written.is_file() and [p.name for p in written.parent.iterdir()] == [written.name]
    regex = r"[a-z]{2,5}\d+ (yes|no)"
    reference = allowed_tokens(GrammarCompiler(tokenizer, tokenizer.vocab_size), regex, 4)
    assert allowed_tokens(first, regex, 4) == reference
    content, inode = written.read_bytes(), written.stat().st_ino
    again = GrammarCompiler(tokenizer, tokenizer.vocab_size, saved)
    assert allowed_tokens(again, regex, 4) == reference
    assert written.stat().st_ino == inode  # read, not written again (a save replaces the file)
    written.write_text('{"truncated":')
    repaired = GrammarCompiler(tokenizer, tokenizer.vocab_size, saved)
    assert allowed_tokens(repaired, regex, 4) == reference
    assert written.read_bytes() == content and written.stat().st_ino != inode
