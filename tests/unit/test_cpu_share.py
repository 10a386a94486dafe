"""Fitting a fiber's thread team to the cores other processes leave free (no model)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fiberserve.runtime import cpu_share
from fiberserve.runtime.cpu_share import SAMPLE_INTERVAL_S, FreeCores, ThreadTeams


def test_free_cores_follow_what_other_processes_use(monkeypatch):
    clock, machine, own = [100.0], [0], [0]
    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cpu_share, "_machine_busy_ticks", lambda: machine[0])
    monkeypatch.setattr(cpu_share, "_own_ticks", lambda: own[0])
    ticks = cpu_share._TICKS_PER_S
    free = FreeCores(4)
    assert free() == 4  # nothing measured yet

    def interval(others: float, ours: float) -> int:
        clock[0] += SAMPLE_INTERVAL_S
        machine[0] += round((others + ours) * ticks * SAMPLE_INTERVAL_S)
        own[0] += round(ours * ticks * SAMPLE_INTERVAL_S)
        return free()

    assert interval(others=0.0, ours=4.0) == 4  # our own work never counts against us
    assert interval(others=1.0, ours=3.0) == 3  # a busy neighbour takes a core
    assert interval(others=0.4, ours=3.0) == 4  # a light one does not
    assert interval(others=2.6, ours=1.0) == 1  # three cores' worth taken (one at 60%)
    assert interval(others=9.0, ours=0.0) == 1  # never fewer than one
    clock[0] += SAMPLE_INTERVAL_S / 2
    assert interval(others=0.0, ours=4.0) == 4  # the cores came back
    clock[0] += SAMPLE_INTERVAL_S / 2
    machine[0] += 10 * ticks
    assert free() == 4  # read at most once per interval: the neighbour is seen at the next reading
    assert interval(others=0.0, ours=1.0) == 1


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux counters")
def test_a_busy_neighbour_process_is_seen():
    cores = os.cpu_count() or 1
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        free = FreeCores(cores)
        free()
        time.sleep(SAMPLE_INTERVAL_S + 0.5)
        assert free() <= max(1, cores - 1)
    finally:
        neighbour.kill()
        neighbour.wait()


def test_thread_teams_give_a_replacement_fiber_what_a_stuck_team_leaves():
    teams = ThreadTeams(share=4, fibers=2)
    assert teams() == 4
    teams.hold("fiber-0")  # a timed-out call's team of 4 still runs: the 8 threads' budget has 4 left for 2 fibers
    assert teams() == 2
    teams.hold("fiber-0")  # one hold per holder
    assert teams() == 2
    teams.hold("fiber-2")
    assert teams() == 1  # at least one thread, whatever is held
    teams.release("fiber-0")
    teams.release("fiber-2")
    teams.release("fiber-2")
    assert teams() == 4 and teams.held == {}
    assert ThreadTeams(share=2, fibers=1)() == 2
