"""How many cores other processes leave to this one, so that a fiber's thread team fits the cores actually free.

A thread team wider than the free cores is slower than a narrower one: each parallel region waits for its
slowest thread, and a thread that shares its core with a busy neighbour runs a fraction of the time, so every
region, and the whole step, runs at that fraction.  With the team cut to the free cores the step runs at their
speed instead.
"""

from __future__ import annotations

import os
import time

#: Seconds between two readings: shorter ones are noise (the kernel counts CPU time in ticks of 10 ms).
SAMPLE_INTERVAL_S = 1.0

#: A core counts as taken when other processes used at least this share of one over the last interval.
BUSY_SHARE = 0.5

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_ticks() -> int | None:
    """CPU time spent on every core in anything but idle and I/O wait, in ticks (Linux; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(values) - values[3] - values[4]


def _own_ticks() -> int:
    """This process's CPU time, every thread's, in ticks."""
    times = os.times()
    return round((times.user + times.system) * _TICKS_PER_S)


class FreeCores:
    """The cores of ``cores`` that other processes left free over the last interval, read at most once per
    :data:`SAMPLE_INTERVAL_S` (cheap to ask every step).  Reports ``cores`` where the counters cannot be read."""

    def __init__(self, cores: int) -> None:
        self.cores = cores
        self.free = cores
        self._last: tuple[float, int, int] | None = None

    def __call__(self) -> int:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < SAMPLE_INTERVAL_S:
            return self.free
        machine = _machine_busy_ticks()
        if machine is None:
            return self.free
        own = _own_ticks()
        if self._last is not None:
            then, machine_then, own_then = self._last
            others = (machine - machine_then - (own - own_then)) / _TICKS_PER_S / (now - then)
            taken = int(others + (1 - BUSY_SHARE))  # cores of which others used at least BUSY_SHARE
            self.free = max(1, min(self.cores, self.cores - taken))
        self._last = (now, machine, own)
        return self.free


class ThreadTeams:
    """The thread team each fiber's invocation runs with (at least one thread): ``share`` threads, less a share of
    the threads that invocations which timed out still hold, and at most the cores other processes leave free
    (``fit_free_cores``).

    A timed-out invocation's fiber is retired with its worker possibly still running, its team with it; the
    replacement fiber's team comes out of that team's threads (:meth:`hold` until the call returns, then
    :meth:`release`), so the process keeps to ``share * fibers`` threads.  :meth:`hold` and :meth:`release` run on
    the event loop, the call on the fibers' workers."""

    def __init__(self, share: int, fibers: int, fit_free_cores: bool = False) -> None:
        self.share, self.fibers = share, fibers
        self.free_cores = FreeCores(share) if fit_free_cores else None
        #: Threads held per holder (a retired fiber's name), and their sum, which the workers read.
        self.held: dict[str, int] = {}
        self._held_threads = 0

    def hold(self, holder: str) -> None:
        """``holder``'s team (one share) keeps running outside the pool until :meth:`release`."""
        if holder not in self.held:
            self.held[holder] = self.share
            self._held_threads += self.share

    def release(self, holder: str) -> None:
        self._held_threads -= self.held.pop(holder, 0)

    def __call__(self) -> int:
        team = self.share - -(-self._held_threads // self.fibers)
        if self.free_cores is not None:
            team = min(team, self.free_cores())
        return max(1, team)
