"""Fault injection for tests: make some model invocations fail or hang, on purpose.

Off unless ``--fault-rate`` is set.  The injector is shared by every fiber's
program instance and may be retuned while serving (the server exposes
``POST /debug/faults`` only when it was started with a fault rate).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field


class InjectedFault(RuntimeError):
    """A model invocation failed on purpose (``--fault-rate``)."""


@dataclass
class FaultInjector:
    rate: float = 0.0
    #: When > 0, a chosen invocation sleeps this long instead of raising (exercises --invocation-timeout).
    hang_seconds: float = 0.0
    seed: int | None = None
    injected: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.seed is not None:
            self._rng.seed(self.seed)

    def maybe_fail(self) -> None:
        """Called at the start of every invocation, on the fiber's worker thread."""
        if not self.rate:
            return
        with self._lock:
            fire = self._rng.random() < self.rate
            if fire:
                self.injected += 1
        if not fire:
            return
        if self.hang_seconds:
            time.sleep(self.hang_seconds)
            return
        raise InjectedFault("injected model fault (--fault-rate)")
