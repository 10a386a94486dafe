"""The engine with the real model: batch consistency, prefix sharing, tiny caches, sampling, aborts."""

from __future__ import annotations

import asyncio
import functools
import sys

import pytest
import torch

from fiberserve.engine import SamplingParams, speculation
from fiberserve.engine import service as service_module
from fiberserve.engine.faults import FaultPoint
from fiberserve.engine.flight import Flight, FlightItem
from fiberserve.engine.runner import ModelRunner
from fiberserve.engine.sampling_params import InvalidParameter
from fiberserve.engine.sequence import Sequence
from fiberserve.runtime.worker import GIL_SWITCH_INTERVAL_S
from tests.integration.engine_utils import Engine, assert_same_or_near_tie

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, top_logprobs=2)


@pytest.fixture(scope="module")
def engine(model_path, tokenizer) -> Engine:
    return Engine(model_path, tokenizer)


@pytest.fixture(scope="module")
def alone_fp32(engine):
    return asyncio.run(engine.alone(engine.chat_prompts(), GREEDY, dtype="float32"))


@pytest.mark.parametrize("fibers,max_batch_tokens", [(1, 512), (2, 512), (4, 512), (1, 64), (4, 96)])
async def test_batch_consistency_float32(engine, alone_fp32, fibers, max_batch_tokens):
    """16 prompts at once give every prompt the tokens it gets alone.

    In float32 a row's matrix products may round differently inside a batch
    (oneDNN's paths: see model/linear.py), so where tokens ever differ the logprobs at the first
    difference must agree within 1e-4: a near tie, not a corrupted row.
    """
    batched = await engine.run(
        engine.chat_prompts(), GREEDY, dtype="float32", fibers=fibers, max_batch_tokens=max_batch_tokens
    )
    identical = sum(assert_same_or_near_tie(a, b) for a, b in zip(alone_fp32, batched, strict=True))
    print(f"float32 fibers={fibers} max_batch_tokens={max_batch_tokens}: {identical}/16 identical")
    for out in batched:
        text = out.outputs[0].text
        assert text and len(set(text.strip())) > 1, f"degenerate output {text!r}"


async def test_batch_consistency_bfloat16(engine):
    """The default dtype: measured, and every prompt must stay identical (batch-invariant kernels)."""
    prompts = engine.chat_prompts()
    alone = await engine.alone(prompts, GREEDY)
    identical = 0
    for fibers, budget in ((1, 512), (2, 64)):
        batched = await engine.run(prompts, GREEDY, fibers=fibers, max_batch_tokens=budget)
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(alone, batched, strict=True))
        print(f"bfloat16 fibers={fibers} max_batch_tokens={budget}: {same}/16 identical")
        identical += same
    assert identical == 32


async def test_int4_weights_are_batch_invariant_and_still_answer(engine):
    """--quantization int4 uses one kernel at every batch size, so batching changes no token.

    (Its int8 activations flip "What is the capital of France?", a near tie in float32 (0.08 between the
    first tokens), to "L'Etoile, ...": the sanity checks use answers with a clear margin.)"""
    prompts = engine.chat_prompts(10)
    alone = await engine.alone(prompts, GREEDY, quantization="int4")
    batched = await engine.run(prompts, GREEDY, quantization="int4", max_batch_tokens=64)
    assert [a.outputs[0].token_ids for a in alone] == [b.outputs[0].token_ids for b in batched]
    assert "William Shakespeare" in alone[5].outputs[0].text  # Who wrote Romeo and Juliet?
    assert "Central Processing Unit" in alone[9].outputs[0].text  # What does CPU stand for?


async def test_prefix_sharing_gives_identical_outputs_and_reports_cached_tokens(engine):
    system = "You are a meticulous assistant. " * 12
    prompts = [
        engine.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in ("What is 2+2?", "Name a fruit.", "What color is grass?")
    ]
    params = SamplingParams(max_new_tokens=16, temperature=0)
    svc = engine.service(prefix_caching=True)
    await svc.start()
    try:
        first = await svc.generate(prompts[0], params)
        assert first.cached_tokens == 0
        rest = [await svc.generate(p, params) for p in prompts[1:]]
        assert all(r.cached_tokens >= 64 for r in rest), [r.cached_tokens for r in rest]
        svc.check_integrity()
    finally:
        await svc.close()
    without = await engine.run(prompts, params, prefix_caching=False)
    assert [o.outputs[0].token_ids for o in [first, *rest]] == [o.outputs[0].token_ids for o in without]
    assert all(o.cached_tokens == 0 for o in without)


async def test_a_cache_that_fits_two_sequences_serves_50_requests(engine, alone_fp32):
    prompts = engine.chat_prompts()
    longest = max(len(p) for p in prompts) + GREEDY.max_new_tokens
    pages = 2 * -(-longest // 16)
    outputs = await engine.run(
        [prompts[i % 16] for i in range(50)], GREEDY, dtype="float32", kv_pages=pages, page_size=16, fibers=2
    )
    for i, out in enumerate(outputs):
        assert_same_or_near_tie(alone_fp32[i % 16], out)
        assert out.outputs[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "q8_0"])
async def test_a_quantized_kv_cache_keeps_batches_invariant_through_sharing_and_preemption(engine, kv_cache_dtype):
    """Each prompt batched (in chunks of 64 tokens, sharing the system prompt's pages) gives its tokens alone; a
    cache that holds two sequences preempts and recomputes and still does; answers with a clear margin hold."""
    prompts = engine.chat_prompts()
    alone = await engine.alone(prompts, GREEDY, kv_cache_dtype=kv_cache_dtype)
    batched = await engine.run(prompts, GREEDY, kv_cache_dtype=kv_cache_dtype, max_batch_tokens=64)
    assert [a.outputs[0].token_ids for a in alone] == [b.outputs[0].token_ids for b in batched]
    assert any(b.cached_tokens > 0 for b in batched)
    longest = max(len(p) for p in prompts) + GREEDY.max_new_tokens
    tight = await engine.run(prompts, GREEDY, kv_cache_dtype=kv_cache_dtype, kv_pages=2 * -(-longest // 16), fibers=2)
    assert [a.outputs[0].token_ids for a in alone] == [t.outputs[0].token_ids for t in tight]
    assert "William Shakespeare" in alone[5].outputs[0].text  # Who wrote Romeo and Juliet?
    assert "Central Processing Unit" in alone[9].outputs[0].text  # What does CPU stand for?


async def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine):
    prompts = engine.chat_prompts(6)
    seeded = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = await engine.alone(prompts[:1], seeded)
    batch = await engine.run(prompts, seeded, fibers=2)
    assert batch[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    other = await engine.run(prompts[:1], SamplingParams(max_new_tokens=16, temperature=0.9, seed=99))
    assert other[0].outputs[0].token_ids != alone[0].outputs[0].token_ids


async def test_check_integrity_at_idle_stops_a_broken_engine(engine):
    """With ``check_integrity`` the engine checks its invariants whenever it goes idle; once one is broken (here a
    page leaked behind the scheduler's back), every later request fails with the reason."""
    svc = engine.service()
    await svc.start()
    try:
        prompt = engine.chat_prompts(1)[0]
        await svc.generate(prompt, SamplingParams(max_new_tokens=2, temperature=0))
        assert svc.broken is None
        svc.pages.allocate(1)  # held by no sequence
        await svc.generate(prompt, SamplingParams(max_new_tokens=2, temperature=0))  # it goes idle after this one
        assert svc.broken is not None and "page" in svc.broken
        with pytest.raises(RuntimeError, match="invariants broke"):
            svc.submit(prompt, SamplingParams(max_new_tokens=2))
    finally:
        await svc.close()


async def test_the_engine_seed_makes_unseeded_sampling_repeat(engine):
    """Requests without a seed get one the engine draws from ``seed``: a server started alike and sent the same
    requests in the same order samples the same tokens; another engine seed, others."""
    prompts = engine.chat_prompts(4)
    free = SamplingParams(max_new_tokens=16, temperature=1.0)

    def tokens(outputs):
        return [o.outputs[0].token_ids for o in outputs]

    first, again = [tokens(await engine.run(prompts, free, seed=0)) for _ in range(2)]
    other = tokens(await engine.run(prompts, free, seed=1))
    assert first == again and first != other
    assert len({tuple(t) for t in first}) == len(prompts)  # each request its own noise


async def test_top_k_1_equals_greedy_and_n_gives_distinct_samples(engine):
    prompt = engine.chat_prompts(1)
    greedy = await engine.run(prompt, SamplingParams(max_new_tokens=12, temperature=0))
    top1 = await engine.run(prompt, SamplingParams(max_new_tokens=12, temperature=1.3, top_k=1, seed=5))
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids
    many = await engine.run(prompt, SamplingParams(max_new_tokens=12, temperature=1.2, n=4, seed=7))
    texts = [c.text for c in many[0].outputs]
    assert len(texts) == 4 and len(set(texts)) > 1
    assert many[0].completion_tokens == sum(len(c.token_ids) for c in many[0].outputs)


async def test_stop_strings_and_stop_token_ids_cut_exactly(engine, tokenizer):
    prompt = tokenizer.encode("Count: 1, 2, 3, 4, 5, 6, 7,")
    free = (await engine.run([prompt], SamplingParams(max_new_tokens=16, temperature=0)))[0].outputs[0]
    text = free.text
    assert " 9" in text, text
    # a stop string (it may span tokens): the text ends right before it
    cut = (await engine.run([prompt], SamplingParams(max_new_tokens=16, temperature=0, stop=[" 9"])))[0].outputs[0]
    assert cut.text == text[: text.index(" 9")] and cut.finish_reason == "stop" and cut.matched_stop == " 9"
    spanning = text[text.index(" 8") + 1 : text.index(" 9") + 2]  # "8, 9": across several tokens
    cut2 = (await engine.run([prompt], SamplingParams(max_new_tokens=16, temperature=0, stop=[spanning])))[0]
    assert cut2.outputs[0].text == text[: text.index(spanning)]
    # a stop token id: generation ends at that token and its text is not returned
    k = next(i for i, t in enumerate(free.token_ids) if i >= 2 and t not in free.token_ids[:i])
    token = free.token_ids[k]
    by_id = await engine.run([prompt], SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=[token]))
    out = by_id[0].outputs[0]
    assert out.token_ids == free.token_ids[: k + 1] and out.matched_stop == token and out.finish_reason == "stop"
    assert out.text == tokenizer.decode(free.token_ids[:k])


async def test_max_new_tokens_zero_and_eos(engine):
    prompt = engine.chat_prompts(1)
    zero = (await engine.run(prompt, SamplingParams(max_new_tokens=0)))[0].outputs[0]
    assert (zero.text, zero.token_ids, zero.finish_reason) == ("", [], "length")
    chat = (await engine.run(prompt, SamplingParams(max_new_tokens=200, temperature=0)))[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.matched_stop == 2  # <|im_end|>
    forced = (await engine.run(prompt, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)))[0]
    assert len(forced.outputs[0].token_ids) == 40 and forced.outputs[0].finish_reason == "length"


async def test_min_new_tokens_holds_off_eos_and_stop_strings(engine, tokenizer):
    prompt = engine.chat_prompts(1)
    free = (await engine.run(prompt, SamplingParams(max_new_tokens=200, temperature=0)))[0].outputs[0]
    assert free.finish_reason == "stop" and free.matched_stop == 2
    k = len(free.token_ids) - 1  # the answer's tokens, EOS excluded
    held = (await engine.run(prompt, SamplingParams(max_new_tokens=k + 8, min_new_tokens=k + 4, temperature=0)))[0]
    out = held.outputs[0]
    assert out.token_ids[:k] == free.token_ids[:k] and out.token_ids[k] != free.token_ids[k]  # EOS was banned
    assert len(out.token_ids) >= k + 4 and out.text.startswith(free.text)
    # A stop string found before the minimum is text; one found after it ends the output.
    early = free.text[: len(free.text) // 2].split()[-1]
    stopped = (await engine.run(prompt, SamplingParams(max_new_tokens=200, temperature=0, stop=[early])))[0]
    assert len(stopped.outputs[0].token_ids) < k
    late = (
        await engine.run(prompt, SamplingParams(max_new_tokens=200, min_new_tokens=k, temperature=0, stop=[early]))
    )[0].outputs[0]
    assert late.text.startswith(free.text) and late.token_ids[:k] == free.token_ids[:k]


async def test_prompt_logprobs_score_a_prompt_as_generation_scored_its_tokens(engine):
    prompt = engine.chat_prompts(1)[0]
    greedy = SamplingParams(max_new_tokens=12, temperature=0, logprobs=True, ignore_eos=True)
    generated = (await engine.run([prompt], greedy))[0].outputs[0]
    full = prompt + generated.token_ids
    score = SamplingParams(max_new_tokens=0, prompt_logprobs=2)
    # Scored in chunks of at most 16 tokens, beside a request that generates.
    outputs = await engine.run([full, prompt], [score, greedy], max_batch_tokens=16)
    scored = outputs[0].outputs[0]
    assert scored.token_ids == [] and scored.finish_reason == "length"
    assert outputs[1].outputs[0].token_ids == generated.token_ids
    lps = scored.prompt_logprobs
    assert len(lps) == len(full) and lps[0] is None
    assert [lp.token_id for lp in lps[1:]] == full[1:] and all(len(lp.top) == 2 for lp in lps[1:])
    for as_prompt, as_output in zip(lps[len(prompt) :], generated.logprobs, strict=True):
        assert as_prompt.top[0][0] == as_prompt.token_id  # each was the greedy pick
        assert as_prompt.logprob == pytest.approx(as_output.logprob, abs=1e-4)
    assert all(lp.logprob < 0 for lp in lps[1:])

    # A scored prompt is computed whole even where the prefix cache holds it.
    svc = engine.service(fibers=1)
    await svc.start()
    try:
        await svc.generate(full, SamplingParams(max_new_tokens=1, temperature=0))
        cached = await svc.generate(full, SamplingParams(max_new_tokens=1, temperature=0))
        again = await svc.generate(full, SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=0))
        assert cached.cached_tokens > 0 and again.cached_tokens == 0
        assert [lp.logprob for lp in again.outputs[0].prompt_logprobs[1:]] == [lp.logprob for lp in lps[1:]]
        assert len(again.outputs[0].token_ids) == 1
        await asyncio.sleep(0)
        svc.check_integrity()
    finally:
        await svc.close()


async def test_n_sequences_share_one_scoring_of_their_prompt(engine):
    prompt = engine.chat_prompts(1)[0]
    alone = (await engine.run([prompt], SamplingParams(max_new_tokens=0, prompt_logprobs=1)))[0].outputs[0]
    svc = engine.service(fibers=1)
    await svc.start()
    try:
        await svc.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0))  # the prompt's pages cached
        params = SamplingParams(max_new_tokens=3, temperature=0.8, seed=5, n=3, prompt_logprobs=1)
        three = await svc.generate(prompt, params)
        # One sequence computed the prompt whole to score it; its siblings took theirs from the prefix cache.
        assert three.cached_tokens > 0
        for out in three.outputs:
            assert len(out.token_ids) == 3
            assert [(lp and (lp.token_id, lp.logprob, lp.top)) for lp in out.prompt_logprobs] == [
                (lp and (lp.token_id, lp.logprob, lp.top)) for lp in alone.prompt_logprobs
            ]
        await asyncio.sleep(0)
        svc.check_integrity()
    finally:
        await svc.close()


async def test_logprobs_are_returned_for_chosen_tokens(engine):
    out = (
        await engine.run(
            engine.chat_prompts(1), SamplingParams(max_new_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
        )
    )[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][0] == token  # greedy: the chosen token is the most likely


async def test_penalties_change_the_output(engine, tokenizer):
    prompt = tokenizer.encode("the the the the the the")
    plain = (await engine.run([prompt], SamplingParams(max_new_tokens=12, temperature=0)))[0].outputs[0]
    penalized = (
        await engine.run(
            [prompt],
            SamplingParams(
                max_new_tokens=12, temperature=0, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0
            ),
        )
    )[0]
    assert plain.token_ids != penalized.outputs[0].token_ids


async def test_abort_mid_generation_frees_every_page(engine):
    svc = engine.service(fibers=2)
    await svc.start()
    try:
        prompts = engine.chat_prompts(4)
        requests = [svc.submit(p, SamplingParams(max_new_tokens=500, temperature=0, ignore_eos=True)) for p in prompts]
        for _ in range(200):
            await asyncio.sleep(0.02)
            if all(len(s.output_ids) >= 3 for r in requests for s in r.seqs):
                break
        assert svc.pages.used_pages > 0
        for r in requests:
            svc.abort(r)
        outputs = await asyncio.gather(*(svc.wait(r) for r in requests))
        assert all(o.outputs[0].finish_reason == "abort" for o in outputs)
        assert all(0 < len(o.outputs[0].token_ids) < 500 for o in outputs)
        for _ in range(100):  # the flights still in the air land and release their pages (a slow CI: seconds)
            if svc.is_idle() and svc.pages.used_pages == 0:
                break
            await asyncio.sleep(0.05)
        assert svc.is_idle() and svc.pages.used_pages == 0
        svc.check_integrity()
    finally:
        await svc.close()


async def test_the_heaps_are_trimmed_only_once_the_engine_has_been_idle(engine, monkeypatch):
    """Never while a sequence runs, however short ``IDLE_TRIM_S``; within it of the last flight after; and a
    request after the trim gets what it got before."""
    monkeypatch.setattr(service_module, "IDLE_TRIM_S", 0.05)
    svc = engine.service(fibers=2)
    await svc.start()
    try:
        prompt = engine.chat_prompts(1)[0]
        params = SamplingParams(max_new_tokens=120, temperature=0, ignore_eos=True)
        request = svc.submit(prompt, params)
        trimmed_while_running = []
        while not request.seqs[0].finished:
            if request.seqs[0].output_ids:  # boarded: a flight has run since any trim
                trimmed_while_running.append(svc.heap_trimmed)
            await asyncio.sleep(0.01)
        before = (await svc.wait(request)).outputs[0].token_ids
        assert len(trimmed_while_running) > 10 and not any(trimmed_while_running)
        assert not svc.heap_trimmed
        for _ in range(200):
            if svc.heap_trimmed:
                break
            await asyncio.sleep(0.01)
        assert svc.heap_trimmed and svc.is_idle()
        after = (await svc.generate(prompt, params)).outputs[0].token_ids
        assert after == before and len(after) == 120
    finally:
        await svc.close()


async def test_fibers_1_runs_flights_strictly_one_at_a_time(engine):
    svc = engine.service(fibers=1)
    await svc.start()
    peak = 0
    original = svc.program.invoke
    running = 0

    async def counting(fiber, *args, **kw):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            return await original(fiber, *args, **kw)
        finally:
            running -= 1

    svc.program.invoke = counting
    try:
        requests = [svc.submit(p, SamplingParams(max_new_tokens=8, temperature=0)) for p in engine.chat_prompts(8)]
        await asyncio.gather(*(svc.wait(r) for r in requests))
        assert peak == 1 and svc.pool.stats().size == 1
    finally:
        await svc.close()


async def test_a_landed_flight_s_tokens_reach_their_readers_once_the_next_flight_s_layers_run(engine, monkeypatch):
    """The service boards the next flight before it wakes the readers of a landed one, and wakes them as that
    flight's layers start, so the loop streams while the fiber computes: a sequence's every token but its last
    reaches its reader with the fiber busy and the layers of the flight after the token's own started."""
    layers_started = []
    take_off = Flight.take_off
    monkeypatch.setattr(Flight, "take_off", lambda flight, landed: (layers_started.append(1), take_off(flight, landed)))
    svc = engine.service(fibers=1, decode_steps=1, speculative_tokens=0)
    await svc.start()
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        requests = [svc.submit(p, params) for p in engine.chat_prompts(4)]
        fiber_busy: list[bool] = []
        next_flight_started: list[bool] = []

        async def read(seq):
            tokens = 0
            async for event in svc.events(seq):
                if not event.finished:
                    tokens += 1  # the first came from the sequence's first flight, each next from the next one
                    fiber_busy.append(svc.pool.stats().busy == 1)
                    next_flight_started.append(len(layers_started) >= tokens + 1)

        await asyncio.gather(*(read(r.seqs[0]) for r in requests))
        assert len(fiber_busy) == 4 * 11 and all(fiber_busy) and all(next_flight_started)
        svc.check_integrity()
    finally:
        await svc.close()


async def test_events_held_for_a_flight_that_fails_before_its_layers_still_reach_their_reader(engine):
    """The first decode flight fails as it starts (an injected fault), before the layers that would release the
    prefill's held token: the token still reaches its reader, then the error."""
    svc = engine.service(fibers=1, decode_steps=1, speculative_tokens=0, fault_rate=0.5)  # every 2nd flight fails
    await svc.start()
    try:
        [prompt] = engine.chat_prompts(1)
        request = svc.submit(prompt, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
        events = await asyncio.wait_for(_all_events(svc, request.seqs[0]), timeout=60)
        assert [(bool(e.delta), e.finished) for e in events] == [(True, False), (False, True)]
        assert request.seqs[0].finish_reason.value == "error" and "injected" in request.seqs[0].error
        assert svc.flights_run == 1 and svc.flights_failed == 1
        svc.check_integrity()
    finally:
        await svc.close()


async def test_a_started_service_has_threads_hand_over_the_gil_promptly(engine):
    """A worker back from a kernel waits for the event loop's Python at most the shortened switch interval."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # the interpreter's default
    svc = engine.service()
    try:
        await svc.start()
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
    finally:
        await svc.close()
        sys.setswitchinterval(before)


async def test_max_model_len_caps_every_request_s_context(engine):
    [prompt] = engine.chat_prompts(1)
    svc = engine.service(max_model_len=len(prompt) + 8)
    assert svc.max_context == len(prompt) + 8
    with pytest.raises(InvalidParameter) as err:
        svc.validate(prompt, SamplingParams(max_new_tokens=9))
    assert err.value.field == "max_new_tokens" and f"context length {len(prompt) + 8}" in str(err.value)
    [out] = await engine.run([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True), max_model_len=len(prompt) + 8)
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    # An API's default limit (the client gave none) is cut to what the context leaves, not refused.
    by_default = SamplingParams(max_new_tokens=512, ignore_eos=True, max_new_tokens_by_default=True)
    [out] = await engine.run([prompt], by_default, max_model_len=len(prompt) + 8)
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    for bad in (0, engine.service().max_context + 1):
        with pytest.raises(ValueError, match="--max-model-len must be between 1 and the model's context length"):
            engine.service(max_model_len=bad)


async def _all_events(svc, seq) -> list:
    return [event async for event in svc.events(seq)]


async def _serve_cases(engine, cases, rounds: int = 1, **config):
    """Serve ``cases`` (prompt, params) ``rounds`` times on a fresh service built with ``config``.  Returns each
    round's outputs and per-sequence events, the flights run and the scheduler, once the service is idle with
    every page back and its invariants intact."""
    svc = engine.service(**config)
    await svc.start()
    try:
        runs = []
        for _ in range(rounds):
            requests = [svc.submit(prompt, params) for prompt, params in cases]
            events = [[await _all_events(svc, seq) for seq in r.seqs] for r in requests]
            runs.append(([r.output() for r in requests], events))
        await asyncio.sleep(0)
        assert svc.is_idle() and svc.pages.used_pages == 0
        svc.check_integrity()
        return runs, svc.flights_run, svc.scheduler
    finally:
        await svc.close()


async def test_multi_step_flights_give_the_tokens_text_and_events_of_single_steps(engine, tokenizer):
    """``decode_steps`` changes how often flights land, not what they produce: the same tokens, text, finish
    reasons and logprobs as landing after every step, one streamed event per token, and fewer flights."""
    count = tokenizer.encode("Count: 1, 2, 3, 4, 5, 6, 7,")
    chat = engine.chat_prompts(3)
    cases = [
        (count, SamplingParams(max_new_tokens=40, temperature=0, stop=[" 12"])),  # a stop string mid-flight
        (chat[0], SamplingParams(max_new_tokens=200, temperature=0)),  # ends on EOS
        (chat[1], SamplingParams(max_new_tokens=37, temperature=0.8, seed=3, logprobs=True, top_logprobs=2)),
        (chat[2], SamplingParams(max_new_tokens=29, temperature=0, ignore_eos=True, logit_bias={13: 2.0})),
    ]
    # (no drafts: a drafted flight runs one step)
    ([(single, single_events)], single_flights, _) = await _serve_cases(
        engine, cases, decode_steps=1, speculative_tokens=0
    )
    ([(multi, multi_events)], multi_flights, _) = await _serve_cases(
        engine, cases, decode_steps=8, speculative_tokens=0
    )
    for a, b in zip(single, multi, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason, x.matched_stop) == (
                y.token_ids,
                y.text,
                y.finish_reason,
                y.matched_stop,
            )
            assert [(p.token_id, p.logprob, p.top) for p in x.logprobs] == [
                (p.token_id, p.logprob, p.top) for p in y.logprobs
            ]
    assert multi[0].outputs[0].finish_reason == "stop" and multi[0].outputs[0].matched_stop == " 12"
    assert multi[1].outputs[0].matched_stop == 2
    for request_events, request in zip(multi_events, multi, strict=True):
        for seq_events, completion in zip(request_events, request.outputs, strict=True):
            assert len(seq_events) == len(completion.token_ids)  # streamed step by step, not flight by flight
            assert "".join(e.delta for e in seq_events) == completion.text
    assert multi_events == single_events
    assert multi_flights < single_flights / 3, (multi_flights, single_flights)


async def test_a_new_request_halts_a_multi_step_flight_after_its_current_step(engine):
    """Admission waits at most one step: with flights allowed 10000 steps, a short request sent while a long one
    decodes still finishes first.  An abort likewise ends the long one's flight; every page comes back."""
    long_prompt, short_prompt = engine.chat_prompts(2)
    svc = engine.service(decode_steps=10_000, speculative_tokens=0)
    await svc.start()
    try:
        long = svc.submit(long_prompt, SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True))
        [seq] = long.seqs
        while len(seq.output_ids) < 2:
            await asyncio.sleep(0.01)
        assert svc.scheduler.multi_step.in_air, "the long request should be in a multi-step flight"
        short = await svc.generate(short_prompt, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        assert len(short.outputs[0].token_ids) == 4
        assert not seq.finished and len(seq.output_ids) < 400
        svc.abort(long)
        out = await svc.wait(long)
        assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 400
        for _ in range(100):
            if svc.is_idle():
                break
            await asyncio.sleep(0.05)
        assert svc.is_idle() and svc.pages.used_pages == 0 and not svc.scheduler.multi_step.in_air
        svc.check_integrity()
    finally:
        await svc.close()


async def test_speculative_decoding_gives_the_tokens_text_logprobs_and_events_of_plain_decoding(
    engine, tokenizer, monkeypatch
):
    """Drafts change how many tokens a pass yields, not which: greedy requests (a stop string, EOS, logprobs, a
    repeating text) and seeded sampled ones (drafted too: each draw is keyed by its position) get exactly what
    they get without drafts, one streamed event per token; a second run of the same prompts, from the pages the
    first registered, too."""
    count = tokenizer.encode("Count: 1, 2, 3, 4, 5, 6, 7,")
    chat = engine.chat_prompts(3)
    cases = [
        (count, SamplingParams(max_new_tokens=40, temperature=0, stop=[" 12"])),
        (chat[0], SamplingParams(max_new_tokens=200, temperature=0)),
        (chat[1], SamplingParams(max_new_tokens=37, temperature=0, logprobs=True, top_logprobs=2)),
        (tokenizer.encode("the dog lazy " * 3), SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)),
        (chat[2], SamplingParams(max_new_tokens=29, temperature=0.8, seed=3)),
        (tokenizer.encode("the dog lazy " * 3), SamplingParams(max_new_tokens=60, temperature=0.3, seed=5)),
    ]

    def summary(out):
        return [(c.token_ids, c.text, c.finish_reason, c.matched_stop, c.logprobs) for c in out.outputs]

    # one step a flight: a flight is a forward pass
    plain, plain_flights, _ = await _serve_cases(engine, cases, rounds=2, decode_steps=1, speculative_tokens=0)
    drafted, drafted_flights, scheduler = await _serve_cases(
        engine, cases, rounds=2, decode_steps=1, speculative_tokens=4
    )
    plain, drafted = [[([summary(o) for o in outs], ev) for outs, ev in runs] for runs in (plain, drafted)]
    assert plain[0] == plain[1] == drafted[0] == drafted[1]
    accepted = scheduler.speculation.accepted_tokens
    outputs, events = drafted[0]
    events = [seq_events for [seq_events] in events]
    assert outputs[0][0][2:4] == ("stop", " 12") and outputs[1][0][3] == 2 and outputs[3][0][2] == "length"
    assert len(outputs[2][0][4]) == len(outputs[2][0][0]) > 10  # a logprob per token
    for seq_events, completion in zip(events, outputs, strict=True):
        assert len(seq_events) == len(completion[0][0])
        assert "".join(e.delta for e in seq_events) == completion[0][1]
    assert accepted > 60 and drafted_flights < 0.7 * plain_flights, (accepted, drafted_flights, plain_flights)
    # whether a flight drafts rests on measured speed; drafting always allowed, this measures acceptance alone
    monkeypatch.setattr(speculation, "DraftSwitch", functools.partial(speculation.DraftSwitch, fixed=True))
    _, _, sampled_only = await _serve_cases(engine, cases[-1:], decode_steps=1, speculative_tokens=4)
    assert sampled_only.speculation.accepted_tokens > 10  # the sampled repeating text drafted, and its drafts were kept


async def test_a_request_has_one_consumer_of_its_events_and_a_finished_one_waits_again(engine):
    """Waiting on a request while another task waits on it or streams it is an EventsTaken error naming the
    request, not an assertion or a hang; a request waited for to its end gives its output again."""
    from fiberserve.engine import EventsTaken

    svc = engine.service(dtype="float32")
    await svc.start()
    try:
        prompt = engine.chat_prompts(1)[0]
        request = svc.submit(prompt, GREEDY)
        first = asyncio.create_task(svc.wait(request))
        await asyncio.sleep(0)  # the first waiter has claimed the events
        with pytest.raises(EventsTaken, match=f"request {request.id} \\(sequence 0\\) already has a consumer"):
            await svc.wait(request)
        done = await first
        again = await svc.wait(request)
        assert again.outputs == done.outputs and done.outputs[0].finish_reason in ("stop", "length")

        streamed = svc.submit(prompt, GREEDY)
        sink: asyncio.Queue = asyncio.Queue()
        streamed.seqs[0].forward_events(sink)
        with pytest.raises(EventsTaken):
            await svc.wait(streamed)
        while not (await sink.get())[1].finished:
            pass
        await asyncio.sleep(0)
        assert svc.is_idle() and svc.pages.used_pages == 0
        svc.check_integrity()
    finally:
        await svc.close()


async def test_pages_a_timed_out_call_may_still_write_stay_out_of_use_until_it_returns(engine):
    """A step hangs as its layers start (its K/V slots chosen, none written) past the invocation timeout, then,
    released by the test, goes on and writes its K/V.  Its pages stay quarantined until the call returns, so the
    K/V of every other page, such as those of a request served meanwhile (which the prefix cache keeps for later
    ones), does not change; the replacement fiber's team comes out of the stuck one's threads until then."""
    timeout = 3.0  # ample for every step of a 135M model, however loaded the machine
    svc = engine.service(fibers=1, threads_per_fiber=2, fit_free_cores=False, invocation_timeout=timeout)
    svc.faults.rate, svc.faults.hang_seconds, svc.faults.point = 1.0, 600.0, FaultPoint.LAYERS
    await svc.start()
    try:
        hung_prompt, prompt = engine.chat_prompts(2)
        params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        hung = (await svc.generate(hung_prompt, params)).outputs[0]
        svc.faults.rate = 0.0
        assert hung.finish_reason == "error" and f"ran past {timeout:.3g}s" in (hung.error or "")
        quarantined = svc.pages.quarantined
        assert list(quarantined) == ["fiber-0"] and quarantined["fiber-0"] >= svc.pages.pages_for(len(hung_prompt))
        assert svc.pages.used_pages == quarantined["fiber-0"] and svc.pool.stats().retired == 1
        assert svc.teams() == 1  # the stuck call's two threads leave the replacement one
        served = await svc.generate(prompt, params)
        assert served.outputs[0].finish_reason == "length"
        assert await svc.pool.fibers[0].run(torch.get_num_threads) == 1
        held_slots = torch.tensor(
            [p * svc.pages.page_size + i for p in svc.pages._quarantined["fiber-0"] for i in range(svc.pages.page_size)]
        )
        others = torch.ones(svc.kv_cache.k.shape[1], dtype=torch.bool)
        others[held_slots] = False
        k_before, v_before = svc.kv_cache.k[:, others].clone(), svc.kv_cache.v[:, others].clone()
        assert svc.pages.quarantined
        svc.faults.release_hangs()
        for _ in range(200):
            if not svc.pages.quarantined:
                break
            await asyncio.sleep(0.05)
        assert not svc.pages.quarantined and svc.pages.used_pages == 0 and svc.teams() == 2
        assert torch.equal(svc.kv_cache.k[:, others], k_before) and torch.equal(svc.kv_cache.v[:, others], v_before)
        # The late call wrote its pages: they changed, and are free again (the first prompt's K/V, never served).
        assert not torch.equal(svc.kv_cache.k[:, held_slots], torch.zeros_like(svc.kv_cache.k[:, held_slots]))
        again = await svc.generate(prompt, params)  # reads the served request's cached pages
        assert again.outputs[0].token_ids == served.outputs[0].token_ids and again.cached_tokens > 0
        svc.check_integrity()
    finally:
        await svc.close()


@pytest.mark.parametrize("isolation", ["per_call", "none"])
async def test_every_isolation_serves_the_model_each_call_on_its_fiber_s_team(engine, isolation):
    """per_call moves a runner between fibers and none shares one among them: each call sets its thread's team,
    and the outputs are per_fiber's."""
    prompts, params = engine.chat_prompts(6), SamplingParams(max_new_tokens=8, temperature=0)
    config = {"fibers": 2, "threads_per_fiber": 1, "fit_free_cores": False}
    reference = await engine.run(prompts, params, **config)
    svc = engine.service(isolation=isolation, **config)
    await svc.start()
    try:
        outputs = [await svc.generate(p, params) for p in prompts]  # one at a time: flights take the fibers in turn
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
        assert svc.program.instances_built == 1
        assert [await fiber.run(torch.get_num_threads) for fiber in svc.pool.fibers] == [1, 1]
    finally:
        await svc.close()


@pytest.mark.parametrize("pooling", ["last", "mean"])
async def test_embeddings_batched_beside_generations_equal_each_alone_bit_for_bit(engine, pooling):
    """An embedding is its prompt's final hidden states pooled: one prompt at a time in whole chunks, or eight at
    once in chunks of 24 tokens beside generating requests, with the prompts' pages in the prefix cache or not, its
    bits are the same; the generations beside them are their own."""
    prompts = engine.chat_prompts(8)
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    svc = engine.service(fibers=1)
    await svc.start()
    try:
        alone = [await svc.embed(p, pooling) for p in prompts]
        generated = [(await svc.generate(p, greedy)).outputs[0].token_ids for p in prompts[:2]]
        again = [await svc.embed(p, pooling) for p in prompts]  # their pages now in the prefix cache
    finally:
        await svc.close()
    assert all(torch.equal(a, b) for a, b in zip(alone, again, strict=True))
    assert all(v.shape == (svc.model.config.hidden_size,) and v.dtype == torch.float32 for v in alone)
    assert len({tuple(v[:4].tolist()) for v in alone}) == len(prompts)  # each prompt its own

    svc = engine.service(fibers=2, max_batch_tokens=24)
    await svc.start()
    try:
        generating = [svc.submit(p, greedy) for p in prompts[:2]]
        batched = await asyncio.gather(*(svc.embed(p, pooling) for p in prompts))
        outputs = await asyncio.gather(*(svc.wait(r) for r in generating))
        await asyncio.sleep(0)
        assert svc.is_idle() and svc.pages.used_pages == 0
        svc.check_integrity()
    finally:
        await svc.close()
    assert [o.outputs[0].token_ids for o in outputs] == generated
    for a, b in zip(alone, batched, strict=True):
        assert torch.equal(a, b)


async def test_an_embedding_s_pooling_and_its_refusals(engine, tokenizer):
    """``last`` is the last token's final hidden state, ``mean`` every token's mean (the hidden states of
    :meth:`LlamaModel.final_hidden` over the whole prompt); an embedding generates nothing and ends by ``stop``."""
    prompt = engine.chat_prompts(1)[0]
    svc = engine.service(fibers=1)
    await svc.start()
    try:
        last, mean = await svc.embed(prompt, "last"), await svc.embed(prompt, "mean")
        request = svc.submit(prompt, SamplingParams(max_new_tokens=0, pooling="mean"))
        output = await svc.wait(request)
        assert output.outputs[0].finish_reason == "stop" and output.outputs[0].token_ids == []
        for bad, field in [
            (SamplingParams(max_new_tokens=0, pooling="cls"), "pooling"),
            (SamplingParams(max_new_tokens=3, pooling="last"), "max_new_tokens"),
            (SamplingParams(max_new_tokens=0, pooling="last", n=2), "n"),
        ]:
            with pytest.raises(InvalidParameter) as refused:
                svc.submit(prompt, bad)
            assert refused.value.field == field
    finally:
        await svc.close()
    model = svc.model
    runner = ModelRunner(model, svc.kv_cache, lambda: 1, svc.faults)
    seq = Sequence("r", 0, prompt, SamplingParams(max_new_tokens=0, pooling="mean"), None, frozenset(), 4096)
    seq.pages = list(range(svc.pages.pages_for(len(prompt))))
    batch = runner.build_batch([FlightItem(seq, 0, len(prompt), tuple(seq.pages))])
    hidden = model.final_hidden(batch, svc.kv_cache)
    assert hidden.shape == (len(prompt), model.config.hidden_size)
    assert torch.equal(last, hidden[-1])
    torch.testing.assert_close(mean, hidden.mean(dim=0), atol=0, rtol=0)
