"""The pass time model speculative decoding weighs drafts with: averages per row count, lines between them."""

from __future__ import annotations

import pytest

from fiberserve.engine.pass_times import PASS_TIME_WEIGHT, PassTimes


def test_flat_until_two_row_counts_are_seen_then_a_line_through_the_nearest():
    times = PassTimes()
    assert times.estimate(1) == times.estimate(64) == 1.0
    times.observe(4, 0.012)
    assert times.estimate(1) == times.estimate(64) == 0.012  # rows look free until measured
    times.observe(8, 0.020)
    assert times.estimate(6) == pytest.approx(0.016) and times.estimate(12) == pytest.approx(0.028)
    assert times.estimate(1) == 0.012  # never below the least average it was fitted to


def test_a_noisy_neighbour_does_not_make_a_row_look_free():
    times = PassTimes()
    for rows, ms in ((1, 6.0), (2, 8.0), (3, 10.0), (4, 15.0), (5, 12.0), (6, 16.0)):  # 4 and 5 strayed
        times.observe(rows, ms / 1000)
    assert times.estimate(5) - times.estimate(4) > 0.001  # the averages alone say -3 ms
    assert times.estimate(5) == pytest.approx(0.014)  # on the line through 3, 4, 5 and 6 rows: slope 1.5 ms


def test_each_row_count_keeps_a_moving_average():
    times = PassTimes()
    times.observe(4, 0.010)
    times.observe(4, 0.020)
    assert times.seconds[4] == pytest.approx(0.010 + PASS_TIME_WEIGHT * 0.010)
    times.observe(2, 0.030)  # slower with fewer rows (a slow spell): the line's slope is clamped at zero
    assert times.estimate(3) == pytest.approx((0.012 + 0.030) / 2)
