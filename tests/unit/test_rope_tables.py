"""RoPE tables grown with the positions met: the same values as tables built whole, never short."""

from __future__ import annotations

import threading

import torch

from fiberserve.model.rope_tables import FIRST_POSITIONS, RopeTables


def inverse_frequencies(head_dim: int = 64, theta: float = 500000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def test_tables_start_small_and_double_up_to_the_context_with_the_same_values():
    context = 3 * FIRST_POSITIONS + 5
    grown = RopeTables(inverse_frequencies(), inverse_frequencies(theta=10000.0), context, "cpu")
    assert grown.positions == FIRST_POSITIONS and grown.cos.shape == (FIRST_POSITIONS, 64)
    first = grown.cos, grown.sin
    grown.ensure(FIRST_POSITIONS + 1)
    assert grown.positions == 2 * FIRST_POSITIONS
    grown.ensure(10 * context)
    assert grown.positions == context and grown.local_cos.shape == (context, 64)
    whole = RopeTables(inverse_frequencies(), inverse_frequencies(theta=10000.0), context, "cpu")
    whole.ensure(context)
    assert torch.equal(grown.cos[:FIRST_POSITIONS], first[0]) and torch.equal(grown.sin[:FIRST_POSITIONS], first[1])
    for name in ("cos", "sin", "local_cos", "local_sin"):
        assert torch.equal(getattr(grown, name), getattr(whole, name))
    assert not torch.equal(grown.cos, grown.local_cos)  # the sliding-window layers' own base


def test_a_short_context_is_built_whole_and_threads_growing_at_once_agree():
    short = RopeTables(inverse_frequencies(), None, 100, "cpu")
    assert short.positions == 100 and short.local_cos is short.cos and not short.has_local
    tables = RopeTables(inverse_frequencies(), None, 8 * FIRST_POSITIONS, "cpu")
    threads = [threading.Thread(target=tables.ensure, args=(n,)) for n in (5000, 20000, 9000, 30000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tables.positions == 8 * FIRST_POSITIONS and tables.cos.shape[0] == tables.positions
