"""A flight and the program instance that runs it on a fiber.

A :class:`Flight` is a snapshot taken by the scheduler: for each sequence,
which of its tokens to compute now and the pages they live in.  While the
flight is in the air the scheduler leaves those sequences alone (a sequence is
in at most one flight), so the runner may read them without locks.

:class:`ModelRunner` is the stateful thing a fiber's ``Program`` instance
holds: the model (shared, read-only), the KV cache (shared; each flight
touches only its own sequences' pages) and per-instance scratch.  It builds
the flat batch, runs the forward pass and samples, all on the fiber's worker.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token, so its logits pick the next one (unless the
        sequence only scores its prompt: ``max_tokens`` 0)."""
        return self.start + self.length == self.seq.num_tokens and self.seq.max_tokens > 0

    @property
    def scored_prompt(self) -> range:
        """The positions of this chunk whose logits score the next prompt token (for ``prompt_logprobs``)."""
        if not self.seq.scores_prompt:
            return range(0)
        return range(self.start, min(self.start + self.length, len(self.seq.prompt_ids) - 1))


@dataclass
class Flight:
    items: list[FlightItem]

    @property
    def num_tokens(self) -> int:
        return sum(item.length for item in self.items)


@dataclass
class FlightResult:
    """One entry per flight item: the sampled token (or None for a partial prefill chunk), and the logprobs of
    the prompt tokens its chunk scored, in order from the token after its first position (empty if none)."""

    tokens: list[tuple[int, TokenLogprob | None] | None]
    prompt_logprobs: list[list[TokenLogprob]]


class ModelRunner:
    """The per-fiber program instance: ``runner(flight) -> FlightResult``."""

    def __init__(self, model: LlamaModel, cache: KVCache, threads: int | None, faults: FaultInjector) -> None:
        self.model = model
        self.cache = cache
        self.page_size = cache.page_size
        self.faults = faults
        if threads:
            torch.set_num_threads(threads)  # per calling thread: this fiber's worker

    def build_batch(self, flight: Flight) -> ForwardBatch:
        """The flight as one flat batch, built in Python lists (a few microseconds per item) and turned
        into tensors once: per-item tensor ops cost ~1 ms per step at 64 sequences.  Its logit rows are, item
        by item, the rows scoring prompt tokens (``scored_prompt``), then the sampling row."""
        page_size = self.page_size
        tokens, positions, write_slots, spans, logit_rows = [], [], [], [], []
        row = 0
        for item in flight.items:
            end = item.start + item.length
            tokens.extend(item.seq.token_slice(item.start, end))
            positions.extend(range(item.start, end))
            write_slots.extend(item.pages[p // page_size] * page_size + p % page_size for p in range(item.start, end))
            spans.append(SequenceSpan(row, item.length, end, pages=item.pages))
            logit_rows.extend(row + p - item.start for p in item.scored_prompt)
            row += item.length
            if item.samples:
                logit_rows.append(row - 1)
        return ForwardBatch(
            tokens=torch.tensor(tokens, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            write_slots=torch.tensor(write_slots, dtype=torch.long),
            spans=spans,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long),
        )

    def __call__(self, flight: Flight) -> FlightResult:
        self.faults.maybe_fail()
        batch = self.build_batch(flight)
        sampling = [item.seq for item in flight.items if item.samples]
        scoring = any(item.scored_prompt for item in flight.items)
        scored: list[list[TokenLogprob]] = [[] for _ in flight.items]
        if not scoring and sampling and all(seq.params.argmax_only for seq in sampling):  # no logits written
            picked = iter([(token, None) for token in self.model.greedy(batch, self.cache)])
        else:
            logits = self.model.forward(batch, self.cache)
            if scoring:
                logits = self._score_prompts(flight, logits, scored)
            picked = iter(sample(logits, sampling) if sampling else [])
        return FlightResult([next(picked) if item.samples else None for item in flight.items], scored)

    @staticmethod
    def _score_prompts(flight: Flight, logits: torch.Tensor, scored: list[list[TokenLogprob]]) -> torch.Tensor:
        """Fill ``scored`` with each item's prompt logprobs; return the sampling rows' logits."""
        row, sampling_rows = 0, []
        for i, item in enumerate(flight.items):
            positions = item.scored_prompt
            if positions:
                targets = item.seq.prompt_ids[positions.start + 1 : positions.stop + 1]
                top = item.seq.params.prompt_logprobs or 0
                scored[i] = score_tokens(logits[row : row + len(positions)], targets, top)
                row += len(positions)
            if item.samples:
                sampling_rows.append(row)
                row += 1
        return logits[sampling_rows]
