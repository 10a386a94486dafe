"""A GGUF matrix's rows as the file stores them, before they are unpacked into :class:`.QuantBlocks`.

Each row of a block format holds its own blocks whole, so rows can be reordered (llama.cpp's q/k permutation
undone), joined (q, k and v into one product) and interleaved (gate and up) as the file's bytes, at the format's
bits a weight, and unpacked once in their final order: where the unpacked form takes a byte a weight and its scales
in float32, every such pass on it costs two to four times the bytes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fiberserve.model.quant_blocks import QuantBlocks

#: Rows packed at a time: the float32 scales and mins unpacking writes, and the file's pages it maps, stay those of
#: a few thousand rows however many a matrix has (a vocabulary's head: 128k).
ROWS_AT_ONCE = 4096


def _no_release() -> None:
    return None


@dataclass
class GgufRows:
    """Rows of one GGUF block format: ``raw`` uint8 [N, bytes per row], a view of the file's mapping or memory of
    its own.  ``release`` drops the mapped pages; it runs once the rows have been read into memory of their own
    (by :meth:`map_rows`, :meth:`combine` or :meth:`unpack`)."""

    raw: np.ndarray
    type_name: str
    release: Callable[[], None] = field(default=_no_release, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        import gguf

        inputs, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.type_name]]
        return self.raw.shape[0], self.raw.shape[1] // nbytes * inputs

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def same_format(self, other: GgufRows) -> bool:
        return self.type_name == other.type_name

    def unpack(self) -> QuantBlocks:
        """The blocks, as :meth:`.QuantBlocks.from_gguf` unpacks them."""
        blocks = QuantBlocks.from_gguf(self.raw, self.type_name)
        self._done_reading()
        return blocks

    def pack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``kernels.quant_pack(self.unpack())`` (rows a multiple of 16), in passes of :data:`ROWS_AT_ONCE` rows
        over the file's bytes that never hold a byte a weight, nor the float32 scales and mins of more rows."""
        from fiberserve import kernels

        rows = self.raw.shape[0]
        packed: torch.Tensor | None = None
        scales, mins = [], []
        for start in range(0, rows, ROWS_AT_ONCE):
            stop = min(start + ROWS_AT_ONCE, rows)
            into = None if packed is None else packed[start // 16 : stop // 16]
            q, *factors = kernels.pack_gguf_blocks(self.raw[start:stop], self.type_name, into)
            if packed is None and stop < rows:  # the first part's shape tells the whole's
                packed = q.new_empty((rows // 16, *q.shape[1:]))
                packed[: stop // 16] = q
            elif packed is None:
                packed = q
            self.release()  # the pages read so far
            no_q = torch.empty((stop - start, 0), dtype=torch.uint8)
            part_scales, part_mins = kernels.quant_pack_factors(QuantBlocks.of_unpacked(self.type_name, no_q, *factors))
            scales.append(part_scales)
            mins.append(part_mins)
        self._done_reading()
        assert packed is not None, "a matrix has rows"
        return packed, torch.cat(scales), torch.cat(mins)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GgufRows:
        """These rows with ``fn`` applied to ``raw`` as a tensor (a permutation, a slice): a row's bytes stay whole."""
        return GgufRows.combine([self], lambda tensors: fn(tensors[0]))

    @staticmethod
    def combine(parts: list[GgufRows], fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> GgufRows:
        """Rows of ``parts``' one format that are ``fn`` of their ``raw`` tensors: a concatenation, an
        interleaving.  The result is memory of its own unless ``fn`` returns a part's own bytes."""
        if any(not p.same_format(parts[0]) for p in parts):
            raise ValueError(f"rows of different formats: {sorted({p.type_name for p in parts})}")
        out = fn([p.tensor() for p in parts]).contiguous().numpy()
        if any(np.may_share_memory(out, p.raw) for p in parts):
            return GgufRows(out, parts[0].type_name, parts[0].release if len(parts) == 1 else _no_release)
        for p in parts:
            p._done_reading()
        return GgufRows(out, parts[0].type_name)

    @staticmethod
    def cat(parts: list[GgufRows]) -> GgufRows:
        """The rows of ``parts`` (one format) one after another."""
        return GgufRows.combine(parts, torch.cat)

    def tensor(self) -> torch.Tensor:
        """``raw`` as a tensor sharing its memory (read only, where it is the file's mapping)."""
        with warnings.catch_warnings():  # a read-only mapping: nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self.raw)

    def _done_reading(self) -> None:
        self.release()
        self.release = _no_release
