"""Counter-based sampling noise: each draw's noise is a pure function of a key, a position and a token.

A sequence's key comes from its request's seed (or is random) and its index among the request's completions; the
position is that of the token being drawn.  :func:`row_seed` mixes the two into the 64-bit seed of that draw, and
the kernels derive each token's Gumbel noise from it (``kernels/csrc/race.h``).  No generator state is kept, so a
draw does not depend on the batch, on the order of draws, on preemption or on whether the token was drafted.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's output function: a bijection on 64-bit integers whose outputs look independent."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sampling_key(seed: int, index: int) -> int:
    """The noise key of completion ``index`` of a request seeded with ``seed``."""
    return _splitmix64(_splitmix64(seed) ^ index)


def row_seed(key: int, position: int) -> int:
    """The seed of the draw at ``position`` for ``key``, as a signed 64-bit integer (an int64 tensor's element)."""
    seed = _splitmix64(key ^ _splitmix64(position))
    return seed - (1 << 64) if seed >> 63 else seed
