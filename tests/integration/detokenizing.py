"""A check shared by the real tokenizers' tests: the Rust incremental decoder against decode-based detokenizing."""

from __future__ import annotations

import random

from fiberserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Emoji 😀 and 中文 and 👩‍👩‍👧 end",
    "def f(x):\n    return x**2  # ünïcödé",
    "  spaces\tand\nnewlines  ",
    "The capital of France is Paris. It's   big!",
    "日本語のテキスト、そして한국어",
    "a\u00a0b\u200bc \u0300x",
]


class _DecodeOnly:
    """The tokenizer seen through ``decode`` alone, which makes IncrementalDetokenizer decode twice per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.decode = tokenizer.decode


def assert_stream_decoder_gives_decodes_pieces(tokenizer: Tokenizer, trials: int = 300) -> None:
    """Piece by piece, the same text from tokenizers' DecodeStream as from decoding the growing ids: prompts as
    context, texts that split characters across tokens, special tokens kept or skipped, random ids."""
    rng = random.Random(0)
    specials = sorted(tokenizer.hf.all_special_ids)
    assert tokenizer.stream_decoder([], True) is not None  # or this check compares the slow path with itself
    for trial in range(trials):
        prompt = tokenizer.encode(rng.choice(TEXTS))
        output = tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False)
        if trial % 3 == 0:
            output += [rng.choice(specials), *output[:3]]
        if trial % 5 == 0:
            output = [rng.randrange(tokenizer.vocab_size) for _ in range(12)]
        for skip in (True, False):
            fast = IncrementalDetokenizer(tokenizer, prompt, skip)
            slow = IncrementalDetokenizer(_DecodeOnly(tokenizer), prompt, skip)  # type: ignore[arg-type]
            assert fast._step is not None and slow._step is None
            assert [fast.push(t) for t in output] == [slow.push(t) for t in output], (output, skip)
            assert fast.flush() == slow.flush()
