"""Sampling parameters of one request, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fiberserve.engine.stop_regex import StopRegexError, compile_stop_regex

if TYPE_CHECKING:
    from fiberserve.engine.grammar import GrammarSpec

#: How an embedding pools the prompt's final hidden states (llama.cpp's ``--pooling`` names).
POOLINGS = ("last", "mean")


class InvalidParameter(ValueError):
    """A sampling parameter is out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class SamplingParams:
    """What to generate and how to pick each token (vLLM / SGLang semantics)."""

    max_new_tokens: int = 128
    #: ``max_new_tokens`` is the API's default, not the client's: cut to what the context leaves after the prompt
    #: rather than refused (vLLM's default is that remainder).
    max_new_tokens_by_default: bool = False
    #: No stop token nor stop string ends the output before this many tokens (vLLM's ``min_tokens``).
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1  #: -1 (or 0) = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    #: The output ends (``stop``, the text kept whole) once its text has a match of one of these regular
    #: expressions (SGLang's ``stop_regex``; RE2 syntax, matched in a bounded tail: see ``stop_regex.py``).
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    #: Return the log probability of each chosen token.
    logprobs: bool = False
    #: How many top alternatives to report per position (0 = none).
    top_logprobs: int = 0
    #: Score the prompt too: each prompt token's logprob (the first has none) and this many top alternatives per
    #: position; None = not at all.  Such a request computes its whole prompt (no prefix cache).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    #: Keep the stop string that ended the output at the end of its text (vLLM's ``include_stop_str_in_output``).
    include_stop_str: bool = False
    #: Added to the logits of these token ids before penalties and sampling (OpenAI's ``logit_bias``).
    logit_bias: dict[int, float] = field(default_factory=dict)
    #: What the output must match (constrained decoding), or None.
    grammar: GrammarSpec | None = None
    #: Pool the prompt's final hidden states instead of generating (an embedding): ``last`` (the last token's) or
    #: ``mean`` (every token's mean, which computes the whole prompt: no prefix cache); None: generate.
    pooling: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """The logits are changed before a token is picked (a grammar, a bias, a penalty, stop tokens banned)."""
        return bool(self.logit_bias) or self.needs_penalties or self.min_new_tokens > 0 or self.grammar is not None

    @property
    def argmax_only(self) -> bool:
        """The next token is the raw logits' argmax and nothing else of them is needed (no bias, no penalties,
        no logprobs)."""
        return self.greedy and not self.adjusts_logits and not (self.logprobs or self.top_logprobs)

    @property
    def picked_from_raw_logits(self) -> bool:
        """The next token is the raw logits' argmax, or a draw from all of them at the temperature (no truncation,
        no adjustments, no logprobs): the head's kernel can pick it without writing the logits."""
        whole = self.top_k <= 0 and self.top_p >= 1.0 and self.min_p == 0.0
        return (self.greedy or whole) and not self.adjusts_logits and not (self.logprobs or self.top_logprobs)

    def validate(self, max_n: int = 16, vocab_size: int | None = None) -> SamplingParams:
        """Raise :class:`InvalidParameter` naming the first bad field; return self."""
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 0, "must be >= 0"),
            ("min_new_tokens", 0 <= self.min_new_tokens <= self.max_new_tokens, "must be in [0, the token limit]"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "must be -1 (off) or >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 10, "must be in (0, 10]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("n", 1 <= self.n <= max_n, f"must be in [1, {max_n}]"),
            ("top_logprobs", 0 <= self.top_logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "must be in [0, 20]"),
            (
                "stop",
                len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
                "at most 16 non-empty strings",
            ),
            (
                "stop_regex",
                len(self.stop_regex) <= 16 and all(isinstance(s, str) and s for s in self.stop_regex),
                "at most 16 non-empty regular expressions",
            ),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "must be in [0, 2**63)"),
            (
                "logit_bias",
                len(self.logit_bias) <= 300 and all(-100 <= b <= 100 for b in self.logit_bias.values()),
                "at most 300 entries, each bias in [-100, 100]",
            ),
        ]
        if vocab_size is not None:
            checks.append(
                (
                    "stop_token_ids",
                    all(0 <= t < vocab_size for t in self.stop_token_ids),
                    f"ids must be in [0, {vocab_size})",
                )
            )
            checks.append(
                ("logit_bias", all(0 <= t < vocab_size for t in self.logit_bias), f"ids must be in [0, {vocab_size})")
            )
        if self.pooling is not None:
            checks += [
                ("pooling", self.pooling in POOLINGS, f"must be one of {', '.join(POOLINGS)}"),
                ("max_new_tokens", self.max_new_tokens == 0, "must be 0 for an embedding"),
                ("n", self.n == 1, "must be 1 for an embedding"),
                ("prompt_logprobs", self.prompt_logprobs is None, "is not computed for an embedding"),
            ]
        for name, ok, message in checks:
            if not ok:
                raise InvalidParameter(name, message)
        for pattern in self.stop_regex:
            try:
                compile_stop_regex(pattern)
            except StopRegexError as exc:
                raise InvalidParameter("stop_regex", str(exc)) from None
        return self
