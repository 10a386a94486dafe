"""Fault injection for tests: make some model invocations fail or hang, on purpose.

Off unless ``--fault-rate`` is set.  The injector is shared by every fiber's
program instance and may be retuned while serving (the server exposes
``POST /debug/faults`` only when it was started with a fault rate).

Faults are evenly spaced rather than random: at rate ``r`` the invocations
whose count crosses a multiple of ``1 / r`` fail (at 0.2: the 5th, 10th, ...),
so a test that makes enough invocations always sees a fault (however few
invocations a fast engine needs), and a run can be reproduced.
"""

from __future__ import annotations

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
    #: Invocations seen while the rate was non-zero, and how many of them were made to fail.
    calls: int = 0
    injected: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def maybe_fail(self) -> None:
        """Called at the start of every invocation, on the fiber's worker thread."""
        if not self.rate:
            return
        with self._lock:
            self.calls += 1
            fire = int(self.calls * self.rate) > int((self.calls - 1) * self.rate)
            if fire:
                self.injected += 1
        if not fire:
            return
        if self.hang_seconds:
            time.sleep(self.hang_seconds)
            return
        raise InjectedFault("injected model fault (--fault-rate)")
