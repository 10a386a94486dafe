"""A matrix read from the model file a few rows at a time: the token embedding and the head's rows for the exact
re-scoring, with no copy of the whole matrix in memory."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

#: Rows kept dequantized between lookups: consecutive steps look up mostly the same tokens (a batch's candidates).
CACHED_ROWS = 4096


class FileRows:
    """Rows of a matrix [rows, width] stored in the file's blocks, dequantized when indexed.

    ``matrix[index]`` (``index`` an int64 CPU tensor of any shape) is ``index.shape + (width,)`` in ``dtype``: the
    values reading the whole matrix in ``dtype`` would hold (each row dequantized as its format does, rounded
    once).  The distinct rows read lately stay dequantized in a table of at least :data:`CACHED_ROWS` rows (emptied
    whole when full), so a lookup reads from the file only the rows it has not met lately; :meth:`table_rows` hands
    the table and the rows' places in it to a kernel without gathering them.  The file stays mapped, and only the
    pages of the rows read are touched.  Lookups from several threads take turns (the table is shared)."""

    def __init__(self, read: Callable[[np.ndarray], torch.Tensor], rows: int, width: int, dtype: torch.dtype) -> None:
        self._read, self.dtype = read, dtype
        self._slot_of = np.full(rows, -1, dtype=np.int64)  #: each row's place in the table, -1 where none
        self._table = torch.empty(CACHED_ROWS, width, dtype=dtype)
        self._used = 0  #: places filled, from the first
        self._lock = threading.Lock()

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        table, places = self.table_rows(index)
        return table[places]

    def table_rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The table and each of ``index``'s rows' places in it (int64, ``index``'s shape): ``table[places]`` is
        ``self[index]``.  The table is valid until the next lookup."""
        with self._lock, torch.inference_mode():  # the table may have been made in inference mode
            distinct, where = np.unique(index.numpy().reshape(-1), return_inverse=True)
            places = torch.from_numpy(self._places(distinct)[where].reshape(index.shape))
            return self._table, places  # the table after the lookup: it may have grown for it

    def _places(self, distinct: np.ndarray) -> np.ndarray:
        """The table places of the ``distinct`` rows, the missing ones read from the file first."""
        places = self._slot_of[distinct]
        missing = np.flatnonzero(places < 0)
        if not len(missing):
            return places
        if self._used + len(missing) > len(self._table):  # full: start again, empty (larger, where one lookup needs it)
            self._slot_of[:] = -1
            if len(distinct) > len(self._table):
                self._table = torch.empty(len(distinct), self._table.shape[1], dtype=self.dtype)
            self._used, places, missing = 0, np.full_like(places, -1), np.arange(len(distinct))
        new = np.arange(self._used, self._used + len(missing))
        self._table[torch.from_numpy(new)] = self._read(distinct[missing]).to(self.dtype)
        self._slot_of[distinct[missing]] = new
        places[missing] = new
        self._used += len(missing)
        return places
