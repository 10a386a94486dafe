""":class:`ModelRunner`: the program instance that runs a flight (``flight.py``) on a fiber.

It is the stateful thing a fiber's ``Program`` instance holds: the model (shared, read-only), the KV cache
(shared; each flight touches only its own sequences' pages) and per-instance scratch.  It builds the flat batch,
runs the forward pass and samples, all on the fiber's worker; a multi-step flight's steps run back to back there.
A call changes nothing in the runner, so one runner may serve several threads at once (``--isolation none``) and
move between threads (``per_call``): each call sets the calling thread's team.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fiberserve.engine.faults import FaultInjector, FaultPoint
from fiberserve.engine.flight import Flight, FlightItem, FlightResult
from fiberserve.engine.sampler import race_parameters, sample, score_tokens
from fiberserve.engine.sequence_output import TokenLogprob
from fiberserve.model.batch import ForwardBatch, KVCache, SequenceSpan
from fiberserve.model.llama import LlamaModel
from fiberserve.model.lora import LoraAdapter, LoraRows
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
        (``pooled_positions``), then the picking rows (``sample_rows``).  The rows of sequences under a LoRA adapter
        are grouped by adapter."""
        page_size = self.page_size
        tokens: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        spans: list[SequenceSpan] = []
        logit_rows: list[int] = []
        adapted: dict[int, tuple[LoraAdapter, list[int]]] = {}
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
            if (adapter := item.seq.adapter) is not None:
                adapted.setdefault(adapter.uid, (adapter, []))[1].extend(range(row, row + item.length))
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
            lora=LoraRows([(adapter, tensor_of(rows, torch.long)) for adapter, rows in adapted.values()]),
        )

    def __call__(self, flight: Flight) -> FlightResult:
        """Run the flight's steps (see the module docstring); return the last step's result.  Each step takes
        off (:meth:`.Flight.take_off`) as its decoder layers start, with the step before it: the host's loop,
        woken then, finds the GIL free (woken earlier, its Python would take the GIL from this thread's while
        the step is prepared)."""
        if (threads := self.team()) != torch.get_num_threads():  # the calling thread's; results do not depend on it
            torch.set_num_threads(threads)
        items: list[FlightItem] = flight.items
        landed: FlightResult | None = None
        for _ in range(flight.steps - 1):
            landed = self.step(items, flight, landed)
            if flight.ends_after(landed):
                return landed
            items = [item.next_step(picks[0][0]) for item, picks in zip(items, landed.tokens, strict=True)]
        return self.step(items, flight, landed)

    def step(
        self, items: list[FlightItem], flight: Flight | None = None, landed: FlightResult | None = None
    ) -> FlightResult:
        """One forward pass over ``items``, then the picks of the items that sample; ``flight`` (if given) takes
        off with ``landed`` once the pass's inputs are built, as its layers start."""
        self.faults.maybe_fail(FaultPoint.START)
        started = time.perf_counter()
        inputs = self.model.prepare(self.build_batch(items), self.cache)
        sampling = [item.seq for item in items for _ in range(item.sample_rows)]
        positions = [position for item in items for position in item.sampled_positions]
        scoring = any(item.scored_prompt for item in items)
        pooling = any(item.pooled_positions for item in items)
        head_picks = not (scoring or pooling) and sampling and all(s.params.picked_from_raw_logits for s in sampling)
        race = race_parameters(sampling, positions) if head_picks else None
        if flight is not None:
            flight.take_off(landed)
        self.faults.maybe_fail(FaultPoint.LAYERS)
        hidden = self.model.run_layers(inputs)
        scored: list[list[TokenLogprob]] = [[] for _ in items]
        pooled: list[torch.Tensor | None] = []
        if head_picks:  # the head's kernel picks: no logits written
            tokens: list[tuple[int, TokenLogprob | None]] = [(t, None) for t in self.model.head.pick(hidden, race)]
            picked = iter(tokens)
        else:
            if pooling:
                hidden, pooled = self._take_pooled(items, hidden)
            logits = self.model.logits_of(hidden) if scoring or sampling else hidden
            if scoring:
                logits = self._score_prompts(items, logits, scored)
            picked = iter(sample(logits, sampling, positions) if sampling else [])
        picks = [item.accept([next(picked) for _ in range(item.sample_rows)]) for item in items]
        return FlightResult(picks, scored, items, time.perf_counter() - started, pooled)

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
