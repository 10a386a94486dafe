"""The scheduler's multi-step flights (policy 4) and drafts (policy 5): when they fly, how far, and how their steps
land (no model)."""

from __future__ import annotations

from fiberserve.engine.flight import FlightResult
from fiberserve.engine.kvcache import PagePool
from fiberserve.engine.multi_step import MULTI_STEP_MAX_SEQUENCES
from fiberserve.engine.sampling_params import SamplingParams
from fiberserve.engine.scheduler import Scheduler
from fiberserve.engine.sequence import Status
from fiberserve.engine.speculation import EXPLORE_EVERY, MIN_FLIGHTS, DraftSwitch
from tests.unit.scheduling import EOS, GREEDY, decoding, land, result, sequence


def test_plain_decodes_fly_several_steps_bounded_by_the_remaining_tokens():
    scheduler = Scheduler(PagePool(64, page_size=4), max_running=16, max_batch_tokens=64, decode_steps=8)
    short, long = sequence(SamplingParams(max_new_tokens=4, temperature=0)), sequence()
    decoding(scheduler, short, long)
    flight = scheduler.next_flight()
    assert flight.steps == 3  # short has 3 tokens left
    assert scheduler.multi_step.in_air == [flight]
    for item in flight.items:  # pages reserved for every step
        assert len(item.pages) * 4 >= item.start + flight.steps
    scheduler.check_integrity()


def test_no_multi_step_for_history_dependent_sampling_waiting_work_or_many_sequences():
    for params in (
        SamplingParams(max_new_tokens=20, temperature=0, repetition_penalty=1.2),
        SamplingParams(max_new_tokens=20, temperature=0, min_new_tokens=5),
    ):
        scheduler = Scheduler(PagePool(64, page_size=4), max_running=16, max_batch_tokens=64, decode_steps=8)
        decoding(scheduler, sequence(params))
        assert scheduler.next_flight().steps == 1, params
    many = Scheduler(PagePool(64, page_size=4), max_running=16, max_batch_tokens=64, decode_steps=8)
    decoding(many, *(sequence() for _ in range(MULTI_STEP_MAX_SEQUENCES + 1)))
    assert many.next_flight().steps == 1
    # someone waits (here for a running slot): the flight lands after every step, so that a slot frees soon
    crowded = Scheduler(PagePool(64, page_size=4), max_running=1, max_batch_tokens=64, decode_steps=8)
    decoding(crowded, sequence())
    crowded.add(sequence(prompt="next"))
    flight = crowded.next_flight()
    assert crowded.waiting and len(flight.items) == 1 and flight.steps == 1


def test_steps_stop_where_the_free_pages_end_and_nobody_is_preempted():
    pages = PagePool(5, page_size=4)
    scheduler = Scheduler(pages, max_running=16, max_batch_tokens=64, decode_steps=8)
    first, other = sequence(), sequence(prompt="other")
    decoding(scheduler, first, other)  # 5 prompt tokens and 1 output each: 2 pages each, 1 page left
    flight = scheduler.next_flight()
    # 8 steps would need positions 5..12, 4 pages each; the 2 pages each holds cover positions up to 7
    assert flight.steps == 3
    assert pages.free_pages == 1  # not taken by a reservation that could not be met whole
    assert other.status is Status.IN_FLIGHT and len(other.pages) == 2 and scheduler.preemptions == 0
    scheduler.check_integrity()


def test_steps_land_in_order_a_new_arrival_halts_the_flight_and_a_stop_waits_for_landing():
    scheduler = Scheduler(PagePool(64, page_size=4), max_running=16, max_batch_tokens=64, decode_steps=8)
    a, b = sequence(SamplingParams(max_new_tokens=20, temperature=0, stop=["xy"])), sequence(prompt="world")
    decoding(scheduler, a, b)
    flight = scheduler.next_flight()
    items = flight.items
    scheduler.on_step(flight, result(items, ord("x"), ord("p")))
    items = [item.next_step(token) for item, token in zip(items, (ord("x"), ord("p")), strict=True)]
    scheduler.on_step(flight, result(items, ord("y"), ord("q")))
    assert a.finishing is not None and not a.finished and a.in_flight  # its pages may still be written
    assert flight.ends_after(result(items, ord("z"), ord("r")))
    assert not flight.halted
    scheduler.add(sequence(prompt="new"))
    assert flight.halted
    items = [item.next_step(token) for item, token in zip(items, (ord("y"), ord("q")), strict=True)]
    scheduler.on_flight_done(flight, result(items, ord("z"), ord("r")))
    assert a.finished and a.output.text == "!" and a.output_ids == [ord(c) for c in "!xy"]
    assert b.output_ids == [ord(c) for c in "!pqr"] and b.num_computed == b.num_tokens - 1
    assert not scheduler.multi_step.in_air and not b.in_flight  # a's token after its stop was dropped
    scheduler.check_integrity()


# ---------------------------------------------------------------- speculative decoding (policy 5)


def drafting_scheduler(pages: int = 64, budget: int = 64) -> Scheduler:
    """A scheduler drafting up to 4 tokens by the goodput rule alone (``DraftSwitch`` is tested below)."""
    scheduler = Scheduler(PagePool(pages, page_size=4), 16, budget, decode_steps=8, speculative_tokens=4)
    scheduler.speculation.switch = DraftSwitch(fixed=True)
    return scheduler


def drafting(prompt: str = "abcabc", params: SamplingParams = GREEDY, pages: int = 64, budget: int = 64):
    """A drafting scheduler, and a sequence of ``prompt`` whose prefill landed with "a"."""
    scheduler = drafting_scheduler(pages, budget)
    seq = sequence(params, prompt)
    scheduler.add(seq)
    land(scheduler, scheduler.next_flight(), [ord("a")])
    return scheduler, seq


def test_a_greedy_decode_carries_a_draft_and_keeps_what_the_model_agrees_with():
    scheduler, seq = drafting()  # tokens "abcabca": the last 3 occurred at 1, then came "bca" (and it repeats)
    flight = scheduler.next_flight()
    [item] = flight.items
    assert flight.steps == 1 and not scheduler.multi_step.in_air
    assert item.draft == tuple(map(ord, "bcab")) and (item.start, item.length) == (6, 5)
    assert len(item.pages) * 4 >= item.start + item.length and item.sample_rows == 5
    # the model picks b after a (= the draft's first), c after b (= its second), then x where the draft has a
    kept = item.accept([(ord(c), None) for c in "bcxyz"])
    assert [t for t, _ in kept] == [ord(c) for c in "bcx"]
    scheduler.on_flight_done(flight, FlightResult([kept], [[]], flight.items))
    assert seq.output_ids == [ord(c) for c in "abcx"] and seq.output.text == "abcx"
    assert seq.num_computed == seq.num_tokens - 1  # the K/V of "x"'s row were computed from a rejected draft
    assert (scheduler.speculation.draft_tokens, scheduler.speculation.accepted_tokens) == (4, 2)
    scheduler.check_integrity()


def test_draft_tokens_are_taken_while_they_raise_the_expected_tokens_per_second():
    scheduler, seq = drafting(prompt="abcabcabcabc", params=SamplingParams(max_new_tokens=40, temperature=0))
    # a pass costs 10 ms, and 5 ms more per row: a draft token pays while its chance of being kept raises the
    # flight's expected tokens per second
    for rows in (1, 40):
        scheduler.speculation.pass_times[1].observe(rows, 0.010 + 0.005 * rows)
    flight = scheduler.next_flight()
    assert seq.sampling.drafter.acceptance == 0.5  # nothing checked yet: an even guess
    assert flight.items[0].draft == (ord("b"),)  # (1 + .5) / 20 ms beats 1 / 15 ms and (1 + .5 + .25) / 25 ms
    land(scheduler, flight, [ord("b")])  # only the token the draft was checked against
    # each flight checks the last proposal against what came: after a run of right guesses, drafts get longer
    for token in "cabcabca":
        land(scheduler, scheduler.next_flight(), [ord(token)])
    assert seq.sampling.drafter.acceptance > 0.9
    assert len(scheduler.next_flight().items[0].draft) == 4  # speculative_tokens
    # the passes that land teach the scheduler their time: rows now look free up to 64 (flat beyond what it saw)
    scheduler, seq = drafting(prompt="abcabcabcabc", params=SamplingParams(max_new_tokens=40, temperature=0))
    scheduler.speculation.pass_times[1].observe(1, 0.015)
    flight = scheduler.next_flight()
    assert len(flight.items[0].draft) == 4
    scheduler.on_flight_done(flight, FlightResult([[(ord("b"), None)]], [[]], flight.items, seconds=0.035))
    assert (
        scheduler.speculation.pass_times[1].estimate(5) == 0.035
        and scheduler.speculation.pass_times[1].estimate(3) == 0.025
    )
    scheduler.check_integrity()


def test_nothing_is_kept_after_a_stop_token():
    scheduler, seq = drafting()
    flight = scheduler.next_flight()
    [item] = flight.items
    item.draft = (EOS, ord("q"))  # as if the sequence had drafted its stop token
    kept = item.accept([(EOS, None), (ord("q"), None), (ord("r"), None)])
    assert kept == [(EOS, None)]
    scheduler.on_flight_done(flight, FlightResult([kept], [[]], flight.items))
    assert seq.finished and seq.finish_reason.value == "stop" and seq.output_ids == [ord("a"), EOS]
    scheduler.check_integrity()


def test_drafts_are_bounded_by_the_tokens_left_the_budget_and_the_free_pages():
    scheduler, _ = drafting(params=SamplingParams(max_new_tokens=3, temperature=0))
    assert scheduler.next_flight().items[0].draft == (ord("b"),)  # 2 tokens left: the next one and one draft
    scheduler, _ = drafting(prompt="abab", budget=4)  # "ababa": one row for "a", three left for "bab"
    assert scheduler.next_flight().items[0].draft == tuple(map(ord, "bab"))
    # 7 tokens in 2 pages of 4 and no page free: the draft gets the one free slot, and nobody is preempted
    scheduler, seq = drafting(pages=2)
    [item] = scheduler.next_flight().items
    assert item.draft == (ord("b"),) and len(seq.pages) == 2 and scheduler.preemptions == 0


def test_sampled_decodes_draft_and_penalized_ones_or_any_when_off_do_not():
    scheduler, _ = drafting(params=SamplingParams(max_new_tokens=20, temperature=0.8, seed=1))
    assert scheduler.next_flight().items[0].draft  # each row draws with its position's noise: drafts keep exact
    for params in (
        SamplingParams(max_new_tokens=20, temperature=0, repetition_penalty=1.2),
        SamplingParams(max_new_tokens=20, temperature=0.8, presence_penalty=0.5),
    ):
        scheduler, _ = drafting(params=params)
        assert scheduler.next_flight().items[0].draft == (), params
    scheduler = Scheduler(PagePool(64, page_size=4), 16, 64, decode_steps=8, speculative_tokens=0)
    decoding(scheduler, sequence(prompt="ab!ab"))
    assert not scheduler.next_flight().items[0].draft


def test_big_flights_draft_where_their_rows_are_cheap_and_not_where_they_cost_compute():
    """No cap on the flight's size: the pass times learnt for 6 sequences decide.  Weight-bound passes (each row
    0.1 ms on 10 ms) take drafts; compute-bound ones (each row costs its share, 2 ms) take none at 1/2."""
    for per_row, drafted in ((0.0001, True), (0.002, False)):
        scheduler = drafting_scheduler()
        decoding(scheduler, *(sequence(prompt="ab!ab") for _ in range(6)))
        for rows in (6, 12, 18, 24):
            scheduler.speculation.pass_times[6].observe(rows, 0.010 + per_row * rows)
        items = scheduler.next_flight().items
        assert len(items) == 6 and all(bool(item.draft) == drafted for item in items), per_row


def test_a_multi_step_flight_halts_once_a_sequence_has_a_draft():
    scheduler = drafting_scheduler()
    seq = sequence(prompt="abcd")
    decoding(scheduler, seq)  # "abcd!": nothing to draft, so the flight may run 8 steps
    flight = scheduler.next_flight()
    assert flight.steps == 8 and not flight.items[0].draft
    items = flight.items
    scheduler.on_step(flight, result(items, ord("x")))  # "abcd!x": still nothing repeats
    assert not flight.halted
    items = [items[0].next_step(ord("x"))]
    scheduler.on_step(flight, result(items, ord("a")))
    items = [items[0].next_step(ord("a"))]
    scheduler.on_step(flight, result(items, ord("b")))  # "abcd!xab": "ab" came before, followed by "cd"
    assert flight.halted
    scheduler.on_flight_done(flight, result([items[0].next_step(ord("b"))], ord("c")))
    follow = scheduler.next_flight()
    assert follow.steps == 1 and follow.items[0].draft == tuple(map(ord, "d!xa"))
    scheduler.check_integrity()


def test_the_switch_measures_both_ways_then_keeps_the_faster_and_still_tries_the_other():
    switch = DraftSwitch()
    ways = []
    for _ in range(2 * MIN_FLIGHTS):  # alternating until each way has its flights
        allowed = switch.allows(1)
        ways.append(allowed)
        switch.observe(1, allowed, tokens=10 if allowed else 12, seconds=1.0)  # drafting lands fewer tokens
    assert ways.count(True) == ways.count(False) == MIN_FLIGHTS
    later = [switch.allows(1) for _ in range(4 * EXPLORE_EVERY)]
    assert later.count(True) == 4  # the slower way, once every EXPLORE_EVERY decisions
    assert switch.allows(64)  # another size class learns on its own, starting with drafting


def test_drafting_switches_itself_off_where_drafted_flights_land_fewer_tokens_per_second():
    """Flights of 1 sequence, landed: drafted ones at 1 token per 20 ms, plain multi-step ones at 8 per 80 ms."""
    scheduler = Scheduler(PagePool(512, page_size=4), 16, 64, decode_steps=8, speculative_tokens=4)
    seq = sequence(prompt="abcabc", params=SamplingParams(max_new_tokens=900, temperature=0, ignore_eos=True))
    decoding(scheduler, seq)
    drafted = []
    for _ in range(2 * MIN_FLIGHTS + 3 * EXPLORE_EVERY):
        flight = scheduler.next_flight()
        [item] = flight.items
        drafted.append(bool(item.draft))
        steps = 1 if item.draft else flight.steps
        flight.boarded -= 0.020 if item.draft else 0.010 * steps  # what the flight took, as if measured
        items = [item]
        for _ in range(steps - 1):
            scheduler.on_step(flight, result(items, ord("a")))
            items = [items[0].next_step(ord("a"))]
        scheduler.on_flight_done(flight, result(items, ord("a")))  # the draft's first token is not kept
    rates = scheduler.speculation.switch.rates
    assert rates[1, True].flights > MIN_FLIGHTS and rates[1, False].flights > MIN_FLIGHTS  # both ways measured
    assert rates[1, True].per_second < rates[1, False].per_second
    assert sum(drafted[2 * MIN_FLIGHTS :]) <= 3  # then drafting only to check now and then
    scheduler.check_integrity()


def test_a_broken_invariant_is_caught_when_the_engine_goes_idle():
    """``check_integrity`` (the debug flag runs it at every idle moment): pages a sequence holds must be counted."""
    import pytest

    scheduler = Scheduler(PagePool(64, page_size=4), max_running=16, max_batch_tokens=64, decode_steps=8)
    seq = sequence()
    decoding(scheduler, seq)
    scheduler.check_integrity()
    seq.pages.append(seq.pages[0])  # a page reference the pool never gave out
    with pytest.raises(AssertionError, match="page references"):
        scheduler.check_integrity()


def test_held_events_reach_their_queues_at_the_release_in_the_order_recorded():
    """The service holds a landing's events until the next flight takes off; a second hold before the release
    (another fiber's landing, an abort) keeps its events for the same release."""
    scheduler = Scheduler(PagePool(64, page_size=4), max_running=16, max_batch_tokens=64)
    a, b = sequence(), sequence(prompt="other")
    decoding(scheduler, a, b)
    for seq in (a, b):
        assert seq.output.events.get_nowait().delta == "!"
    flight = scheduler.next_flight()
    scheduler.hold_events()
    land(scheduler, flight, [ord("x"), ord("y")])
    scheduler.hold_events()
    scheduler.abort(b)
    assert scheduler.events_are_held and a.output.events.empty() and b.output.events.empty()
    scheduler.release_events()
    assert not scheduler.events_are_held
    assert [(e.delta, e.finished) for e in drain(a)] == [("x", False)]
    assert [(e.delta, e.finished) for e in drain(b)] == [("y", False), ("", True)]
    scheduler.release_events()  # nothing held: nothing happens
    assert a.output.events.empty() and b.output.events.empty()
    scheduler.check_integrity()


def drain(seq) -> list:
    events = []
    while not seq.output.events.empty():
        events.append(seq.output.events.get_nowait())
    return events
