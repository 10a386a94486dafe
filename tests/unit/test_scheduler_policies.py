"""The scheduler's core policies without a model: FIFO admission (2), chunked prefill under the token budget (1),
preempting the latest arrival (3), and pages released whatever way a sequence ends."""

from __future__ import annotations

import pytest

from fiberserve.engine.kvcache import PagePool
from fiberserve.engine.sampling_params import SamplingParams
from fiberserve.engine.scheduler import Scheduler
from fiberserve.engine.sequence import FinishReason, Sequence, Status
from fiberserve.engine.sequence_output import SequenceEvent
from tests.unit.scheduling import EOS, decoding, land, sequence


def final_events(seq: Sequence) -> list[SequenceEvent]:
    events = []
    while not seq.output.events.empty():
        events.append(seq.output.events.get_nowait())
    return [e for e in events if e.finished]


def test_admission_follows_arrival_under_the_running_cap():
    scheduler = Scheduler(PagePool(64, page_size=4), max_running=2, max_batch_tokens=64)
    first, second, third, fourth = (sequence(prompt=p, arrival=i) for i, p in enumerate(["aa", "bb", "cc", "dd"]))
    for seq in (first, second, third, fourth):
        scheduler.add(seq)
    flight = scheduler.next_flight()
    assert [item.seq for item in flight.items] == [first, second]
    assert list(scheduler.waiting) == [third, fourth] and third.status is Status.WAITING
    land(scheduler, flight, [EOS, ord("!")])  # first ends: one running slot frees
    assert first.finish_reason is FinishReason.STOP
    flight = scheduler.next_flight()
    assert [item.seq for item in flight.items] == [second, third]  # the decode first, then the oldest waiting
    assert list(scheduler.waiting) == [fourth]
    scheduler.check_integrity()


def test_admission_waits_for_pages_and_never_preempts():
    pages = PagePool(2, page_size=4)
    scheduler = Scheduler(pages, max_running=16, max_batch_tokens=64)
    holder = sequence(prompt="abcdefg", arrival=0)
    decoding(scheduler, holder)  # 8 tokens: both pages held
    late = sequence(prompt="xy", arrival=1)
    scheduler.add(late)
    flight = scheduler.next_flight()
    assert [item.seq for item in flight.items] == [holder]
    assert list(scheduler.waiting) == [late] and scheduler.preemptions == 0
    scheduler.check_integrity()


def test_a_prompt_page_that_a_running_prefill_computes_is_waited_for_and_later_arrivals_pass():
    """A burst of prompts with one system prompt computes its pages once (policy 2)."""
    scheduler = Scheduler(PagePool(64, page_size=4), max_running=16, max_batch_tokens=64)
    first, second, third = (sequence(prompt=p, arrival=i) for i, p in enumerate(["system:a", "system:b", "hi"]))
    for seq in (first, second, third):
        scheduler.add(seq)
    flight = scheduler.next_flight()
    assert [item.seq for item in flight.items] == [first, third]  # second shares first's page "syst"
    assert list(scheduler.waiting) == [second] and second.status is Status.WAITING
    land(scheduler, flight, [ord("!"), ord("!")])
    flight = scheduler.next_flight()
    late = flight.items[-1]
    assert late.seq is second and late.start == 4 and second.cached_tokens == 4  # the page, from the cache
    land(scheduler, flight, [ord("!")] * 3)
    alone = Scheduler(PagePool(64, page_size=4), max_running=16, max_batch_tokens=64)
    for seq in (sequence(prompt="system:a"), sequence(prompt="other:b")):  # nothing shared: both at once
        alone.add(seq)
    assert len(alone.next_flight().items) == 2
    scheduler.check_integrity()
    alone.check_integrity()


def test_nobody_waits_for_a_sequence_that_caches_no_more_pages():
    scheduler = Scheduler(PagePool(64, page_size=4), max_running=16, max_batch_tokens=64)
    first = sequence(prompt="system:x")
    decoding(scheduler, first)
    scheduler.abort(first)  # its pages "syst" and "em:x" stay cached
    scorer = sequence(SamplingParams(max_new_tokens=20, temperature=0, prompt_logprobs=0), "system:a")
    decoding(scheduler, scorer)  # computes its whole prompt: its own "syst" is private, and so is all after it
    late = sequence(prompt="system:ab")
    scheduler.add(late)
    flight = scheduler.next_flight()
    assert late in [item.seq for item in flight.items] and late.cached_tokens == 4
    scheduler.check_integrity()


def test_long_prompts_are_prefilled_in_chunks_under_the_budget_while_decodes_keep_flowing():
    budget = 8
    scheduler = Scheduler(PagePool(64, page_size=4), max_running=16, max_batch_tokens=budget)
    decoder = sequence(prompt="ab", arrival=0)
    decoding(scheduler, decoder)
    long = sequence(prompt="x" * 20, arrival=1)
    scheduler.add(long)
    chunks = []
    while long.num_computed < len(long.prompt_ids):
        flight = scheduler.next_flight()
        assert flight.num_tokens <= budget
        assert flight.items[0].seq is decoder and flight.items[0].length == 1  # the decode comes first
        chunk = flight.items[1]
        assert chunk.seq is long and chunk.start == long.num_computed
        chunks.append(chunk.length)
        land(scheduler, flight, [ord("!")] * (1 + chunk.samples))
        scheduler.check_integrity()
    assert chunks == [7, 7, 6] and len(long.output_ids) == 1  # only the last chunk samples
    assert len(decoder.output_ids) == 1 + len(chunks)


def test_a_sequence_short_of_pages_preempts_the_latest_arrival_on_the_ground():
    pages = PagePool(6, page_size=4)
    scheduler = Scheduler(pages, max_running=16, max_batch_tokens=64)
    oldest, middle, newest = (sequence(prompt=p * 7, arrival=i) for i, p in enumerate("abc"))
    decoding(scheduler, oldest, middle, newest)  # 7 prompt tokens and 1 output each: 2 pages each, none free
    land(scheduler, scheduler.next_flight(), [ord("!")] * 3)  # position 7 still fits
    flight = scheduler.next_flight()  # position 8 needs a third page each
    assert [item.seq for item in flight.items] == [oldest, middle]
    assert newest.status is Status.WAITING and not newest.pages and newest.num_computed == 0
    assert list(scheduler.waiting) == [newest] and newest.preemptions == 1 and scheduler.preemptions == 1
    assert newest.output_ids == [ord("!")] * 2  # its tokens are kept and recomputed
    assert pages.cached_pages == 0  # the victim's full pages were cached, then taken by the two in the air
    land(scheduler, flight, [EOS, EOS])
    flight = scheduler.next_flight()
    (item,) = flight.items
    assert item.seq is newest and (item.start, item.length) == (0, newest.num_tokens)
    land(scheduler, flight, [ord("?")])
    assert newest.output_ids == [ord("!"), ord("!"), ord("?")]
    scheduler.check_integrity()


def test_a_sequence_in_the_air_is_never_preempted():
    pages = PagePool(2, page_size=4)
    scheduler = Scheduler(pages, max_running=16, max_batch_tokens=1)
    newer = sequence(prompt="bbb", arrival=1)
    decoding(scheduler, newer)
    older = sequence(prompt="a" * 8, arrival=0)
    scheduler.add(older)
    in_air = scheduler.next_flight()
    assert [item.seq for item in in_air.items] == [newer]  # the budget leaves no room for older
    while (flight := scheduler.next_flight()) is not None:  # older's prefill, a token a flight, in its one page
        assert [item.seq for item in flight.items] == [older]
        land(scheduler, flight, [])
    assert older.num_computed == 4  # position 4 needs the page newer holds, and newer is in the air
    assert newer.in_flight and len(newer.pages) == 1 and scheduler.preemptions == 0
    scheduler.check_integrity()


def ending(reason: str) -> tuple[Scheduler, Sequence]:
    """A scheduler whose one sequence has just ended ``reason``'s way."""
    scheduler = Scheduler(PagePool(16, page_size=4), max_running=16, max_batch_tokens=64)
    params = SamplingParams(max_new_tokens=1 if reason == "length" else 20, temperature=0)
    seq = sequence(params, prompt="hello")
    finished: list[Sequence] = []
    scheduler.finish_listeners.append(finished.append)
    scheduler.add(seq)
    if reason == "abort while waiting":
        scheduler.abort(seq)
    else:
        flight = scheduler.next_flight()
        if reason == "abort in the air":
            scheduler.abort(seq)
            assert not seq.finished and seq.pages  # finished when the flight lands
            land(scheduler, flight, [ord("x")])
        elif reason == "error":
            scheduler.on_flight_failed(flight, RuntimeError("the fiber died"))
        else:
            land(scheduler, flight, [EOS if reason == "stop" else ord("x")])
            if reason == "abort on the ground":
                scheduler.abort(seq)
    assert finished == [seq]
    return scheduler, seq


@pytest.mark.parametrize(
    ("reason", "outcome"),
    [
        ("stop", FinishReason.STOP),
        ("length", FinishReason.LENGTH),
        ("abort while waiting", FinishReason.ABORT),
        ("abort on the ground", FinishReason.ABORT),
        ("abort in the air", FinishReason.ABORT),
        ("error", FinishReason.ERROR),
    ],
)
def test_every_ending_releases_the_pages_and_tells_the_consumer_once(reason, outcome):
    scheduler, seq = ending(reason)
    assert seq.status is Status.FINISHED and seq.finish_reason is outcome and not seq.pages
    assert len(final_events(seq)) == 1
    assert scheduler.pages.used_pages == 0 and not scheduler.running and not scheduler.waiting
    if outcome is FinishReason.ERROR:
        assert seq.error == "RuntimeError: the fiber died"
    if reason == "abort in the air":
        assert seq.output_ids == []  # the token sampled after the abort was not kept
    scheduler.abort(seq)
    scheduler.finish(seq, FinishReason.ERROR)  # ending twice changes nothing
    assert seq.finish_reason is outcome and final_events(seq) == []
    scheduler.check_integrity()
