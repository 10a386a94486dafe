"""Fault injection for tests: make some model invocations fail or hang, on purpose.

Off unless ``--fault-rate`` is set.  The injector is shared by every fiber's
program instance and may be retuned while serving (the server exposes
``POST /debug/faults`` only when it was started with a fault rate).

Faults are evenly spaced rather than random: at rate ``r`` the invocations
whose count crosses a multiple of ``1 / r`` fail (at 0.2: the 5th, 10th, ...),
so a test that makes enough invocations always sees a fault (however few
invocations a fast engine needs), and a run can be reproduced.

A fault fires at one of two points of a step (``point``): at its start, before
its batch is built, or as its decoder layers start, once the slots its K/V
goes to are chosen and before any is written: a hang there writes that K/V
after the invocation's deadline, into pages the engine must keep from others.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field


class FaultPoint(enum.Enum):
    START = "start"  #: before the step's batch is built
    LAYERS = "layers"  #: as the decoder layers start, before any K/V of the step is written


class InjectedFault(RuntimeError):
    """A model invocation failed on purpose (``--fault-rate``)."""


@dataclass
class FaultInjector:
    rate: float = 0.0
    #: When > 0, a chosen step sleeps this long (or until ``release_hangs``), then goes on, instead of raising
    #: (exercises --invocation-timeout).
    hang_seconds: float = 0.0
    #: Where in a step the fault fires.
    point: FaultPoint = FaultPoint.START
    #: Invocations seen while the rate was non-zero, and how many of them were made to fail.
    calls: int = 0
    injected: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _release: threading.Event = field(default_factory=threading.Event, repr=False)

    def release_hangs(self) -> None:
        """Ends every hang now under way (each then goes on as if its time were up); later hangs wait again."""
        with self._lock:
            release, self._release = self._release, threading.Event()
        release.set()

    def maybe_fail(self, point: FaultPoint) -> None:
        """Called at both points of every step, on the fiber's worker thread; counts and fires at ``self.point``."""
        if not self.rate or point is not self.point:
            return
        with self._lock:
            self.calls += 1
            fire = int(self.calls * self.rate) > int((self.calls - 1) * self.rate)
            if fire:
                self.injected += 1
            release = self._release
        if not fire:
            return
        if self.hang_seconds:
            release.wait(self.hang_seconds)
            return
        raise InjectedFault("injected model fault (--fault-rate)")
