"""What a serving process does before it imports its web framework: logging set up, and the model's load begun.

The load is mostly compiled code that runs without the GIL (unpacking and packing the weights), so begun on a
thread as soon as the CLI knows the model, it runs on one core while the other imports FastAPI, uvicorn and the
routes; the server then waits for it as it waits for any load (``/health`` answers 503 meantime).  This module
imports nothing heavy at its top.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fiberserve.config import EngineConfig
    from fiberserve.engine import LlmService

log = logging.getLogger(__name__)

#: The format of the server's log lines (the access log's too).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """The process's log lines at ``level`` (a name such as "info") in :data:`LOG_FORMAT`; a no-op where the
    process already configured logging."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


class BackgroundLoad:
    """:meth:`.LlmService.load` of a config running on a daemon thread: ``future`` holds the service or the
    load's exception.  The thread must end before the interpreter does (killed at exit inside a kernel, it would
    abort the process), so a server that exits while it loads cancels :meth:`service`."""

    def __init__(self, config: EngineConfig) -> None:
        self.future: Future[LlmService] = Future()
        self._stop = threading.Event()
        threading.Thread(target=self._load, args=(config,), name="fiberserve-load", daemon=True).start()

    def _load(self, config: EngineConfig) -> None:
        self.future.set_running_or_notify_cancel()
        try:
            from fiberserve.engine import LlmService

            self.future.set_result(LlmService.load(config, self._stop))
        except BaseException as exc:  # the server reports it; nothing is raised on this thread
            self.future.set_exception(exc)

    async def service(self) -> LlmService:
        """The loaded service, or the load's exception.  Cancelled (the server exits while it loads), it asks the
        load to stop at its next layer and waits until the thread has ended before it re-raises."""
        import asyncio
        import contextlib

        try:
            return await asyncio.wrap_future(self.future)
        except asyncio.CancelledError:
            self._stop.set()
            with contextlib.suppress(Exception):  # LoadStopped, or the load's own error: the server exits anyway
                await asyncio.wrap_future(self.future)
            log.info("stopped the model's load: the server is exiting")
            raise
