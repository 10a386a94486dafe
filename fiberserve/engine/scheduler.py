"""The scheduler: which sequences fly next, and what happens when a flight lands.

Policy, in the order :meth:`Scheduler.next_flight` applies it:

1. Running sequences that are not in the air, decodes first (one token each),
   then unfinished prefills, oldest first; each gets as many of its pending
   tokens as the token budget (``max_batch_tokens``) leaves, so long prompts
   are prefilled in chunks while decodes keep flowing.
2. Waiting sequences are admitted in arrival order while the budget, the cap
   on running sequences (``max_running``) and free pages allow; their prompt
   prefix is first matched against the prefix cache.  Admission never
   preempts anyone: new work waits for pages.  A waiting sequence whose next
   uncached page of prompt a running sequence of its adapter is computing
   waits for that page to be cached rather than compute it again, and later
   arrivals may pass it meanwhile (SGLang's in-batch prefix caching: a burst
   of requests with one system prompt computes it once).
3. A running sequence that needs a page when none is left preempts the most
   recently arrived running sequence that is not in the air (it loses the
   least work; its full pages stay in the prefix cache, so its recompute is
   often cheap); the victim goes back to the front of the queue.
4. A flight of a few plain decodes with nobody waiting runs several steps
   before it lands (``multi_step.py``).
5. Decodes may carry draft tokens by prompt lookup, where drafting pays
   (``speculation.py``); this is decided before policy 4: a flight with a
   draft runs one step.

Every sequence ends in exactly one of stop, length, abort, error, and its
pages are released in all four (:meth:`finish`).  A sequence in the air is
never freed: an abort only flags it, and it is finished when its flight lands.
A flight whose call timed out lands failed while the call may still write its
sequences' K/V: their pages go to a quarantine under the call's fiber, not back
to the pool (:meth:`on_flight_failed`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from fiberserve.engine.flight import Flight, FlightItem, FlightResult
from fiberserve.engine.kvcache import PagePool
from fiberserve.engine.multi_step import MultiStep
from fiberserve.engine.sequence import FinishReason, Sequence, Status, append_token
from fiberserve.engine.sequence_output import SequenceEvent
from fiberserve.engine.speculation import Speculation


class Scheduler:
    """Decides each flight (:meth:`next_flight`) and lands it (:meth:`on_step`, :meth:`on_flight_done`,
    :meth:`on_flight_failed`); owns the waiting queue, the running list and, through them, every page held."""

    def __init__(
        self,
        pages: PagePool,
        max_running: int,
        max_batch_tokens: int,
        decode_steps: int = 1,
        speculative_tokens: int = 0,
    ) -> None:
        self.pages = pages
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.multi_step = MultiStep(decode_steps, self.reserve)
        self.speculation = Speculation(speculative_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  #: admitted: holding pages, in the air or not
        self.preemptions = 0
        #: Called with every sequence as it finishes, whatever the reason (metrics listen here: an aborted
        #: sequence in the air finishes when its flight lands, after its request has been let go).
        self.finish_listeners: list[Callable[[Sequence], None]] = []
        #: Events recorded while held (:meth:`hold_events`), not yet on their sequences' queues.
        self._held: list[tuple[Sequence, SequenceEvent]] | None = None

    # ------------------------------------------------------------------ intake

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.multi_step.halt_all()

    def abort(self, seq: Sequence) -> None:
        """Stop ``seq`` now, or when its flight lands if it is in the air."""
        if seq.finished:
            return
        seq.abort_requested = True
        if not seq.in_flight:
            self.finish(seq, FinishReason.ABORT)

    # ------------------------------------------------------------------ flights

    def next_flight(self) -> Flight | None:
        """The next batch of work under the token budget, or None if nothing can fly now."""
        budget = self.max_batch_tokens
        items: list[FlightItem] = []
        ready = [s for s in self.running if not s.in_flight]
        ready.sort(key=lambda s: (s.num_tokens - s.num_computed > 1, s.arrival))
        for seq in ready:
            if budget == 0:
                break
            if seq.status is Status.RUNNING:  # an earlier reservation may have preempted it
                budget -= self._board(seq, budget, items, may_preempt=True)
        passed: list[Sequence] = []  # waiting for a page of their prompt that a running prefill computes
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if self._prefix_being_computed(seq):
                passed.append(self.waiting.popleft())
                continue
            if not self._admit(seq):
                break  # FIFO: later arrivals do not overtake one waiting for pages
            self.waiting.popleft()
            budget -= self._board(seq, budget, items, may_preempt=False)
        self.waiting.extendleft(reversed(passed))
        if not items:
            return None
        flight = Flight(items)
        self.speculation.board(flight)
        if not (flight.may_draft and self.speculation.assign(items, budget, self.reserve)):
            flight.steps = self.multi_step.steps(items, anyone_waiting=bool(self.waiting))
        self.multi_step.took_off(flight)
        return flight

    def _prefix_being_computed(self, seq: Sequence) -> bool:
        """Whether a running sequence under ``seq``'s adapter computes the first full page of ``seq``'s prompt
        that the prefix cache lacks next, and will cache it: it has the same tokens up to that page's end, has
        computed and cached exactly the pages before it (a sequence whose chain of cached pages broke caches no
        more, so nobody waits for it)."""
        if seq.computes_whole_prompt or not self.pages.prefix_caching:
            return False
        ps = self.pages.page_size
        cached = self.pages.cached_prefix_pages(seq.tokens, seq.adapter_uid)
        end = (cached + 1) * ps
        if end >= seq.num_tokens:  # no full page is left to share: the last token is always computed
            return False
        prefix = seq.token_slice(0, end)
        return any(
            other.adapter_uid == seq.adapter_uid
            and other.registered_pages == other.num_computed // ps == cached
            and other.num_tokens >= end
            and other.token_slice(0, end) == prefix
            for other in self.running
        )

    def _admit(self, seq: Sequence) -> bool:
        # A prompt being scored (or mean-pooled) is computed whole: cached pages would skip rows it needs.
        matched = [] if seq.computes_whole_prompt else self.pages.match_prefix(seq.tokens, seq.adapter_uid)
        first_admission = seq.preemptions == 0
        seq.pages, seq.num_computed = matched, len(matched) * self.pages.page_size
        seq.registered_pages = len(matched)
        if self.pages.pages_for(seq.num_computed + 1) - len(matched) > self.pages.available_pages:
            self.pages.release(matched)
            seq.pages, seq.num_computed, seq.registered_pages = [], 0, 0
            return False
        if first_admission:
            seq.cached_tokens = seq.num_computed
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def _board(self, seq: Sequence, budget: int, items: list[FlightItem], may_preempt: bool) -> int:
        """Reserve pages for ``seq``'s next chunk and add it to ``items``; returns tokens used."""
        wanted = min(seq.num_tokens - seq.num_computed, budget)
        length = self.reserve(seq, seq.num_computed, seq.num_computed + wanted, may_preempt)
        if length <= 0:
            return 0
        seq.status = Status.IN_FLIGHT
        items.append(FlightItem(seq, seq.num_computed, length, tuple(seq.pages)))
        return length

    def reserve(self, seq: Sequence, start: int, end: int, may_preempt: bool = False) -> int:
        """The one place pages are reserved: ``seq``'s pages grown to cover its tokens up to ``end``, preempting
        others for them if ``may_preempt`` (policy 3); where too few are free, none are taken.  Returns how many
        tokens from ``start`` the pages held now cover, at most ``end - start`` (a chunk, a draft or the steps of
        a flight is cut to it)."""
        while not self.pages.grow(seq.pages, end):
            if not may_preempt or not self._preempt_one(spare=seq):
                return min(end - start, self.pages.covered(seq.pages, start))
        return end - start

    def _preempt_one(self, spare: Sequence) -> bool:
        victims = [s for s in self.running if s is not spare and not s.in_flight and s.pages]
        if not victims:
            return False
        victim = max(victims, key=lambda s: s.arrival)
        self.pages.release(victim.pages)
        victim.pages, victim.num_computed, victim.registered_pages = [], 0, 0
        victim.status = Status.WAITING
        victim.preemptions += 1
        self.preemptions += 1
        self.running.remove(victim)
        self.waiting.appendleft(victim)
        return True

    # ------------------------------------------------------------------ landing

    def hold_events(self) -> None:
        """Keep the events recorded from now on off their sequences' queues until :meth:`release_events`: the
        service lands a flight and boards the next one while holding, and releases as the next flight's layers
        start, so that the consumers of the landed tokens run while that flight computes, not while its worker
        prepares it.  Holding again while holding keeps everything for the one release."""
        if self._held is None:
            self._held = []

    @property
    def events_are_held(self) -> bool:
        return self._held is not None

    def release_events(self) -> None:
        """Put the held events on their queues, in the order recorded, and stop holding (nothing if not held)."""
        held, self._held = self._held, None
        for seq, event in held or ():
            seq.output.events.put_nowait(event)

    def _emit(self, seq: Sequence, event: SequenceEvent) -> None:
        if self._held is None:
            seq.output.events.put_nowait(event)
        else:
            self._held.append((seq, event))

    def on_step(self, flight: Flight, result: FlightResult) -> None:
        """A step of a multi-step flight, handed over while the next one computes: its tokens are recorded and
        streamed as at landing, but its sequences stay in the air (one that ends is finished at landing).

        Where drafting is on and one of its sequences now has a draft (its text started repeating), the
        flight is halted after its current step, so that the next flight carries the draft (policy 5)."""
        if flight.landed:  # the flight failed meanwhile (a timeout) and its sequences are finished
            return
        flight.tokens += self._record(result)
        if not flight.halted:
            flight.halted = self.speculation.halts(flight, self.max_batch_tokens)

    def on_flight_done(self, flight: Flight, result: FlightResult) -> None:
        flight.tokens += self._record(result)
        self._land(flight)
        for item in flight.items:
            seq = item.seq
            if seq.finishing is not None:
                self._finish_ended(seq)
            elif seq.abort_requested:
                self.finish(seq, FinishReason.ABORT)
            elif seq.max_tokens <= 0 and seq.num_computed == seq.num_tokens:  # a prompt scored or pooled
                self.finish(seq, FinishReason.LENGTH if seq.params.pooling is None else FinishReason.STOP)
        self.speculation.observe_flight(flight, flight.tokens, work_remains=bool(self.running or self.waiting))

    def _record(self, result: FlightResult) -> int:
        """What a landing step tells its sequences: computed tokens (pages filled go to the prefix cache),
        prompt logprobs, and the sampled tokens, streamed; a sequence that ends keeps its final event in
        ``finishing``, and the later steps of its flight are dropped.  Returns how many tokens it kept."""
        self.speculation.observe_step(result)
        total = 0
        pooled = result.pooled or [None] * len(result.items)
        for item, picks, scored, rows in zip(result.items, result.tokens, result.prompt_logprobs, pooled, strict=True):
            seq = item.seq
            if seq.finishing is not None or seq.finished:
                continue
            if rows is not None:
                seq.keep_pooled(item.pooled_positions, rows)
            if (
                scored and seq.output.prompt_logprobs is not None
            ):  # a recompute after preemption scores the same positions again, to the same values
                first = item.scored_prompt.start + 1
                seq.output.prompt_logprobs[first : first + len(scored)] = scored
            kept = 0
            for pick in picks if not seq.abort_requested else ():
                kept += 1
                event = append_token(seq, *pick)
                if event.finished:
                    seq.finishing = event
                    break
                self._emit(seq, event)
            total += kept
            seq.num_computed = item.computed_after(kept)
            if seq.num_computed // self.pages.page_size > seq.registered_pages:  # a page just filled up
                seq.registered_pages = self.pages.register(
                    seq.pages, seq.tokens[: seq.num_computed], seq.registered_pages, seq.adapter_uid
                )
        return total

    def _land(self, flight: Flight) -> None:
        flight.landed = flight.halted = True  # halted: a worker still running a failed flight stops after this step
        self.multi_step.landed(flight)
        for item in flight.items:
            item.seq.status = Status.RUNNING

    def on_flight_failed(self, flight: Flight, error: BaseException, quarantine: str | None = None) -> None:
        """End the flight's sequences with ``error``.  With ``quarantine`` (the name of a fiber whose call still
        runs), every page they hold stays in use under that name until ``pages.end_quarantine`` is called: the
        call may write the K/V of any of its items, whatever step it has reached."""
        self._land(flight)
        for item in flight.items:
            seq = item.seq
            if quarantine is not None:
                self.pages.quarantine(quarantine, seq.pages)
                seq.pages = []
            if seq.finishing is not None:  # it ended at an earlier step of the flight
                self._finish_ended(seq)
                continue
            seq.error = f"{type(error).__name__}: {error}"
            self.finish(seq, FinishReason.ABORT if seq.abort_requested else FinishReason.ERROR)

    def _finish_ended(self, seq: Sequence) -> None:
        """Finish a sequence that ended in the air, the way it ended, with the final event it kept."""
        assert seq.finish_reason is not None, "a sequence that ends knows why"
        self.finish(seq, seq.finish_reason, seq.finishing)

    def finish(self, seq: Sequence, reason: FinishReason, event: SequenceEvent | None = None) -> None:
        """End ``seq`` with ``reason``: release its pages and tell its consumer (exactly once)."""
        if seq.finished:
            return
        assert not seq.in_flight, "a sequence in the air cannot be finished"
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pages.release(seq.pages)
        seq.pages = []
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.output.finish_time = time.monotonic()
        self._emit(seq, event or SequenceEvent("", True))
        for listener in self.finish_listeners:
            listener(seq)

    def check_integrity(self) -> None:
        self.pages.check_integrity()
        held = sum(len(s.pages) for s in self.running) + self.pages.quarantined_references
        assert held == self.pages.total_references, (
            f"sequences and quarantines hold {held} page references, the pool counts {self.pages.total_references}"
        )
        assert all(s.status in (Status.RUNNING, Status.IN_FLIGHT) for s in self.running)
        assert all(i.seq.in_flight and f.steps > 1 for f in self.multi_step.in_air for i in f.items)
        assert all(s.status is Status.WAITING and not s.pages for s in self.waiting)
        if not self.running and not self.waiting:
            assert self.pages.used_pages == self.pages.quarantined_pages, (
                f"{self.pages.used_pages} pages in use with no sequence"
            )
