"""What a sequence's consumer sees: the text released so far (a possible stop string held back), the sampled
tokens' logprobs, what stopped it, the queue of its events, read by one consumer, and what its prompt gave (its
tokens' logprobs, an embedding's pooled rows)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fiberserve.engine.stop_regex import compile_stop_regex
from fiberserve.model.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from fiberserve.engine.sequence import Sequence


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


class EventsTaken(RuntimeError):
    """A second consumer asked for a sequence's events: each sequence has one reader (a waiter or a stream)."""


class EventForwarder:
    """Stands in for a sequence's event queue: each event goes to a shared queue, tagged with its sequence."""

    def __init__(self, seq: Sequence, sink: asyncio.Queue[tuple[Sequence, SequenceEvent]]) -> None:
        self.seq, self.sink = seq, sink

    def put_nowait(self, event: SequenceEvent) -> None:
        self.sink.put_nowait((self.seq, event))


class SequenceOutput:
    """A sequence's text, logprobs and events.  ``text`` is what was released to the consumer; ``held`` what is
    not yet released because it may begin a stop string."""

    def __init__(self, detokenizer: IncrementalDetokenizer | None, scored_prompt: int | None = None) -> None:
        """``scored_prompt``: the prompt's length where its tokens' logprobs are asked for, else None."""
        self.detokenizer = detokenizer
        self.text = ""
        self.held = ""
        self.logprobs: list[TokenLogprob] = []
        #: What ended the sequence with ``stop``: the stop string, the stop token or the stop regex's pattern.
        self.matched_stop: str | int | None = None
        #: Where the scheduler puts the events (``put_nowait``): this output's own queue, read with
        #: ``LlmService.events``, or a consumer's shared one (:meth:`forward_events`).
        self.events: asyncio.Queue[SequenceEvent] | EventForwarder = asyncio.Queue()
        #: Whether a consumer reads the events (each has one), and whether it has read the last.
        self.events_taken = self.events_read = False
        #: Per prompt position, the logprob of that token given the ones before (None for the first), if asked.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if scored_prompt is None else [None] * scored_prompt
        )
        #: An embedding's pooled final hidden states: the last prompt token's row [1, hidden], or every prompt
        #: token's [prompt, hidden], float32, written as the chunks computing them land.
        self.pooled_rows: torch.Tensor | None = None
        self.first_token_time: float | None = None  #: ``time.monotonic()`` as the first token landed
        self.finish_time: float | None = None  #: and as the sequence finished

    def keep_pooled(self, first: int, rows: torch.Tensor, count: int) -> None:
        """Store the final hidden states ``rows`` as pooled rows ``first:`` of ``count`` (a recompute after a
        preemption writes the same rows again)."""
        if self.pooled_rows is None:
            self.pooled_rows = torch.empty(count, rows.shape[1], dtype=torch.float32)
        self.pooled_rows[first : first + len(rows)] = rows

    def pooled(self) -> torch.Tensor:
        """The embedding, once the prompt is computed: the pooled rows' mean (the last row alone for ``last``),
        float32 [hidden], not normalized; its bits do not depend on how the prompt was split into chunks."""
        assert self.pooled_rows is not None, "pooled once the prompt is computed"
        return self.pooled_rows.mean(dim=0)

    def take_events(self, owner: str) -> None:
        """Claim the events for one consumer; :class:`EventsTaken` (naming ``owner``) if another has them."""
        if self.events_taken:
            raise EventsTaken(
                f"{owner} already has a consumer of its events: wait on a request or stream it, not both, and from "
                "one task"
            )
        self.events_taken = True

    def release(self, piece: str, final: bool, stops: list[str], include_stop: bool) -> tuple[str, str | None]:
        """Add ``piece`` to the pending text; return what may be shown now and the stop string it completed, if
        any (cut out of the text unless ``include_stop``).  Unless ``final``, the end that may begin one of
        ``stops`` is held back."""
        pending = self.held + piece
        start = len(self.text)
        full = self.text + pending
        if stops:
            hits = [(i, s) for s in stops if (i := full.find(s, max(0, start - len(s) + 1))) >= 0]
            if hits:
                index, matched = min(hits)
                end = index + len(matched) if include_stop else index
                self.held, self.text = "", full[:end]
                return full[start:end], matched
            if not final:
                cut = max(start, len(full) - (max(len(s) for s in stops) - 1))
                self.held, self.text = full[cut:], full[:cut]
                return full[start:cut], None
        self.held, self.text = "", full
        return pending, None

    def release_held(self) -> str:
        """Release the held text (a stop regex matched: what it matched is kept); return it."""
        held, self.text, self.held = self.held, self.text + self.held, ""
        return held

    def regex_match(self, patterns: list[str], fresh: int) -> str | None:
        """The first of ``patterns`` with a match ending in the text's last ``fresh`` characters (held text
        included), if any."""
        text = self.text + self.held
        return next((p for p in patterns if compile_stop_regex(p).search_tail(text, fresh)), None)
