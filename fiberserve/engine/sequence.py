"""A sequence: one completion being generated; it owns its tokens, its pages and its outcome."""

from __future__ import annotations

import asyncio
import enum
import itertools
import random
import time
from dataclasses import dataclass, field

import torch

from fiberserve.engine.drafting import PromptLookup
from fiberserve.engine.grammar import GrammarState
from fiberserve.engine.sampling_noise import sampling_key
from fiberserve.engine.sampling_params import SamplingParams
from fiberserve.engine.stop_regex import compile_stop_regex
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


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SequenceEvent:
    """What a consumer sees after each step: the new text, and the outcome once finished."""

    delta: str
    finished: bool


class Sequence:
    """One completion; the scheduler moves it, the runner computes it, the consumer reads its events."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        eos_token_ids: frozenset[int],
        max_context: int,
        seed: int | None = None,
    ) -> None:
        """``seed``: what keys the sampling noise, with ``index`` (the request's seed, or one the engine drew for
        it); None: the request's seed, or a random one."""
        self.uid = next(_ids)
        self.request_id = request_id
        self.index = index  #: which of the request's n completions
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
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
        self.matched_stop: str | int | None = None
        self.error: str | None = None
        #: The HTTP status an error maps to: 500, or 400 where the request's own constraint cannot be met.
        self.error_status = 500
        self.logprobs: list[TokenLogprob] = []
        self.grammar: GrammarState | None = None  #: set by the engine where the request constrains the output
        self.drafter: PromptLookup | None = None  #: set by the scheduler when it first drafts for this sequence
        #: Per prompt position, the logprob of that token given the ones before (None for the first), if asked.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if params.prompt_logprobs is None else [None] * len(prompt_ids)
        )
        #: Whether this sequence's prompt rows compute ``prompt_logprobs`` (see :meth:`share_prompt_scores`).
        self.scores_prompt = self.prompt_logprobs is not None
        #: An embedding's pooled final hidden states (``params.pooling``): the last prompt token's row [1, hidden],
        #: or every prompt token's [prompt, hidden], float32, written as the chunks computing them land.
        self.pooled_rows: torch.Tensor | None = None
        self.detokenizer = detokenizer
        self.text = ""  #: text released to the consumer
        self.held = ""  #: text not yet released: it may be the start of a stop string
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.max_tokens = min(params.max_new_tokens, max_context - len(prompt_ids))
        if seed is None:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
        #: Keys this sequence's sampling noise (see ``sampling_noise.uniform``).
        self.sampling_key = sampling_key(seed, index)
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.preemptions = 0
        #: Where the scheduler puts this sequence's events (``put_nowait``): its own queue, read with
        #: ``LlmService.events``, or a consumer's shared one (:meth:`forward_events`).
        self.events: asyncio.Queue[SequenceEvent] | EventForwarder = asyncio.Queue()
        #: Whether a consumer reads the events (each has one), and whether it has read the last.
        self.events_taken = self.events_read = False

    def take_events(self) -> None:
        """Claim this sequence's events for one consumer; :class:`EventsTaken` if another has them."""
        if self.events_taken:
            raise EventsTaken(
                f"request {self.request_id} (sequence {self.index}) already has a consumer of its events: "
                "wait on a request or stream it, not both, and from one task"
            )
        self.events_taken = True

    def forward_events(self, sink: asyncio.Queue[tuple[Sequence, SequenceEvent]]) -> None:
        """Send this sequence's events, those queued and those to come, to ``sink`` as (sequence, event) pairs:
        one queue for every sequence a consumer reads, and no task per sequence.  Claims them (:meth:`take_events`)."""
        self.take_events()
        queued, self.events = self.events, EventForwarder(self, sink)
        while isinstance(queued, asyncio.Queue) and not queued.empty():
            sink.put_nowait((self, queued.get_nowait()))

    def share_prompt_scores(self, scorer: Sequence) -> None:
        """Take ``scorer``'s prompt logprobs (the same list, filled as it computes them) instead of computing
        them again: a request's n sequences share one prompt, so one of them scores it.  This one's prompt may
        then come from the prefix cache."""
        self.prompt_logprobs, self.scores_prompt = scorer.prompt_logprobs, False

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
        """Store the final hidden states ``rows`` of ``positions`` (:meth:`pooled_positions`); a recompute after a
        preemption writes the same rows again."""
        if self.pooled_rows is None:
            count = 1 if self.params.pooling == "last" else len(self.prompt_ids)
            self.pooled_rows = torch.empty(count, rows.shape[1], dtype=torch.float32)
        first = 0 if self.params.pooling == "last" else positions.start
        self.pooled_rows[first : first + len(positions)] = rows

    def pooled(self) -> torch.Tensor:
        """The embedding, once the prompt is computed: the pooled rows' mean (the last row alone for ``last``),
        float32 [hidden], not normalized; its bits do not depend on how the prompt was split into chunks."""
        assert self.pooled_rows is not None, "pooled once the prompt is computed"
        return self.pooled_rows.mean(dim=0)

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

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, {self.status.value}, "
            f"{self.num_computed}/{self.num_tokens} computed, pages={len(self.pages)})"
        )


class EventsTaken(RuntimeError):
    """A second consumer asked for a sequence's events: each sequence has one reader (a waiter or a stream)."""


class EventForwarder:
    """Stands in for a sequence's event queue: each event goes to a shared queue, tagged with its sequence."""

    def __init__(self, seq: Sequence, sink: asyncio.Queue[tuple[Sequence, SequenceEvent]]) -> None:
        self.seq, self.sink = seq, sink

    def put_nowait(self, event: SequenceEvent) -> None:
        self.sink.put_nowait((self.seq, event))


def _release_text(seq: Sequence, piece: str, final: bool) -> str:
    """Add ``piece`` to the pending text; return what may be shown now (stop strings held back)."""
    pending = seq.held + piece
    start = len(seq.text)
    full = seq.text + pending
    stops = seq.params.stop if len(seq.output_ids) >= seq.params.min_new_tokens else []
    if stops:
        hits = [(full.find(s, max(0, start - len(s) + 1)), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, matched = min(hits)
            seq.finish_reason, seq.matched_stop = FinishReason.STOP, matched
            seq.held = ""
            end = index + len(matched) if seq.params.include_stop_str else index
            released = full[start:end]
            seq.text = full[:end]
            return released
        if not final:
            hold = max(len(s) for s in stops) - 1
            cut = max(start, len(full) - hold)
            seq.held = full[cut:]
            seq.text = full[:cut]
            return full[start:cut]
    seq.held = ""
    seq.text = full
    return pending


def _stop_regex_match(seq: Sequence, fresh: int) -> str | None:
    """The first ``stop_regex`` with a match ending in the text's last ``fresh`` characters (held text
    included), if any; the first check, at ``min_new_tokens``, looks at the whole text."""
    if not seq.params.stop_regex or len(seq.output_ids) < seq.params.min_new_tokens:
        return None
    text = seq.text + seq.held
    if len(seq.output_ids) == seq.params.min_new_tokens:
        fresh = len(text)
    return next((p for p in seq.params.stop_regex if compile_stop_regex(p).search_tail(text, fresh)), None)


def _refusal(seq: Sequence, token: int) -> str:
    """Why the grammar refused ``token``: at a dead end (no token may follow the output so far, the stop tokens
    banned below ``min_new_tokens``) the request's constraint cannot be met, a client's error (status 400)."""
    assert seq.grammar is not None and seq.params.grammar is not None
    banned = seq.stop_ids if len(seq.output_ids) - 1 < seq.params.min_new_tokens else frozenset()
    if seq.grammar.allows_a_token(banned):
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
    seq.output_ids.append(token)
    if info is not None:
        seq.logprobs.append(info)
    if seq.first_token_time is None:
        seq.first_token_time = time.monotonic()
    if seq.grammar is not None and not seq.grammar.accept(token):
        seq.finish_reason, seq.error = FinishReason.ERROR, _refusal(seq, token)
        return SequenceEvent("", True)
    if token in seq.stop_ids:
        seq.finish_reason, seq.matched_stop = FinishReason.STOP, token
        piece = ""
    else:
        piece = seq.detokenizer.push(token)
        if seq.grammar is not None and seq.grammar.complete:  # no stop token to wait for (ignore_eos)
            seq.finish_reason = FinishReason.STOP
    if seq.finish_reason is None and len(seq.output_ids) >= seq.max_tokens:
        seq.finish_reason = FinishReason.LENGTH
    final = seq.finish_reason is not None
    if final and seq.finish_reason is FinishReason.LENGTH:
        piece += seq.detokenizer.flush()
    delta = _release_text(seq, piece, final)
    if seq.finish_reason is None and (pattern := _stop_regex_match(seq, len(piece))) is not None:
        seq.finish_reason, seq.matched_stop = FinishReason.STOP, pattern
        delta, seq.text, seq.held = delta + seq.held, seq.text + seq.held, ""
    return SequenceEvent(delta, seq.finish_reason is not None)
