"""Programs: a stateful entry point and the rule that maps its instances to calls.

``Program(factory, isolation)``: ``factory(fiber)`` builds one *instance*, a
callable holding state (workspaces, caches, graphs bound to the fiber's
stream).  ``await program.invoke(fiber, *args)`` runs ``instance(*args)`` on
the fiber's worker thread and returns the result to the caller's loop.

Isolation decides which instance a call gets:

* ``PER_FIBER``: one instance per fiber, built lazily on first use.  A second
  invocation on a fiber whose invocation is still running raises
  :class:`ConcurrentInvocationError` at once: it is a scheduling bug (two
  batches on one lane), and failing loudly beats corrupting the instance.
* ``PER_CALL``: each running call has an instance of its own; instances are
  recycled once free, never shared by two running calls.
* ``NONE``: one shared instance, no guard; only for stateless programs.

An invocation that raises discards the instance it ran on (a fresh one is
built on next use), re-raises to its own caller only, and leaves the fiber
usable.  A caller cancelled mid-invocation still holds the fiber until the
call lands.  An invocation that outlives ``timeout`` raises
:class:`InvocationTimeout`; the fiber is marked unhealthy so that its pool
retires it (its thread may still be stuck) and the instance is discarded.  The
error carries the call's future: whatever the call may still write must stay
reserved until that future is done (the engine quarantines the call's KV pages).
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import Callable
from typing import Any

from fiberserve.runtime.fiber import Fiber


class Isolation(enum.Enum):
    NONE = "none"
    PER_FIBER = "per_fiber"
    PER_CALL = "per_call"


class ConcurrentInvocationError(RuntimeError):
    """Two invocations of a PER_FIBER program overlapped on one fiber."""


class InvocationTimeout(TimeoutError):
    """An invocation ran past its deadline; its fiber is retired.  ``call``: the future of the call, which may
    still be running on ``fiber``'s worker; done (result or error) once it returns."""

    def __init__(self, message: str, fiber: Fiber, call: asyncio.Future) -> None:
        super().__init__(message)
        self.fiber, self.call = fiber, call


class Program:
    """A factory of stateful instances plus an isolation rule; see the module docstring."""

    def __init__(
        self,
        factory: Callable[[Fiber], Callable[..., Any]],
        isolation: Isolation = Isolation.PER_FIBER,
        name: str = "program",
    ) -> None:
        self.factory = factory
        self.isolation = Isolation(isolation)
        self.name = name
        self._per_fiber: dict[int, Any] = {}
        self._running_fibers: set[int] = set()
        self._free_instances: list[Any] = []
        self._shared: Any = None
        self._shared_lock = threading.Lock()
        self.instances_built = 0
        self.failures = 0

    async def invoke(self, fiber: Fiber, *args: Any, timeout: float | None = None) -> Any:
        """Run the instance this isolation assigns on ``fiber``; see the module docstring."""
        if self.isolation is Isolation.PER_FIBER:
            if fiber.id in self._running_fibers:
                raise ConcurrentInvocationError(
                    f"Cannot make concurrent invocations of PER_FIBER program {self.name!r} on "
                    f"{fiber.name}: an invocation is still running there. Take one fiber per "
                    "in-flight invocation from a FiberPool (async with pool.acquire() as fiber), "
                    "or give the program Isolation.PER_CALL if it must share a fiber."
                )
            self._running_fibers.add(fiber.id)
        try:
            call = fiber.submit(self._run_on_worker, fiber, args)  # queued before this coroutine first waits
            try:
                return await asyncio.wait_for(asyncio.shield(call), timeout)
            except asyncio.CancelledError:
                # The caller gave up, but the lane is busy until the call lands:
                # hold the fiber until then, so its next user never overlaps it.
                await _until_done(call)
                raise
            except TimeoutError:
                fiber.healthy = False
                self._per_fiber.pop(fiber.id, None)
                call.add_done_callback(_retrieve)  # its late result or error belongs to nobody
                raise InvocationTimeout(
                    f"{self.name!r} on {fiber.name} ran past {timeout:.3g}s; the fiber is retired", fiber, call
                ) from None
        finally:
            self._running_fibers.discard(fiber.id)

    # Everything below runs on the fiber's worker thread.

    def _build(self, fiber: Fiber) -> Any:
        instance = self.factory(fiber)
        self.instances_built += 1
        return instance

    def _run_on_worker(self, fiber: Fiber, args: tuple) -> Any:
        if self.isolation is Isolation.PER_FIBER:
            instance = self._per_fiber.get(fiber.id)
            if instance is None:
                instance = self._per_fiber[fiber.id] = self._build(fiber)
            try:
                return instance(*args)
            except BaseException:
                self.failures += 1
                self._per_fiber.pop(fiber.id, None)
                raise
        if self.isolation is Isolation.PER_CALL:
            try:
                instance = self._free_instances.pop()
            except IndexError:
                instance = self._build(fiber)
            try:
                result = instance(*args)
            except BaseException:
                self.failures += 1
                raise
            self._free_instances.append(instance)
            return result
        with self._shared_lock:
            if self._shared is None:
                self._shared = self._build(fiber)
            instance = self._shared
        try:
            return instance(*args)
        except BaseException:
            self.failures += 1
            with self._shared_lock:
                if self._shared is instance:
                    self._shared = None
            raise


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # marks it retrieved: no "exception never retrieved" at collection


async def _until_done(future: asyncio.Future) -> None:
    """Wait for ``future`` even through repeated cancellation (bounded by the call itself)."""
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            continue
        except BaseException:  # the result belongs to nobody now
            return
    if not future.cancelled():
        future.exception()  # mark retrieved
