"""A flight and the program instance that runs it on a fiber.

A :class:`Flight` is a snapshot taken by the scheduler: for each sequence,
which of its tokens to compute now and the pages they live in.  While the
flight is in the air the scheduler leaves those sequences alone (a sequence is
in at most one flight), so the runner may read them without locks.

A flight of a few plain decodes may run several steps (``Flight.steps``, vLLM's
former multi-step scheduling): the runner feeds each step the tokens the
previous one sampled (``FlightItem.token``: the runner knows them before the
sequence does) and hands every step but the last to ``Flight.on_step``, which
lands it on the host's loop while the next step computes.  The fiber then
goes from one step to the next without the round trip through the host
(~0.4-0.7 ms a step on 2 cores: 5-8% of a one-sequence decode).  After the
first step the runner reads only what landing does not change (parameters,
sampling key, stop tokens, the abort flag); the host appends the tokens meanwhile.

A decode may also carry draft tokens (``FlightItem.draft``, speculative
decoding; see ``drafting.py``): its chunk is the last token then the draft, every
row picks, and the item keeps the picks up to the first draft token the model
would not have picked (:meth:`FlightItem.accept`).

:class:`ModelRunner` is the stateful thing a fiber's ``Program`` instance
holds: the model (shared, read-only), the KV cache (shared; each flight
touches only its own sequences' pages) and per-instance scratch.  It builds
the flat batch, runs the forward pass and samples, all on the fiber's worker.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fiberserve.engine.faults import FaultInjector
from fiberserve.engine.sampler import sample, score_tokens
from fiberserve.engine.sequence import Sequence, TokenLogprob
from fiberserve.model.llama import ForwardBatch, KVCache, LlamaModel, SequenceSpan


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
            if kept[-1][0] != drafted or drafted in self.seq.stop_ids:
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
            and self.seq.grammar is None
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


@dataclass(eq=False)
class Flight:
    items: list[FlightItem]
    #: Decode steps the runner may run before the flight lands (more than 1 only for items that all
    #: ``decodes_freely``, their pages reserved for every step).
    steps: int = 1
    #: Called on the worker with each step's result but the last (which the invocation returns); it must hand
    #: the result to the host's loop.  Needed when ``steps`` > 1.
    on_step: Callable[[FlightResult], object] | None = None
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

    def ends_after(self, result: FlightResult) -> bool:
        """Whether the runner returns now rather than run another step: the host halted the flight, or one of
        its sequences is ending (a stop token just sampled; an abort, or a stop string the host found).  Read
        on the worker while the host may write: a flag seen one step late costs a step, never a token."""
        if self.halted:
            return True
        return any(
            item.seq.abort_requested or item.seq.finishing is not None or (picks and picks[-1][0] in item.seq.stop_ids)
            for item, picks in zip(result.items, result.tokens, strict=True)
        )


@dataclass
class FlightResult:
    """One entry per item of ``items`` (the flight's items, or the items of the step it comes from): the picked
    tokens in order (none for a partial prefill chunk, one for a decode, up to ``1 + len(draft)`` for a drafted
    one; see :meth:`FlightItem.accept`), and the logprobs of the prompt tokens its chunk scored, in order from
    the token after its first position (empty if none)."""

    tokens: list[list[tuple[int, TokenLogprob | None]]]
    prompt_logprobs: list[list[TokenLogprob]]
    items: list[FlightItem] = field(default_factory=list)
    seconds: float = 0.0  #: how long the step took on its worker (0: not measured)


class ModelRunner:
    """The per-fiber program instance: ``runner(flight) -> FlightResult``."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        threads: int | None,
        faults: FaultInjector,
        free_cores: Callable[[], int] | None = None,
    ) -> None:
        """``threads``: this fiber's thread team; ``free_cores``, if given, narrows it before each flight to the
        cores other processes leave free (``runtime/cpu_share.py``)."""
        self.model = model
        self.cache = cache
        self.page_size = cache.page_size
        self.faults = faults
        self.free_cores = free_cores
        self.threads = threads
        if threads:
            torch.set_num_threads(threads)  # per calling thread: this fiber's worker

    def build_batch(self, items: list[FlightItem]) -> ForwardBatch:
        """The flight as one flat batch, built in Python lists (a few microseconds per item) and turned
        into tensors once: per-item tensor ops cost ~1 ms per step at 64 sequences.  Its logit rows are, item
        by item, the rows scoring prompt tokens (``scored_prompt``), then the picking rows (``sample_rows``)."""
        page_size = self.page_size
        tokens, positions, write_slots, spans, logit_rows = [], [], [], [], []
        row = 0
        for item in items:
            end = item.start + item.length
            if item.token is not None:
                tokens.append(item.token)
            else:
                tokens.extend(item.seq.token_slice(item.start, end - len(item.draft)))
                tokens.extend(item.draft)
            positions.extend(range(item.start, end))
            write_slots.extend(item.pages[p // page_size] * page_size + p % page_size for p in range(item.start, end))
            spans.append(SequenceSpan(row, item.length, end, pages=item.pages))
            logit_rows.extend(row + p - item.start for p in item.scored_prompt)
            row += item.length
            logit_rows.extend(range(row - item.sample_rows, row))
        return ForwardBatch(
            tokens=torch.tensor(tokens, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            write_slots=torch.tensor(write_slots, dtype=torch.long),
            spans=spans,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long),
        )

    def __call__(self, flight: Flight) -> FlightResult:
        """Run the flight's steps (see the module docstring); return the last step's result.

        A step is handed to ``flight.on_step`` once the next one's decoder layers start, not as soon as it is
        done: the event loop's thread, woken by it, then finds the GIL free (handed over at once, it took the
        GIL from this thread's Python between the steps for 0.1-0.4 ms a step)."""
        if self.free_cores is not None and (threads := self.free_cores()) != self.threads:
            torch.set_num_threads(threads)  # the kernels' rows do not depend on the team's size
            self.threads = threads
        items, publish = flight.items, None
        for _ in range(flight.steps - 1):
            result = self.step(items, publish)
            if flight.ends_after(result):
                return result
            items = [item.next_step(picks[0][0]) for item, picks in zip(items, result.tokens, strict=True)]
            publish = functools.partial(flight.on_step, result)
        return self.step(items, publish)

    def step(self, items: list[FlightItem], before_layers: Callable[[], object] | None = None) -> FlightResult:
        """One forward pass over ``items`` (calling ``before_layers`` as its layers start), then the picks of
        the items that sample."""
        self.faults.maybe_fail()
        started = time.perf_counter()
        batch = self.build_batch(items)
        batch.before_layers = before_layers
        sampling = [item.seq for item in items for _ in range(item.sample_rows)]
        positions = [position for item in items for position in item.sampled_positions]
        scoring = any(item.scored_prompt for item in items)
        scored: list[list[TokenLogprob]] = [[] for _ in items]
        if not scoring and sampling and all(seq.params.argmax_only for seq in sampling):  # no logits written
            picked = iter([(token, None) for token in self.model.greedy(batch, self.cache)])
        else:
            logits = self.model.forward(batch, self.cache)
            if scoring:
                logits = self._score_prompts(items, logits, scored)
            picked = iter(sample(logits, sampling, positions) if sampling else [])
        picks = [item.accept([next(picked) for _ in range(item.sample_rows)]) for item in items]
        return FlightResult(picks, scored, items, time.perf_counter() - started)

    @staticmethod
    def _score_prompts(items: list[FlightItem], logits: torch.Tensor, scored: list[list[TokenLogprob]]) -> torch.Tensor:
        """Fill ``scored`` with each item's prompt logprobs; return the sampling rows' logits."""
        row, sampling_rows = 0, []
        for i, item in enumerate(items):
            positions = item.scored_prompt
            if positions:
                targets = item.seq.prompt_ids[positions.start + 1 : positions.stop + 1]
                top = item.seq.params.prompt_logprobs or 0
                scored[i] = score_tokens(logits[row : row + len(positions)], targets, top)
                row += len(positions)
            sampling_rows.extend(range(row, row + item.sample_rows))
            row += item.sample_rows
        return logits[sampling_rows]
