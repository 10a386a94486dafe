"""A flight: the scheduler's snapshot of the work one invocation computes, and what it brings back.

For each sequence a :class:`FlightItem` says which of its tokens to compute now and the pages they live in.
While a flight is in the air the scheduler leaves its sequences alone (a sequence is in at most one flight), so
the runner may read them without locks.

As each step's decoder layers start, the runner tells the host's loop through the flight's :class:`Takeoffs`
(the host streams then, while the layers compute, not while the worker's Python prepares the step).

A flight of a few plain decodes may run several steps (``Flight.steps``, vLLM's former multi-step scheduling;
policy 4 in ``multi_step.py``): the runner feeds each step the tokens the previous one sampled
(``FlightItem.token``: the runner knows them before the sequence does) and hands every step but the last to the
host with the next step's takeoff, so the fiber goes from one step to the next without a round trip through
the host.  After the first step the runner reads only what landing does not change (parameters, sampling key,
stop tokens, the abort flag).

A decode may also carry draft tokens (``FlightItem.draft``, speculative decoding; policy 5 in
``speculation.py``): its chunk is the last token then the draft, every row picks, and the item keeps the picks
up to the first draft token the model would not have picked (:meth:`FlightItem.accept`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from fiberserve.engine.sequence import Sequence
from fiberserve.engine.sequence_output import TokenLogprob


@dataclass
class FlightItem:
    seq: Sequence
    start: int  #: first token index to compute
    length: int  #: how many tokens to compute
    pages: tuple[int, ...]  #: the sequence's pages, covering start + length tokens
    #: The input token of a later step of a multi-step flight (sampled by the step before; the sequence may not
    #: have it yet); None: read the tokens from the sequence.
    token: int | None = None
    #: Draft tokens computed after the sequence's last token (the chunk's last ``len(draft)`` rows).
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token, so its logits pick the next one (unless the
        sequence only scores its prompt: ``max_tokens`` 0)."""
        if self.token is not None:
            return True
        return self.start + self.length - len(self.draft) == self.seq.num_tokens and self.seq.max_tokens > 0

    @property
    def sample_rows(self) -> int:
        """How many of the chunk's last rows pick a token: the last known token's, and each draft token's."""
        return 1 + len(self.draft) if self.samples else 0

    @property
    def sampled_positions(self) -> range:
        """The positions (in the sequence's tokens) of the tokens its ``sample_rows`` pick, in row order."""
        end = self.start + self.length + 1
        return range(end - self.sample_rows, end)

    def accept(self, picks: list[tuple[int, TokenLogprob | None]]) -> list[tuple[int, TokenLogprob | None]]:
        """The picks this item keeps, one per ``sample_rows``: the first row's, then each next row's while the
        row before it picked the draft token that row was fed, and not after a stop token.  A row's pick is the
        token the sequence decoding alone would get there while every token before it is the sequence's own:
        the kernels are batch invariant (a row's logits do not depend on the rows beside it) and a sampled row
        draws with the noise of its position (``sampling_noise``).  For a sampled sequence this is speculative
        sampling's rejection rule with a one-token draft distribution: the draft is kept with the probability
        the model gives it, and otherwise the pick is a draw from the rest, so the output is unchanged."""
        kept = picks[:1]
        for drafted, pick in zip(self.draft, picks[1:], strict=True):
            if kept[-1][0] != drafted or drafted in self.seq.sampling.stop_ids:
                break
            kept.append(pick)
        return kept

    def computed_after(self, kept: int) -> int:
        """The sequence's ``num_computed`` once this chunk lands having kept ``kept`` picks: a drafted chunk's
        K/V are the sequence's own only up to the last draft token kept."""
        if not self.draft:
            return self.start + self.length
        return self.start + max(1, kept)

    @property
    def decodes_freely(self) -> bool:
        """A one-token decode whose next picks read nothing the host changes as steps land (no grammar, no
        penalties, no stop tokens banned by ``min_new_tokens``): the runner may feed it its own samples."""
        params = self.seq.params
        return (
            self.length == 1
            and self.samples
            and self.seq.sampling.grammar is None
            and not params.needs_penalties
            and len(self.seq.output_ids) >= params.min_new_tokens
        )

    def next_step(self, token: int) -> FlightItem:
        """This sequence's item in the next step of a multi-step flight, whose input is ``token``."""
        return FlightItem(self.seq, self.start + self.length, 1, self.pages, token)

    @property
    def scored_prompt(self) -> range:
        """The positions of this chunk whose logits score the next prompt token (for ``prompt_logprobs``)."""
        if self.token is not None or not self.seq.scores_prompt:
            return range(0)
        return range(self.start, min(self.start + self.length, len(self.seq.prompt_ids) - 1))

    @property
    def pooled_positions(self) -> range:
        """The positions of this chunk whose final hidden states an embedding pools (see
        :meth:`.Sequence.pooled_positions`)."""
        if self.token is not None:
            return range(0)
        return self.seq.pooled_positions(self.start, self.start + self.length)


@dataclass(eq=False)
class Flight:
    items: list[FlightItem]
    #: Decode steps the runner may run before the flight lands (more than 1 only for items that all
    #: ``decodes_freely``, their pages reserved for every step).
    steps: int = 1
    #: Where the runner tells the host each step's takeoff; set by the host as it runs the flight (None: the
    #: runner tells nobody).
    takeoffs: Takeoffs | None = None
    #: Set by the host: run no further step (new work waits to board, or the flight has failed).
    halted: bool = False
    #: Set by the host once the flight has landed or failed; a step handed over after that is dropped.
    landed: bool = False
    #: Set by the scheduler as it boards: whether its decodes may draft (``speculation.py``), and when.
    may_draft: bool = False
    boarded: float = 0.0
    #: Tokens its steps kept so far (counted by the scheduler as they land).
    tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(item.length for item in self.items)

    def take_off(self, landed: FlightResult | None) -> None:
        """Called on the worker as a step's decoder layers start, with the step before it (None for the
        first): the host lands that step and streams then."""
        if self.takeoffs is not None:
            self.takeoffs.tell(landed)

    def ends_after(self, result: FlightResult) -> bool:
        """Whether the runner returns now rather than run another step: the host halted the flight, or one of
        its sequences is ending (a stop token just sampled; an abort, or a stop string the host found).  Read
        on the worker while the host may write: a flag seen one step late costs a step, never a token."""
        if self.halted:
            return True
        return any(
            item.seq.abort_requested
            or item.seq.finishing is not None
            or (picks and picks[-1][0] in item.seq.sampling.stop_ids)
            for item, picks in zip(result.items, result.tokens, strict=True)
        )


@dataclass
class FlightResult:
    """One entry per item of ``items`` (the flight's items, or the items of the step it comes from): the picked
    tokens in order (none for a partial prefill chunk, one for a decode, up to ``1 + len(draft)`` for a drafted
    one; see :meth:`FlightItem.accept`), and the logprobs of the prompt tokens its chunk scored, in order from
    the token after its first position (empty if none); ``pooled``: per item, the final hidden states of its
    ``pooled_positions`` (None where it pools none; empty: no item pools)."""

    tokens: list[list[tuple[int, TokenLogprob | None]]]
    prompt_logprobs: list[list[TokenLogprob]]
    items: list[FlightItem] = field(default_factory=list)
    seconds: float = 0.0  #: how long the step took on its worker (0: not measured)
    pooled: list[torch.Tensor | None] = field(default_factory=list)


#: What :meth:`Takeoffs.until` reads once the call has returned.
_RETURNED = object()


class Takeoffs:
    """A flight's takeoffs, told on the worker (:meth:`tell`) and read in order on the host's loop
    (:meth:`until`); made on the loop that reads them."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._told: asyncio.Queue[FlightResult | object | None] = asyncio.Queue()

    def tell(self, landed: FlightResult | None) -> None:
        """On the worker: a step's layers start; ``landed`` is the step before it (None for the first)."""
        self._loop.call_soon_threadsafe(self._told.put_nowait, landed)

    async def until(self, call: asyncio.Future) -> AsyncIterator[FlightResult | None]:
        """Each takeoff told until ``call`` (the flight's invocation) is done: the step that landed with it (None
        for the first step's).  Takeoffs told after the call ended (a call that timed out runs on) are not read."""
        call.add_done_callback(lambda _: self._told.put_nowait(_RETURNED))
        while (landed := await self._told.get()) is not _RETURNED:
            yield landed  # type: ignore[misc]
