"""A sequence: one completion being generated; it owns its tokens, its pages and its outcome, and holds its
sampling state (``sampling_state.py``) and what its consumer reads (``sequence_output.py``)."""

from __future__ import annotations

import asyncio
import enum
import itertools
import random
import time

import torch

from fiberserve.engine.sampling_noise import sampling_key
from fiberserve.engine.sampling_params import SamplingParams
from fiberserve.engine.sampling_state import SamplingState
from fiberserve.engine.sequence_output import EventForwarder, SequenceEvent, SequenceOutput, TokenLogprob
from fiberserve.model.lora import LoraAdapter
from fiberserve.model.tokenizer import IncrementalDetokenizer

_ids = itertools.count()


class Status(enum.Enum):
    """A sequence's place in its life, the one thing that says where it is.

    WAITING (queued, no pages) -> RUNNING (admitted: holds pages) <-> IN_FLIGHT (in a flight: the scheduler
    leaves it alone until it lands) -> ... -> FINISHED.  Preemption moves a RUNNING sequence back to WAITING;
    a sequence finishes from WAITING or RUNNING, never IN_FLIGHT (an abort or a stop found in the air waits
    for the landing: see ``abort_requested`` and ``finishing``).
    """

    WAITING = "waiting"
    RUNNING = "running"
    IN_FLIGHT = "in flight"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class Sequence:
    """One completion; the scheduler moves it, the runner computes it, the consumer reads its events."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer | None,
        eos_token_ids: frozenset[int],
        max_context: int,
        seed: int | None = None,
        adapter: LoraAdapter | None = None,
    ) -> None:
        """``detokenizer``: None for a sequence that generates nothing (an embedding).  ``seed``: what keys the
        sampling noise, with ``index`` (the request's seed, or one the engine drew for it); None: the request's
        seed, or a random one.  ``adapter``: the LoRA adapter it runs under (None: the base model)."""
        self.uid = next(_ids)
        self.request_id = request_id
        self.index = index  #: which of the request's n completions
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.adapter = adapter
        self.status = Status.WAITING
        self.pages: list[int] = []
        self.num_computed = 0  #: leading tokens whose K/V are in the cache
        self.registered_pages = 0  #: leading pages offered to the prefix cache
        self.cached_tokens = 0  #: prompt tokens served from the prefix cache
        self.abort_requested = False  #: the consumer asked to stop; honoured when the sequence is on the ground
        #: The final event of a sequence that ended inside a multi-step flight; it is finished (and this event
        #: delivered) when the flight lands, since its pages may still be written until then.
        self.finishing: SequenceEvent | None = None
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        #: The HTTP status an error maps to: 500, or 400 where the request's own constraint cannot be met.
        self.error_status = 500
        #: Whether this sequence's prompt rows compute ``output.prompt_logprobs`` (see :meth:`share_prompt_scores`).
        self.scores_prompt = params.prompt_logprobs is not None
        self.max_tokens = min(params.max_new_tokens, max_context - len(prompt_ids))
        if seed is None:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.sampling = SamplingState(sampling_key(seed, index), stop_ids)
        self.output = SequenceOutput(detokenizer, len(prompt_ids) if self.scores_prompt else None)
        self.arrival = time.monotonic()
        self.preemptions = 0

    def take_events(self) -> None:
        """Claim this sequence's events for one consumer; :class:`.EventsTaken` if another has them."""
        self.output.take_events(f"request {self.request_id} (sequence {self.index})")

    def forward_events(self, sink: asyncio.Queue[tuple[Sequence, SequenceEvent]]) -> None:
        """Send this sequence's events, those queued and those to come, to ``sink`` as (sequence, event) pairs:
        one queue for every sequence a consumer reads, and no task per sequence.  Claims them (:meth:`take_events`)."""
        self.take_events()
        queued, self.output.events = self.output.events, EventForwarder(self, sink)
        while isinstance(queued, asyncio.Queue) and not queued.empty():
            sink.put_nowait((self, queued.get_nowait()))

    def share_prompt_scores(self, scorer: Sequence) -> None:
        """Take ``scorer``'s prompt logprobs (the same list, filled as it computes them) instead of computing
        them again: a request's n sequences share one prompt, so one of them scores it.  This one's prompt may
        then come from the prefix cache."""
        self.output.prompt_logprobs, self.scores_prompt = scorer.output.prompt_logprobs, False

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt token's row is needed (scored, or pooled by mean): no cached prefix may skip one."""
        return self.scores_prompt or self.params.pooling == "mean"

    def pooled_positions(self, start: int, end: int) -> range:
        """The positions among ``start:end`` whose final hidden states this sequence pools (none unless it is an
        embedding)."""
        pooling, prompt = self.params.pooling, len(self.prompt_ids)
        if pooling == "mean":
            return range(start, min(end, prompt))
        if pooling == "last" and start < prompt <= end:
            return range(prompt - 1, prompt)
        return range(0)

    def keep_pooled(self, positions: range, rows: torch.Tensor) -> None:
        """Store the final hidden states ``rows`` of ``positions`` (:meth:`pooled_positions`) in the output."""
        last = self.params.pooling == "last"
        self.output.keep_pooled(0 if last else positions.start, rows, 1 if last else len(self.prompt_ids))

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building the whole list (the hot path asks for the last few)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:end] + self.output_ids[: max(0, end - n)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_flight(self) -> bool:
        return self.status is Status.IN_FLIGHT

    @property
    def adapter_uid(self) -> int:
        """The prefix cache's namespace of this sequence's pages: its adapter's load (0: the base model's)."""
        return 0 if self.adapter is None else self.adapter.uid

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, {self.status.value}, "
            f"{self.num_computed}/{self.num_tokens} computed, pages={len(self.pages)})"
        )


def _stop_regex_match(seq: Sequence, fresh: int) -> str | None:
    """The first ``stop_regex`` with a match ending in the text's last ``fresh`` characters (held text
    included), if any; the first check, at ``min_new_tokens``, looks at the whole text."""
    if not seq.params.stop_regex or len(seq.output_ids) < seq.params.min_new_tokens:
        return None
    if len(seq.output_ids) == seq.params.min_new_tokens:
        fresh = len(seq.output.text) + len(seq.output.held)
    return seq.output.regex_match(seq.params.stop_regex, fresh)


def _refusal(seq: Sequence, token: int) -> str:
    """Why the grammar refused ``token``: at a dead end (no token may follow the output so far, the stop tokens
    banned below ``min_new_tokens``) the request's constraint cannot be met, a client's error (status 400)."""
    grammar = seq.sampling.grammar
    assert grammar is not None and seq.params.grammar is not None
    banned = seq.sampling.stop_ids if len(seq.output_ids) - 1 < seq.params.min_new_tokens else frozenset()
    if grammar.allows_a_token(banned):
        return f"the grammar refused token {token}"
    seq.error_status = 400
    field, wanted = seq.params.grammar.field, seq.params.min_new_tokens
    ban = f" other than a stop token, which min_tokens={wanted} bans here" if banned else ""
    return f"{field}: no output satisfies it: after {tokens(len(seq.output_ids) - 1)} the grammar allows no token{ban}"


def tokens(count: int) -> str:
    """``count`` tokens, in words: "1 token", "3 tokens"."""
    return f"{count} token" + ("" if count == 1 else "s")


def append_token(seq: Sequence, token: int, info: TokenLogprob | None) -> SequenceEvent:
    """Record a sampled token, apply the stop rules, and return the consumer's event.

    Finish rules, in order: a stop token (EOS unless ``ignore_eos``, or one of
    ``stop_token_ids``) ends with ``stop`` and contributes no text, as does a
    grammar completed with no stop token to take; a stop
    string ends with ``stop`` and is cut out of the text (kept with
    ``include_stop_str``), but only once there are ``min_new_tokens`` tokens
    (as in vLLM: one completed earlier is text; the sampler bans stop tokens
    until then); a match of a ``stop_regex`` ends with ``stop`` and its text
    is kept (as SGLang does), also only from ``min_new_tokens`` on; reaching
    ``max_new_tokens`` (or the context length) ends with ``length``.
    """
    output, grammar, params = seq.output, seq.sampling.grammar, seq.params
    seq.output_ids.append(token)
    if info is not None:
        output.logprobs.append(info)
    if output.first_token_time is None:
        output.first_token_time = time.monotonic()
    if grammar is not None and not grammar.accept(token):
        seq.finish_reason, seq.error = FinishReason.ERROR, _refusal(seq, token)
        return SequenceEvent("", True)
    if token in seq.sampling.stop_ids:
        seq.finish_reason, output.matched_stop = FinishReason.STOP, token
        piece = ""
    else:
        assert output.detokenizer is not None, "a sequence that generates has a detokenizer"
        piece = output.detokenizer.push(token)
        if grammar is not None and grammar.complete:  # no stop token to wait for (ignore_eos)
            seq.finish_reason = FinishReason.STOP
    if seq.finish_reason is None and len(seq.output_ids) >= seq.max_tokens:
        seq.finish_reason = FinishReason.LENGTH
    final = seq.finish_reason is not None
    if final and seq.finish_reason is FinishReason.LENGTH:
        assert output.detokenizer is not None
        piece += output.detokenizer.flush()
    stops = params.stop if len(seq.output_ids) >= params.min_new_tokens else []
    delta, matched = output.release(piece, final, stops, params.include_stop_str)
    if matched is not None:
        seq.finish_reason, output.matched_stop = FinishReason.STOP, matched
    if seq.finish_reason is None and (pattern := _stop_regex_match(seq, len(piece))) is not None:
        seq.finish_reason, output.matched_stop = FinishReason.STOP, pattern
        delta += output.release_held()
    return SequenceEvent(delta, seq.finish_reason is not None)
