"""A worker: one OS thread running its own asyncio event loop.

Contract: callables submitted with :meth:`Worker.submit` run on the worker's
thread strictly one after another, in submission order, each to completion
(an async callable is awaited before the next item starts).  The caller gets
a :class:`concurrent.futures.Future`; :meth:`Worker.run` wraps it for the
caller's own event loop, so waiting never blocks that loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Callable
from typing import Any

_STOP = object()


class Worker:
    """One thread, one event loop, one ordered queue of work."""

    def __init__(self, name: str = "worker") -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._queue: asyncio.Queue[Any] | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._closed = False
        self._thread.start()
        self._ready.wait()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._queue = asyncio.Queue()
        self._ready.set()
        self._loop.run_until_complete(self._drain())
        self._loop.close()

    async def _drain(self) -> None:
        assert self._queue is not None
        while True:
            item = await self._queue.get()
            if item is _STOP:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
                if inspect.isawaitable(result):
                    result = await result
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)
            else:
                future.set_result(result)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queue ``fn(*args)`` on this worker; thread-safe."""
        if self._closed:
            raise RuntimeError(f"worker {self.name!r} is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (future, fn, args))
        return future

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on this worker and await its result from the caller's loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop after the work already queued; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._queue.put_nowait, _STOP)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __repr__(self) -> str:
        return f"Worker({self.name!r}, alive={self._thread.is_alive()})"
