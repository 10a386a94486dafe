""":class:`ModelRunner`: the program instance that runs a flight (``flight.py``) on a fiber.

It is the stateful thing a fiber's ``Program`` instance holds: the model (shared, read-only), the KV cache
(shared; each flight touches only its own sequences' pages) and per-instance scratch.  It builds the flat batch,
runs the forward pass and samples, all on the fiber's worker; a multi-step flight's steps run back to back there.
A call changes nothing in the runner, so one runner may serve several threads at once (``--isolation none``) and
move between threads (``per_call``): each call sets the calling thread's team.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from fiberserve.engine.faults import FaultInjector, FaultPoint
from fiberserve.engine.flight import Flight, FlightItem, FlightResult
from fiberserve.engine.sampler import race_parameters, sample, score_tokens
from fiberserve.engine.sequence_output import TokenLogprob
from fiberserve.model.batch import ForwardBatch, KVCache, SequenceSpan
from fiberserve.model.llama import LlamaModel
from fiberserve.model.small_tensors import tensor_of


class ModelRunner:
    """The per-fiber program instance: ``runner(flight) -> FlightResult``."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        team: Callable[[], int],
        faults: FaultInjector,
    ) -> None:
        """``team``: how many threads the calling thread's products use, asked before each flight
        (``runtime/cpu_share.py``'s ``ThreadTeams``)."""
        self.model = model
        self.cache = cache
        self.page_size = cache.page_size
        self.faults = faults
        self.team = team

    def build_batch(self, items: list[FlightItem]) -> ForwardBatch:
        """The flight as one flat batch, built in Python lists (a few microseconds per item) and turned
        into tensors once: tensor ops per item would cost more than the step's sampling.  Its logit rows are, item
        by item, the rows scoring prompt tokens (``scored_prompt``), the rows an embedding pools
        (``pooled_positions``), then the picking rows (``sample_rows``)."""
        page_size = self.page_size
        tokens: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        spans: list[SequenceSpan] = []
        logit_rows: list[int] = []
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
            logit_rows.extend(row + p - item.start for p in item.pooled_positions)
            row += item.length
            logit_rows.extend(range(row - item.sample_rows, row))
        return ForwardBatch(
            tokens=tensor_of(tokens, torch.long),
            positions=tensor_of(positions, torch.long),
            write_slots=tensor_of(write_slots, torch.long),
            spans=spans,
            logit_rows=tensor_of(logit_rows, torch.long),
        )

    def __call__(self, flight: Flight) -> FlightResult:
        """Run the flight's steps (see the module docstring); return the last step's result.

        ``flight.on_takeoff`` is called as the first step's decoder layers start, and a step is handed to
        ``flight.on_step`` once the next one's layers start, not as soon as it is done: the event loop's thread,
        woken by either, then finds the GIL free (woken earlier, its Python would take the GIL from this
        thread's between the steps)."""
        if (threads := self.team()) != torch.get_num_threads():  # the calling thread's; results do not depend on it
            torch.set_num_threads(threads)
        items: list[FlightItem] = flight.items
        publish: Callable[[], object] | None = flight.on_takeoff
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
        self.faults.maybe_fail(FaultPoint.START)
        started = time.perf_counter()
        batch = self.build_batch(items)
        batch.before_layers = functools.partial(self._layers_start, before_layers)
        sampling = [item.seq for item in items for _ in range(item.sample_rows)]
        positions = [position for item in items for position in item.sampled_positions]
        scoring = any(item.scored_prompt for item in items)
        pooling = any(item.pooled_positions for item in items)
        scored: list[list[TokenLogprob]] = [[] for _ in items]
        pooled: list[torch.Tensor | None] = []
        if not (scoring or pooling) and sampling and all(seq.params.picked_from_raw_logits for seq in sampling):
            race = race_parameters(sampling, positions)  # the head's kernel picks: no logits written
            tokens: list[tuple[int, TokenLogprob | None]] = [
                (t, None) for t in self.model.pick(batch, self.cache, race)
            ]
            picked = iter(tokens)
        else:
            hidden = self.model.final_hidden(batch, self.cache)
            if pooling:
                hidden, pooled = self._take_pooled(items, hidden)
            logits = self.model.logits_of(hidden) if scoring or sampling else hidden
            if scoring:
                logits = self._score_prompts(items, logits, scored)
            picked = iter(sample(logits, sampling, positions) if sampling else [])
        picks = [item.accept([next(picked) for _ in range(item.sample_rows)]) for item in items]
        return FlightResult(picks, scored, items, time.perf_counter() - started, pooled)

    def _layers_start(self, before_layers: Callable[[], object] | None) -> None:
        """As the step's layers start: its inputs and K/V slots are built, no K/V is written yet."""
        if before_layers is not None:
            before_layers()
        self.faults.maybe_fail(FaultPoint.LAYERS)

    @staticmethod
    def _take_pooled(items: list[FlightItem], hidden: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Split the embeddings' rows (``pooled_positions``) off ``hidden``: the other rows, and per item its
        pooled rows (None where it pools none)."""
        row, kept, pooled = 0, list[int](), list[torch.Tensor | None]()
        for item in items:
            scoring, pooling = len(item.scored_prompt), len(item.pooled_positions)
            kept.extend(range(row, row + scoring))
            row += scoring
            pooled.append(hidden[row : row + pooling].clone() if pooling else None)
            row += pooling
            kept.extend(range(row, row + item.sample_rows))
            row += item.sample_rows
        return hidden[kept], pooled

    @staticmethod
    def _score_prompts(items: list[FlightItem], logits: torch.Tensor, scored: list[list[TokenLogprob]]) -> torch.Tensor:
        """Fill ``scored`` with each item's prompt logprobs; return the sampling rows' logits."""
        row, sampling_rows = 0, list[int]()
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
