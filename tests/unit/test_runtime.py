"""The runtime's contracts: workers, fibers, the pool and program isolation (no model)."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
import weakref

import pytest

from fiberserve.runtime import (
    ConcurrentInvocationError,
    FiberPool,
    InvocationTimeout,
    Isolation,
    Program,
    Worker,
    new_fiber,
)


class Recorder:
    """A stateful instance that records overlap: it must never see two calls at once."""

    built = 0

    def __init__(self, fiber, tracker):
        Recorder.built += 1
        self.fiber = fiber
        self.tracker = tracker
        self.active = 0
        self.calls = 0

    def __call__(self, delay=0.01, fail=False):
        self.active += 1
        self.tracker.enter()
        try:
            assert self.active == 1, "an instance saw two overlapping calls"
            time.sleep(delay)
            self.calls += 1
            if fail:
                raise ValueError("injected failure")
            return (self.fiber.id, id(self))
        finally:
            self.tracker.leave()
            self.active -= 1


async def until(condition, timeout: float = 10.0) -> None:
    """Wait, without a guessed delay, until ``condition()`` holds (it is checked as the loop turns)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.001)


class Tracker:
    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0

    def enter(self):
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)

    def leave(self):
        with self.lock:
            self.running -= 1


@pytest.fixture
def tracker():
    return Tracker()


@pytest.fixture
def pool():
    pools = []

    def make(size=4, **kw):
        p = FiberPool(size=size, **kw)
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.close()


def test_worker_runs_in_order_and_shuts_down():
    worker = Worker("w")
    seen = []
    futures = [worker.submit(seen.append, i) for i in range(100)]
    for f in futures:
        f.result(timeout=5)
    assert seen == list(range(100))
    assert worker.submit(threading.current_thread).result(timeout=5) is worker.thread
    worker.shutdown()
    assert not worker.thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(print)


def test_a_waiting_worker_holds_nothing_of_its_finished_work():
    """What a call took and gave back is freed once its caller lets go, while the worker waits for more: not
    later by the worker's daemon thread, which may only get to it as the interpreter shuts down (a tensor freed
    then aborts the process)."""

    class Payload:
        pass

    worker = Worker("w")
    given, returned = Payload(), worker.submit(Payload).result(timeout=5)
    worker.submit(lambda payload: None, given).result(timeout=5)
    refs = [weakref.ref(given), weakref.ref(returned)]
    del given, returned
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
    worker.shutdown()


async def test_worker_awaits_async_work_before_the_next_item():
    worker = Worker("w")
    order = []

    async def slow(tag):
        order.append(("start", tag))
        await asyncio.sleep(0.02)
        order.append(("end", tag))

    await asyncio.gather(worker.run(slow, 1), worker.run(slow, 2))
    assert order == [("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    worker.shutdown()


async def test_per_fiber_concurrent_invocations_on_one_fiber_raise(tracker):
    """The original failure, reproduced: it must raise at once, not hang or crash."""
    fiber = new_fiber()
    program = Program(lambda f: Recorder(f, tracker), Isolation.PER_FIBER, name="llm")
    first = asyncio.create_task(program.invoke(fiber, 0.2))
    await until(lambda: tracker.running == 1)
    with pytest.raises(ConcurrentInvocationError) as info:
        await program.invoke(fiber, 0.0)
    assert not first.done()  # refused while the first still runs: it did not wait for it
    message = str(info.value)
    assert "Cannot make concurrent invocations" in message and "FiberPool" in message
    assert "PER_CALL" in message
    assert (await first)[0] == fiber.id  # the running call is unharmed
    assert await program.invoke(fiber, 0.0)  # and the fiber is usable afterwards
    fiber.close()


async def test_64_invocations_through_4_fibers(pool, tracker):
    p = pool(4)
    program = Program(lambda f: Recorder(f, tracker), Isolation.PER_FIBER)
    ticks = 0
    done = asyncio.Event()

    async def heartbeat():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.005)

    async def one():
        async with p.acquire() as fiber:
            return await program.invoke(fiber, 0.02)

    beat = asyncio.create_task(heartbeat())
    results = await asyncio.gather(*(one() for _ in range(64)))
    done.set()
    await beat
    assert len(results) == 64
    assert tracker.peak <= 4
    assert len({fid for fid, _ in results}) == 4
    assert len({inst for _, inst in results}) == 4  # one instance per fiber
    # 64 calls x 20 ms over 4 lanes take >= 320 ms (64 ticks' worth); a blocked loop would tick once or twice.
    assert ticks >= 5
    s = p.stats()
    assert (s.size, s.idle, s.busy, s.waiters, s.acquisitions) == (4, 4, 0, 0, 64)
    assert s.max_wait_s > 0 and s.total_wait_s >= s.max_wait_s


async def test_waiters_are_served_fifo(pool):
    p = pool(1)
    order = []
    release = asyncio.Event()

    async def holder():
        async with p.acquire():
            await release.wait()

    async def waiter(i):
        async with p.acquire():
            order.append(i)
            await asyncio.sleep(0)

    h = asyncio.create_task(holder())
    await asyncio.sleep(0)
    tasks = []
    for i in range(10):
        tasks.append(asyncio.create_task(waiter(i)))
        await asyncio.sleep(0)  # enqueue in a known order
    assert p.stats().waiters == 10
    release.set()
    await asyncio.gather(h, *tasks)
    assert order == list(range(10))


async def test_cancelled_waiter_leaks_nothing(pool):
    p = pool(1)
    release = asyncio.Event()

    async def holder():
        async with p.acquire():
            await release.wait()

    async def waiter():
        async with p.acquire():
            pass

    h = asyncio.create_task(holder())
    await asyncio.sleep(0)
    w = asyncio.create_task(waiter())
    w2 = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    assert p.stats().waiters == 2
    w.cancel()
    await asyncio.sleep(0)
    assert p.stats().waiters == 1
    release.set()
    await h
    await w2
    with pytest.raises(asyncio.CancelledError):
        await w
    s = p.stats()
    assert (s.idle, s.busy, s.waiters) == (1, 0, 0)


@pytest.mark.parametrize("cancelled_first", [False, True], ids=["handed-over-then-cancelled", "cancelled-first"])
async def test_a_waiter_cancelled_around_a_release_ends_cancelled_and_leaves_the_fiber_idle(pool, cancelled_first):
    """Handed the fiber and cancelled before it runs, the waiter gives the fiber back; cancelled first, the release
    passes its future over (and drops it), and the waiter does not try to remove it again (no ValueError)."""
    p = pool(1)
    ctx = p.acquire()
    await ctx.__aenter__()
    w = asyncio.create_task(p._take())
    await asyncio.sleep(0)
    if cancelled_first:
        w.cancel()
    await ctx.__aexit__(None, None, None)
    if not cancelled_first:
        w.cancel()
    with pytest.raises(asyncio.CancelledError):
        await w
    s = p.stats()
    assert (s.idle, s.busy, s.waiters) == (1, 0, 0)
    p.check_integrity()


async def test_exception_inside_acquire_returns_the_fiber(pool):
    p = pool(2)
    with pytest.raises(KeyError):
        async with p.acquire():
            raise KeyError("boom")
    task = asyncio.create_task(_hold_forever(p))
    await until(lambda: p.stats().busy == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    s = p.stats()
    assert (s.size, s.idle, s.busy) == (2, 2, 0)


async def _hold_forever(p):
    async with p.acquire():
        await asyncio.sleep(3600)


async def test_pool_grows_up_to_its_maximum(pool):
    p = pool(1, max_size=3)
    gate = asyncio.Event()
    held = []

    async def hold():
        async with p.acquire() as fiber:
            held.append(fiber)
            await gate.wait()

    tasks = [asyncio.create_task(hold()) for _ in range(5)]
    await until(lambda: p.stats().waiters == 2)
    s = p.stats()
    assert (s.size, s.busy, s.waiters) == (3, 3, 2)
    gate.set()
    await asyncio.gather(*tasks)
    assert p.stats().idle == 3
    assert len({f.id for f in held}) == 3


async def test_failing_invocation_rebuilds_instance_and_spares_others(pool, tracker):
    p = pool(2)
    program = Program(lambda f: Recorder(f, tracker), Isolation.PER_FIBER)

    async def call(fail, delay=0.02):
        async with p.acquire() as fiber:
            return await program.invoke(fiber, delay, fail)

    ok_before = await asyncio.gather(call(False), call(False))
    results = await asyncio.gather(call(True), call(False, 0.05), return_exceptions=True)
    assert isinstance(results[0], ValueError) and str(results[0]) == "injected failure"
    assert isinstance(results[1], tuple)
    assert program.failures == 1
    later = await asyncio.gather(*(call(False) for _ in range(6)))
    assert len(later) == 6
    assert program.instances_built == 3  # the failed fiber's instance was rebuilt once
    assert {r[1] for r in later} != {r[1] for r in ok_before}
    assert p.stats().size == 2 and p.stats().idle == 2


async def test_per_call_overlapping_calls_get_distinct_instances(tracker):
    fiber_a, fiber_b = new_fiber(), new_fiber()
    program = Program(lambda f: Recorder(f, tracker), Isolation.PER_CALL)
    a, b = await asyncio.gather(program.invoke(fiber_a, 0.05), program.invoke(fiber_b, 0.05))
    assert a[1] != b[1]
    c = await program.invoke(fiber_a, 0.0)
    assert c[1] in {a[1], b[1]}  # recycled once free
    assert program.instances_built == 2
    # PER_CALL on one fiber never raises: the lane serializes the calls.
    await asyncio.gather(program.invoke(fiber_a, 0.01), program.invoke(fiber_a, 0.01))
    fiber_a.close()
    fiber_b.close()


async def test_caller_cancelled_mid_invocation_holds_the_fiber_until_the_call_lands(pool, tracker):
    p = pool(1)
    program = Program(lambda f: Recorder(f, tracker), Isolation.PER_FIBER)

    async def call(delay):
        async with p.acquire() as fiber:
            return await program.invoke(fiber, delay)

    first = asyncio.create_task(call(0.1))
    await until(lambda: tracker.running == 1)
    first.cancel()
    second = asyncio.create_task(call(0.0))
    with pytest.raises(asyncio.CancelledError):
        await first
    assert tracker.running == 0  # the first call finished before the fiber came back
    assert (await second)[0] == p.fibers[0].id  # no ConcurrentInvocationError for the next user


async def test_invoke_queues_its_call_on_the_fiber_before_it_first_waits():
    """An invoking task's call is on the worker after the task's first step, ahead of whatever the loop runs
    next: the service relies on it to have the next flight computing while the loop streams the last one."""
    fiber = new_fiber()
    called = threading.Event()
    program = Program(lambda f: called.set, Isolation.PER_FIBER)
    try:
        task = asyncio.create_task(program.invoke(fiber))
        await asyncio.sleep(0)  # one turn of the loop: the task's first step runs
        assert called.wait(timeout=2)  # the loop is blocked here: only a call already queued can run
        await task
    finally:
        fiber.close()


async def test_none_isolation_shares_one_instance():
    fiber_a, fiber_b = new_fiber(), new_fiber()
    program = Program(lambda f: lambda: id(program), Isolation.NONE)
    results = await asyncio.gather(*(program.invoke(f) for f in (fiber_a, fiber_b, fiber_a)))
    assert len(set(results)) == 1 and program.instances_built == 1
    fiber_a.close()
    fiber_b.close()


async def test_hung_invocation_is_bounded_and_its_fiber_replaced(pool):
    p = pool(2)
    release = threading.Event()
    program = Program(lambda f: lambda block: release.wait(5) if block else "ok", Isolation.PER_FIBER)

    async def call(block, timeout):
        async with p.acquire() as fiber:
            return await program.invoke(fiber, block, timeout=timeout)

    with pytest.raises(InvocationTimeout, match="retired") as timed_out:
        await call(True, 0.05)
    assert p.stats().size == 2 and p.stats().retired == 1
    assert await asyncio.gather(*(call(False, 5) for _ in range(4))) == ["ok"] * 4
    # The error carries the call, still running on the retired fiber, done once it returns.
    assert not timed_out.value.call.done() and not timed_out.value.fiber.healthy
    release.set()
    assert await asyncio.wait_for(timed_out.value.call, 5) is True


async def test_randomized_stress_keeps_every_invariant(pool, tracker):
    rng = random.Random(1234)
    p = pool(3, max_size=5)
    program = Program(lambda f: Recorder(f, tracker), Isolation.PER_FIBER)
    outcome = {"ok": 0, "failed": 0, "cancelled": 0}

    async def call(delay, fail):
        async with p.acquire() as fiber:
            await asyncio.sleep(rng.random() * 0.002)
            return await program.invoke(fiber, delay, fail)

    tasks = []
    for _ in range(300):
        t = asyncio.create_task(call(rng.random() * 0.003, rng.random() < 0.1))
        tasks.append(t)
        if rng.random() < 0.3:
            await asyncio.sleep(0)
        if rng.random() < 0.1:
            rng.choice(tasks).cancel()
    for t in tasks:
        try:
            await t
            outcome["ok"] += 1
        except ValueError as error:
            assert str(error) == "injected failure"  # only the program's own failures reach a caller
            outcome["failed"] += 1
        except asyncio.CancelledError:
            outcome["cancelled"] += 1
    assert sum(outcome.values()) == 300
    assert outcome["ok"] > 0 and outcome["failed"] > 0 and outcome["cancelled"] > 0
    s = p.stats()
    assert s.busy == 0 and s.waiters == 0 and s.idle == s.size <= 5
    assert tracker.running == 0 and tracker.peak <= 5
    # Each acquisition entered the block once; the instance saw failures only as asked.
    assert s.acquisitions >= outcome["ok"] + outcome["failed"]
    # A call whose caller was cancelled mid-invocation still ran (and maybe failed) on its lane.
    assert outcome["failed"] <= program.failures <= outcome["failed"] + outcome["cancelled"]
    p.check_integrity()
    # The pool still serves correctly afterwards.
    async with p.acquire() as fiber:
        assert (await program.invoke(fiber, 0.0))[0] == fiber.id


def test_fault_injection_is_evenly_spaced_and_fires_at_its_point():
    from fiberserve.engine.faults import FaultInjector, FaultPoint, InjectedFault

    faults = FaultInjector(rate=0.2, point=FaultPoint.LAYERS)
    failed = []
    for call in range(1, 21):
        faults.maybe_fail(FaultPoint.START)  # not its point: neither counted nor fired
        try:
            faults.maybe_fail(FaultPoint.LAYERS)
        except InjectedFault:
            failed.append(call)
    assert failed == [5, 10, 15, 20] and faults.injected == 4 and faults.calls == 20
    faults.rate = 0.0
    faults.maybe_fail(FaultPoint.LAYERS)  # off: never fails
    assert faults.calls == 20
