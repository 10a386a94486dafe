"""How long a forward pass takes by its number of rows, learnt from the passes the engine runs.

Speculative decoding spends rows to save passes; whether a draft token pays
depends on what one more row costs next to the pass it rides in, which
differs by batch size, dtype and CPU.  So the scheduler asks this model rather than a constant (SmartSpec's
"goodput" rule, Liu et al. 2024).
"""

from __future__ import annotations

import bisect

#: Weight of a new measurement in a row count's moving average: the VM's speed drifts over minutes.
PASS_TIME_WEIGHT = 0.2

#: An estimate is a straight line through the moving averages of this many row counts seen around the one asked
#: about: one row more or less costs about as much as single averages stray, so a lone neighbour would make a
#: row look free, or dear, by chance.
PASS_TIME_NEIGHBOURS = 4


class PassTimes:
    """Seconds per forward pass by row count: a moving average per row count seen, and between and beyond them
    a line fitted through the ones around (its slope never negative).

    Contract: :meth:`estimate` is positive, and at least the least of the averages it was fitted to; before two
    row counts are seen it is flat (1.0 before any pass): rows look free until measured, so drafting tries them
    and the estimate learns."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self._rows: list[int] = []  #: the keys of ``seconds``, sorted

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        if old is None:
            bisect.insort(self._rows, rows)
            self.seconds[rows] = seconds
        else:
            self.seconds[rows] = old + PASS_TIME_WEIGHT * (seconds - old)

    def estimate(self, rows: int) -> float:
        known = self._rows
        if not known:
            return 1.0
        first = max(
            0, min(bisect.bisect_left(known, rows) - PASS_TIME_NEIGHBOURS // 2, len(known) - PASS_TIME_NEIGHBOURS)
        )
        near = known[first : first + PASS_TIME_NEIGHBOURS]  # the row counts seen around ``rows``
        times = [self.seconds[r] for r in near]
        mean_rows, mean_time = sum(near) / len(near), sum(times) / len(times)
        spread = sum((r - mean_rows) ** 2 for r in near)
        slope = 0.0
        if spread > 0:
            slope = max(0.0, sum((r - mean_rows) * (t - mean_time) for r, t in zip(near, times, strict=True)) / spread)
        return max(mean_time + slope * (rows - mean_rows), min(times))
