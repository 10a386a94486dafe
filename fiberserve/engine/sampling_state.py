"""What picks a sequence's next tokens beyond its parameters: the key of its sampling noise, the tokens that stop
it, the grammar that constrains it and the drafter that guesses ahead of it."""

from __future__ import annotations

from dataclasses import dataclass

from fiberserve.engine.drafting import PromptLookup
from fiberserve.engine.grammar import GrammarState


@dataclass
class SamplingState:
    key: int  #: keys the sampling noise (see ``sampling_noise.uniform``), from the seed and the completion's index
    stop_ids: frozenset[int]  #: tokens that end the sequence (EOS unless ``ignore_eos``, and ``stop_token_ids``)
    grammar: GrammarState | None = None  #: set by the engine where the request constrains the output
    drafter: PromptLookup | None = None  #: set by the scheduler when it first drafts for this sequence
