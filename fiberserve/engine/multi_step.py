"""Scheduler policy 4: a flight of a few plain decodes runs several steps before it lands.

A flight of at most ``MULTI_STEP_MAX_SEQUENCES`` items that all ``decodes_freely``, with nobody waiting, may
run up to ``decode_steps`` steps, bounded by each sequence's remaining tokens and by the pages free to reserve
for them now (never by preempting).  Each step lands as it comes (``Scheduler.on_step``); a new arrival halts
the flights in the air after their current step, so admission waits at most one step.
"""

from __future__ import annotations

from collections.abc import Callable

from fiberserve.engine.flight import Flight, FlightItem
from fiberserve.engine.sequence import Sequence

#: ``Scheduler.reserve`` without preemption: (sequence, start, end) -> tokens from start its pages cover.
Reserve = Callable[[Sequence, int, int], int]

#: Multi-step flights carry at most this many sequences.  Their steps land on the event loop while the next
#: computes, so on a CPU whose cores all run the fiber's threads the loop's work competes with them: a few
#: sequences gain the round trip of every step, while many streamed ones lose more than that.
MULTI_STEP_MAX_SEQUENCES = 4


class MultiStep:
    """How many steps each flight may run, and the multi-step flights in the air."""

    def __init__(self, decode_steps: int, reserve: Reserve) -> None:
        self.decode_steps = decode_steps
        self.reserve = reserve
        self.in_air: list[Flight] = []

    def steps(self, items: list[FlightItem], anyone_waiting: bool) -> int:
        """How many steps a flight of ``items`` may run; reserves the pages they need for them."""
        if self.decode_steps <= 1 or anyone_waiting or len(items) > MULTI_STEP_MAX_SEQUENCES:
            return 1
        if not all(item.decodes_freely for item in items):
            return 1
        steps = min(self.decode_steps, *(item.seq.max_tokens - len(item.seq.output_ids) for item in items))
        for item in items:
            if steps > 1:
                steps = self.reserve(item.seq, item.start, item.start + steps)
        for item in items:
            item.pages = tuple(item.seq.pages)
        return max(1, steps)

    def took_off(self, flight: Flight) -> None:
        if flight.steps > 1:
            self.in_air.append(flight)

    def landed(self, flight: Flight) -> None:
        if flight.steps > 1:
            self.in_air.remove(flight)

    def halt_all(self) -> None:
        """Make every flight in the air land after its current step (new work waits to board)."""
        for flight in self.in_air:
            flight.halted = True
