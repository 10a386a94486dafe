"""A worker: one OS thread that runs submitted work strictly in order.

Contract: callables submitted with :meth:`Worker.submit` run on the worker's
thread strictly one after another, in submission order, each to completion
(an async callable is run to completion on the worker's own event loop before
the next item starts).  The caller gets a :class:`concurrent.futures.Future`;
:meth:`Worker.run` wraps it for the caller's own event loop, so waiting never
blocks that loop.

The thread waits on a ``queue.SimpleQueue``, not on an event loop of its own:
handing it an item is a lock release, not a wake-up of a selector through its
socket followed by a loop iteration and an ``asyncio.Queue`` future, which
would about double the round trip every flight pays once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

_STOP = object()

#: How long a thread that runs Python keeps the GIL from one waiting for it (``sys.setswitchinterval``): a
#: worker woken for its next item, or back from a kernel that released the GIL, waits at most this long for
#: the event loop's Python (streaming a landed flight's tokens) instead of the interpreter's default 5 ms.
GIL_SWITCH_INTERVAL_S = 0.0005


def hand_over_the_gil_promptly() -> None:
    """Set the process's GIL switch interval to :data:`GIL_SWITCH_INTERVAL_S`, for serving with workers."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


class Worker:
    """One thread, one ordered queue of work (and an event loop for async work, on that thread)."""

    def __init__(self, name: str = "worker") -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop async work runs on (on the worker's thread, only while such work runs)."""
        return self._loop

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            while (item := self._queue.get()) is not _STOP:
                self._run(*item)
                # Nothing of the finished work stays referenced while the thread waits: its objects (a flight's
                # tensors) are freed here, not by this daemon thread as the interpreter shuts down, where a
                # tensor's release that waits for the GIL ends the thread inside C++ code and aborts the process.
                del item
        finally:
            self._loop.close()

    def _run(self, future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
            if inspect.isawaitable(result):
                result = self._loop.run_until_complete(result)
        except BaseException as exc:  # handed to the caller
            future.set_exception(exc)
        else:
            future.set_result(result)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queue ``fn(*args)`` on this worker; thread-safe."""
        if self._closed:
            raise RuntimeError(f"worker {self.name!r} is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on this worker and await its result from the caller's loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop after the work already queued; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __repr__(self) -> str:
        return f"Worker({self.name!r}, alive={self._thread.is_alive()})"
