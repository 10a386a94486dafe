"""Scheduler tests without a model: sequences of characters, and flights landed as a runner would land them."""

from __future__ import annotations

from fiberserve.engine.flight import Flight, FlightItem, FlightResult
from fiberserve.engine.sampling_params import SamplingParams
from fiberserve.engine.scheduler import Scheduler
from fiberserve.engine.sequence import Sequence
from fiberserve.model.tokenizer import IncrementalDetokenizer

EOS = 3
GREEDY = SamplingParams(max_new_tokens=20, temperature=0)


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def sequence(params: SamplingParams = GREEDY, prompt: str = "hello", arrival: float | None = None) -> Sequence:
    ids = [ord(c) for c in prompt]
    seq = Sequence("r", 0, ids, params, IncrementalDetokenizer(CharTokenizer(), ids), frozenset({EOS}), 1000)
    if arrival is not None:
        seq.arrival = arrival
    return seq


def result(items: list[FlightItem], *tokens: int) -> FlightResult:
    """What a runner that picked ``tokens`` (one per item) returns."""
    return FlightResult([[(t, None)] for t in tokens], [[] for _ in tokens], items)


def land(scheduler: Scheduler, flight: Flight, tokens: list[int]) -> None:
    """Land ``flight`` as a runner that picked ``tokens`` (one per item that samples) would."""
    picks = iter(tokens)
    scheduler.on_flight_done(
        flight,
        FlightResult(
            [[(next(picks), None)] if i.samples else [] for i in flight.items], [[]] * len(flight.items), flight.items
        ),
    )


def decoding(scheduler: Scheduler, *seqs: Sequence) -> None:
    """Admit ``seqs`` and land their prefill, so that each has one output token and decodes next."""
    for seq in seqs:
        scheduler.add(seq)
    prefill = scheduler.next_flight()
    assert prefill.steps == 1
    land(scheduler, prefill, [ord("!")] * len(seqs))
