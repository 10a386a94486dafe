"""Scheduler policy 5: which decodes of a flight carry draft tokens, how many, and whether drafting pays at all.

Two layers decide.  The goodput rule cuts each flight's drafts where one more draft token would lower its
expected tokens per second: a sequence's draft tokens come true at the rate its earlier drafts did
(``PromptLookup.acceptance``), and a pass's time by rows is learnt from the passes run (``pass_times.py``).
That model leaves things out (the host's round trip that multi-step flights save, the sampler's cost per row,
an acceptance estimate still settling), so :class:`DraftSwitch` checks the result: for each size of flight it
measures the tokens per second that decode flights actually land with drafting allowed and without, and allows
it only where it wins, trying the other way now and then since traffic changes.  So speculation never costs
more than its exploration.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from fiberserve.engine.drafting import PromptLookup
from fiberserve.engine.flight import Flight, FlightItem, FlightResult
from fiberserve.engine.multi_step import Reserve
from fiberserve.engine.pass_times import PassTimes

#: Every EXPLORE_EVERY-th decision for a flight size takes the way that measured slower, so a change of traffic
#: (text that starts repeating, or stops) is noticed; each way is measured MIN_FLIGHTS times before either wins.
EXPLORE_EVERY, MIN_FLIGHTS = 16, 6

#: Each landed flight scales the tokens and seconds summed so far by this first: the rates follow about the
#: last fifty flights of their kind.
RATE_DECAY = 0.98


@dataclass
class _Rate:
    """Tokens per second of the decode flights landed one way, as decayed sums."""

    tokens: float = 0.0
    seconds: float = 0.0
    flights: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * RATE_DECAY + tokens
        self.seconds = self.seconds * RATE_DECAY + seconds
        self.flights += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class DraftSwitch:
    """Whether a flight of a given size may draft: the way (drafting allowed, or not) whose decode flights landed
    more tokens per second, measured per size class (sequences in the flight, by powers of two)."""

    def __init__(self, fixed: bool | None = None) -> None:
        """``fixed``: None to learn as above; True or False to allow drafting always or never."""
        self.fixed = fixed
        self.rates: defaultdict[tuple[int, bool], _Rate] = defaultdict(_Rate)
        self._decisions: defaultdict[int, int] = defaultdict(int)

    @staticmethod
    def size_class(sequences: int) -> int:
        return sequences.bit_length()

    def allows(self, sequences: int) -> bool:
        if self.fixed is not None:
            return self.fixed
        size = self.size_class(sequences)
        on, off = self.rates[size, True], self.rates[size, False]
        if min(on.flights, off.flights) < MIN_FLIGHTS:
            return on.flights <= off.flights
        self._decisions[size] += 1
        faster = on.per_second >= off.per_second
        return faster != (self._decisions[size] % EXPLORE_EVERY == 0)

    def observe(self, sequences: int, allowed: bool, tokens: int, seconds: float) -> None:
        self.rates[self.size_class(sequences), allowed].add(tokens, seconds)

    def describe(self) -> dict[str, dict[str, float | int]]:
        """Per size class (the most sequences in it), the tokens per second and flights measured each way."""
        out: dict[str, dict[str, float | int]] = {}
        for (size, allowed), rate in sorted(self.rates.items()):
            way = "drafting" if allowed else "plain"
            entry = out.setdefault(f"up to {(1 << size) - 1} sequences", {})
            entry[f"{way}_tokens_per_s"] = round(rate.per_second, 1)
            entry[f"{way}_flights"] = rate.flights
        return out


class Speculation:
    """Drafts by prompt lookup for a flight's free decodes, up to ``limit`` tokens each; 0: never."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.draft_tokens = 0  #: draft tokens computed
        self.accepted_tokens = 0  #: of them, kept
        #: What a forward pass costs by rows, per number of sequences in it (their attention differs), learnt
        #: from the passes that landed.
        self.pass_times: defaultdict[int, PassTimes] = defaultdict(PassTimes)
        self.switch = DraftSwitch()
        #: When the last flight landed, while work remained: the next flight's time starts there, so that the
        #: host's work between flights (landing, streaming, scheduling) counts against the way that needs more
        #: flights for its tokens.
        self._landed: float | None = None

    def board(self, flight: Flight) -> None:
        """Stamp a flight as it boards: whether it may draft (decided by :attr:`switch`), and since when it
        counts."""
        flight.boarded = time.perf_counter() if self._landed is None else self._landed
        self._landed = None
        flight.may_draft = self.limit > 0 and self.switch.allows(len(flight.items))

    def assign(self, items: list[FlightItem], budget: int, reserve: Reserve) -> bool:
        """Give a boarding flight's free decodes their drafts, reserving their pages (never by preempting: a
        draft is cut to what its pages cover).  True if any got one; such a flight runs one step."""
        for item, draft in zip(items, self.drafts(items, budget), strict=True):
            seq = item.seq
            if draft:
                draft = draft[: reserve(seq, item.start + 1, item.start + 1 + len(draft))]
            if draft:
                item.draft, item.length, item.pages = tuple(draft), 1 + len(draft), tuple(seq.pages)
        return any(item.draft for item in items)

    def halts(self, flight: Flight, budget: int) -> bool:
        """Whether a multi-step flight should land after its current step because one of its sequences would
        now carry a draft (its text started repeating), so that the next flight carries it."""
        if not flight.may_draft:
            return False
        following = [item.next_step(0) for item in flight.items if item.seq.finishing is None]
        return any(self.drafts(following, budget))

    def drafts(self, items: list[FlightItem], budget: int) -> list[list[int]]:
        """Each item's draft, cut where one more draft token would lower the flight's expected tokens per second.

        The i-th token of a draft is kept with chance ``acceptance ** i`` (``PromptLookup.acceptance``), and a pass
        of r rows over these sequences takes ``pass_times[len(items)].estimate(r)``.  Draft tokens are taken
        likeliest first while they fit the budget, and the flight keeps the count with the highest (sampled tokens
        + expected kept) / time."""
        proposals, acceptance = [], []
        for item in items:
            seq = item.seq
            room = min(self.limit, seq.max_tokens - len(seq.output_ids) - 1)
            proposals.append(self._propose(item, room) if item.decodes_freely else [])
            acceptance.append(seq.sampling.drafter.acceptance if seq.sampling.drafter else 0.0)
        candidates = sorted(
            (-(acceptance[index] ** (i + 1)), i, index)
            for index, draft in enumerate(proposals)
            for i in range(len(draft))
        )[: max(0, budget)]
        rows, times = sum(item.length for item in items), self.pass_times[len(items)]
        tokens = sum(1 for item in items if item.samples)
        best_rate, best_count, expected = tokens / times.estimate(rows), 0, float(tokens)
        for count, (minus_chance, _, _) in enumerate(candidates, start=1):
            expected -= minus_chance
            rate = expected / times.estimate(rows + count)
            if rate > best_rate:
                best_rate, best_count = rate, count
        lengths = [0] * len(items)
        for _, _, index in candidates[:best_count]:
            lengths[index] += 1
        return [draft[:length] for draft, length in zip(proposals, lengths, strict=True)]

    def _propose(self, item: FlightItem, k: int) -> list[int]:
        """The item's sequence's draft of up to ``k`` tokens (its lookup index is made on first use)."""
        seq = item.seq
        drafter = seq.sampling.drafter = seq.sampling.drafter or PromptLookup(self.limit)
        return drafter.propose(seq, k)

    def observe_step(self, result: FlightResult) -> None:
        """Learn a landed step's pass time, and count its drafts."""
        if result.seconds:
            self.pass_times[len(result.items)].observe(sum(item.length for item in result.items), result.seconds)
        for item, picks in zip(result.items, result.tokens, strict=True):
            if item.draft:
                self.draft_tokens += len(item.draft)
                self.accepted_tokens += len(picks) - 1

    def observe_flight(self, flight: Flight, tokens: int, work_remains: bool) -> None:
        """Learn what a landed flight of decodes yielded: ``tokens`` kept since it boarded."""
        now = time.perf_counter()
        if self.limit > 0 and all(item.length == 1 + len(item.draft) for item in flight.items):
            self.switch.observe(len(flight.items), flight.may_draft, tokens, now - flight.boarded)
        self._landed = now if work_remains else None
