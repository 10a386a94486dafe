"""A fiber: an ordered execution lane bound to a worker and a device.

Contract: everything run on a fiber executes on its worker's thread, one item
at a time and in order, so two invocations on one fiber never overlap.  On a
CUDA device the fiber owns a stream and runs its work inside it, so fibers on
one GPU can overlap each other while each stays ordered.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from fiberserve.runtime.worker import Worker

_ids = itertools.count()


def _make_stream(device: str) -> Any:
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.Stream(device=torch.device(device))


class Fiber:
    """An ordered lane: ``await fiber.run(fn, *args)`` runs ``fn`` on the lane's worker."""

    def __init__(self, worker: Worker, device: str = "cpu", name: str | None = None) -> None:
        self.id = next(_ids)
        self.worker = worker
        self.device = device
        self.name = name or f"fiber-{self.id}"
        self.stream = _make_stream(device)
        #: False once an invocation on this fiber hung past its deadline; the
        #: pool retires such a fiber instead of handing it out again.
        self.healthy = True

    def _in_stream(self, fn: Callable[..., Any], args: tuple) -> Any:
        if self.stream is None:
            return fn(*args)
        import torch

        with torch.cuda.stream(self.stream):
            result = fn(*args)
        self.stream.synchronize()
        return result

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on this fiber (on its stream, if any) and return its result."""
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Queue ``fn(*args)`` on this fiber now; the future (of the calling loop) gets its result."""
        return asyncio.wrap_future(self.worker.submit(self._in_stream, fn, args))

    def close(self) -> None:
        """Shut the worker down without waiting (a hung call may still hold it)."""
        self.worker.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"Fiber({self.name!r}, device={self.device!r})"


def new_fiber(device: str = "cpu", name: str | None = None) -> Fiber:
    """A fiber with a worker thread of its own."""
    fid = next(_ids)
    name = name or f"fiber-{fid}"
    return Fiber(Worker(name=name), device=device, name=name)
