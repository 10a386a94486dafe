"""The fiber pool: the idle fibers of one device, handed out FIFO.

Contract of :meth:`FiberPool.acquire`:

* ``async with pool.acquire() as fiber:`` yields a fiber nobody else holds;
* when none is idle (and the pool cannot grow) the caller waits, without
  blocking the event loop, behind earlier waiters (FIFO);
* a waiter cancelled while waiting leaks nothing;
* the fiber goes back on every exit path: success, exception, cancellation;
* a fiber marked unhealthy (its invocation hung) is retired on release and a
  fresh one takes its place, so the pool keeps its size.

The pool belongs to the event loop that uses it; it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fiberserve.runtime.fiber import Fiber, new_fiber


@dataclass(frozen=True)
class PoolStats:
    size: int
    idle: int
    busy: int
    waiters: int
    acquisitions: int
    total_wait_s: float
    max_wait_s: float
    retired: int


class FiberPool:
    """Idle fibers of one device; ``size`` at start, growing up to ``max_size``."""

    def __init__(
        self,
        size: int = 1,
        device: str = "cpu",
        max_size: int | None = None,
        fiber_factory: Callable[[str, str], Fiber] | None = None,
        name: str = "pool",
    ) -> None:
        if size < 1:
            raise ValueError(f"a fiber pool needs at least one fiber, got size={size}")
        self.device = device
        self.name = name
        self.max_size = max(size, max_size or size)
        self._factory = fiber_factory or (lambda dev, nm: new_fiber(dev, nm))
        self._all: list[Fiber] = []
        self._idle: deque[Fiber] = deque()
        self._waiters: deque[asyncio.Future[Fiber]] = deque()
        self._acquisitions = 0
        self._total_wait = 0.0
        self._max_wait = 0.0
        self._retired = 0
        for _ in range(size):
            self._idle.append(self._new_fiber())

    def _new_fiber(self) -> Fiber:
        fiber = self._factory(self.device, f"{self.name}-{len(self._all) + self._retired}")
        self._all.append(fiber)
        return fiber

    @property
    def fibers(self) -> tuple[Fiber, ...]:
        return tuple(self._all)

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[Fiber]:
        """Hold an idle fiber for the duration of the ``async with`` block."""
        fiber = await self._take()
        try:
            yield fiber
        finally:
            self._release(fiber)

    async def _take(self) -> Fiber:
        start = time.perf_counter()
        if self._idle and not self._waiters:
            fiber = self._idle.popleft()
        elif len(self._all) < self.max_size and not self._waiters:
            fiber = self._new_fiber()
        else:
            waiter: asyncio.Future[Fiber] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                fiber = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._release(waiter.result())  # handed over just as we were cancelled
                elif waiter in self._waiters:  # a release may already have passed it over and dropped it
                    self._waiters.remove(waiter)
                raise
        waited = time.perf_counter() - start
        self._acquisitions += 1
        self._total_wait += waited
        self._max_wait = max(self._max_wait, waited)
        return fiber

    def _release(self, fiber: Fiber) -> None:
        if not fiber.healthy:
            self._all.remove(fiber)
            self._retired += 1
            fiber.close()
            fiber = self._new_fiber()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(fiber)
                return
        self._idle.append(fiber)

    def stats(self) -> PoolStats:
        size = len(self._all)
        return PoolStats(
            size=size,
            idle=len(self._idle),
            busy=size - len(self._idle),
            waiters=sum(1 for w in self._waiters if not w.done()),
            acquisitions=self._acquisitions,
            total_wait_s=self._total_wait,
            max_wait_s=self._max_wait,
            retired=self._retired,
        )

    def check_integrity(self) -> None:
        """Every fiber is idle xor held; no fiber is idle twice."""
        ids = [f.id for f in self._idle]
        assert len(ids) == len(set(ids)), "a fiber is idle twice"
        assert set(ids) <= {f.id for f in self._all}, "an idle fiber is not in the pool"

    def close(self) -> None:
        """Shut every worker down; the pool must not be used afterwards."""
        for waiter in self._waiters:
            waiter.cancel()
        for fiber in self._all:
            fiber.close()
