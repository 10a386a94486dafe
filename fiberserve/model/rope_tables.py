"""RoPE's cos and sin tables, grown to the positions a model has met rather than built for its whole context."""

from __future__ import annotations

import threading

import torch

#: Positions the tables start with; they double from there as longer sequences come, up to the model's context.
FIRST_POSITIONS = 4096


class RopeTables:
    """cos and sin [positions, head_dim] for rotate-half RoPE, the signs of its first half folded into sin; and
    the sliding-window layers' own (``local_cos``, ``local_sin``) where their base differs (Gemma 3), else the
    same tensors.  Each entry depends only on its position, so a grown table holds the smaller one's values.
    :meth:`ensure` may run on several threads at once; readers keep whichever tables they read, which cover what
    they ensured."""

    def __init__(self, inv_freq: torch.Tensor, local_inv_freq: torch.Tensor | None, context: int, device) -> None:
        self._inv_freq, self._local_inv_freq, self.context, self.device = inv_freq, local_inv_freq, context, device
        self._lock = threading.Lock()
        self.positions = 0
        self.ensure(min(context, FIRST_POSITIONS))

    @property
    def has_local(self) -> bool:
        return self._local_inv_freq is not None

    def ensure(self, positions: int) -> None:
        """Tables for at least ``positions`` positions (at most the context): grown by doubling where short."""
        if positions <= self.positions:
            return
        with self._lock:
            size = max(self.positions, 1)
            while size < min(positions, self.context):
                size *= 2
            size = min(max(size, positions), self.context)
            if size <= self.positions:
                return
            self.cos, self.sin = self._tables(self._inv_freq, size)
            self.local_cos, self.local_sin = self.cos, self.sin
            if self._local_inv_freq is not None:
                self.local_cos, self.local_sin = self._tables(self._local_inv_freq, size)
            self.positions = size

    def _tables(self, inv_freq: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(size, device=self.device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq.to(self.device))
        return angles.cos().repeat(1, 2), torch.cat([-angles.sin(), angles.sin()], dim=1)
