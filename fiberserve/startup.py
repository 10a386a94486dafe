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

#: The format of the server's log lines (the access log's too).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """The process's log lines at ``level`` (a name such as "info") in :data:`LOG_FORMAT`; a no-op where the
    process already configured logging."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def load_in_background(config: EngineConfig) -> Future[LlmService]:
    """:meth:`.LlmService.load` of ``config`` begun on a daemon thread; the future holds the service or the
    load's exception."""
    loaded: Future[LlmService] = Future()

    def load() -> None:
        if not loaded.set_running_or_notify_cancel():
            return
        try:
            from fiberserve.engine import LlmService

            loaded.set_result(LlmService.load(config))
        except BaseException as exc:  # the server reports it; nothing is raised on this thread
            loaded.set_exception(exc)

    threading.Thread(target=load, name="fiberserve-load", daemon=True).start()
    return loaded
