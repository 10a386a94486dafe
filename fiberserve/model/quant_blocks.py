"""Matrices in llama.cpp's blocks of 32 inputs, the form the quantized products take: ``w = scale * q + min``,
with a scale and a min per block or per half block (``group`` inputs).

Kinds of block, by the bits of ``q``:

* 4 bits (``q`` in 0..15, any ``min``): llama.cpp's Q4_1, Q4_0 (``w = d * (q - 8)``, so ``min = -8 d``) and
  Q4_K (a super-block's float16 ``d`` and ``dmin`` times each block's 6-bit scale and min);
* 3 and 2 bits, a scale per 16 inputs: Q3_K (``w = d * scale6 * q`` with q in -4..3, stored as q + 4, ``zero =
  4``) and Q2_K (``w = d * scale4 * q - dmin * min4`` with q in 0..3);
* 8 bits, ``q`` a byte: llama.cpp's Q8_0 (its signed q stored as q + 128, ``zero = 128``), Q5_0 (``w = d * (q -
  16)`` with q in 0..31, stored as q + 112), IQ4_NL (``w = d * table[q]``, its 4-bit index looked up in
  llama.cpp's table of 16 int8 values, stored as table[q] + 128), Q5_1 and Q5_K (5-bit q with a min);
* 6 bits: Q6_K (``w = d * scale8 * (q - 32)`` per 16 inputs, ``zero = 32``).

Scales and mins hold the file's values exactly: float16 values, or float32 where the format multiplies a float16
by a small integer (Q4_K, Q5_K, Q6_K).  The K formats also keep those factors as the file has them
(:class:`SuperScales`: a float16 per super-block of 256 inputs, an integer step per scale group), the form their
products read: 4.6 bits a weight for Q4_K rather than 6 with float32 scales and mins.  A file in one of these
formats is served in its own blocks (:meth:`QuantBlocks.from_gguf`) and its weights are exactly what llama.cpp
reads; any other matrix is quantized to Q4_1 or Q8_0 blocks from its values (:meth:`QuantBlocks.quantize`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from fiberserve.model.block_formats import NATIVE_BITS

#: Input features per block (llama.cpp's block size).
QUANT_GROUP = 32
#: Each format's ``zero`` (where w = scale * (q - zero)) and inputs per scale, as :meth:`QuantBlocks.from_gguf`
#: unpacks it: Q5_0's q is stored as q + 112 and IQ4_NL's as its table value + 128, so both are signed bytes.
_ZEROS_AND_GROUPS = {
    "Q4_0": (8, QUANT_GROUP),
    "Q4_1": (None, QUANT_GROUP),
    "Q5_0": (128, QUANT_GROUP),
    "Q5_1": (None, QUANT_GROUP),
    "Q8_0": (128, QUANT_GROUP),
    "IQ4_NL": (128, QUANT_GROUP),
    "Q2_K": (None, 16),
    "Q3_K": (4, 16),
    "Q4_K": (None, QUANT_GROUP),
    "Q5_K": (None, QUANT_GROUP),
    "Q6_K": (32, 16),
}


@dataclass
class SuperScales:
    """A K format's scales and mins as the file keeps them: per row and super-block a float16 ``d`` (and ``dmin``),
    per scale group an integer step; ``scale = d * step`` and ``min = dmin * min_step`` exactly in float32 (a
    float16 times an integer below 2^8).  Min steps are stored negated (``min = -dmin * m`` in llama.cpp), so both
    products are plain; Q6_K has no mins."""

    d: torch.Tensor  #: float16 [N, K / 256]
    steps: torch.Tensor  #: int8 [N, K / group]
    dmin: torch.Tensor | None = None  #: float16 [N, K / 256]
    min_steps: torch.Tensor | None = None  #: int8 [N, K / 32], negated


#: A function of each field's tensors across parts, giving the combined field (see :meth:`QuantBlocks.combine`).
RowsFn = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass
class QuantBlocks:
    """A matrix [N, K] as blocks of :data:`QUANT_GROUP` inputs with a scale and a min per ``group`` inputs;
    ``zero``, where the format has one, makes :meth:`dequantize` compute ``scale * (q - zero)``, the file's own
    arithmetic, rather than ``scale * q + min``."""

    q: torch.Tensor  #: uint8 [N, K]
    scale: torch.Tensor  #: float32 [N, K / group]
    min: torch.Tensor  #: float32 [N, K / group] (``-zero * scale`` where there is a zero)
    bits: int  #: 2 (Q2_K), 3 (Q3_K), 4, 6 (Q6_K) or 8
    zero: int | None = None
    group: int = QUANT_GROUP  #: inputs per scale: 32, or 16 (Q2_K, Q3_K, Q6_K)
    float32_scales: bool = False  #: whether scales and mins need float32 (else their values are float16)
    supers: SuperScales | None = None  #: a K format's own factors of ``scale`` and ``min``

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @classmethod
    def quantize(cls, weight: torch.Tensor, bits: int) -> QuantBlocks:
        """``weight`` [N, K] (best in float32) in Q4_1 (``bits=4``: q from each block's min and max) or Q8_0
        blocks (``bits=8``: from each block's largest magnitude), built as llama.cpp builds them: for a matrix
        that was such blocks, its own blocks come back."""
        n, k = weight.shape
        if k % QUANT_GROUP:
            raise ValueError(f"quantized weights need input features divisible by {QUANT_GROUP}, got {k}")
        groups = weight.float().view(n, k // QUANT_GROUP, QUANT_GROUP)
        # Scales and mins rounded to float16 first, so that q is chosen against the values the product will use.
        if bits == 4:
            lo, hi = groups.amin(-1).half().float(), groups.amax(-1)
            scale = ((hi - lo) / 15).half().float()
            q = ((groups - lo[..., None]) / torch.where(scale > 0, scale, 1.0)[..., None]).round().clamp(0, 15)
            return cls(q.to(torch.uint8).view(n, k), scale, lo, 4)
        if bits == 8:  # signed q stored as q + 128, so the minimum is -128 steps
            scale = (groups.abs().amax(-1) / 127).half().float()
            q = (groups / torch.where(scale > 0, scale, 1.0)[..., None]).round().clamp(-127, 127) + 128
            return cls(q.to(torch.uint8).view(n, k), scale, -128 * scale, 8, zero=128)
        raise ValueError(f"bits must be 4 or 8, got {bits}")

    @classmethod
    def from_gguf(cls, raw: np.ndarray, type_name: str) -> QuantBlocks:
        """The blocks of a GGUF tensor of a :data:`NATIVE_BITS` format; ``raw`` uint8 [N, bytes per row], unpacked
        by the extension in one pass (``gguf_blocks.cpp``)."""
        from fiberserve import kernels

        if type_name not in NATIVE_BITS:
            raise ValueError(f"{type_name} is not served in its own blocks")
        return cls.of_unpacked(type_name, *kernels.unpack_gguf_blocks(raw, type_name))

    @classmethod
    def of_unpacked(
        cls,
        type_name: str,
        q: torch.Tensor,
        scale: torch.Tensor,
        low: torch.Tensor,
        d: torch.Tensor,
        steps: torch.Tensor,
        dmin: torch.Tensor,
        min_steps: torch.Tensor,
    ) -> QuantBlocks:
        """The blocks of format ``type_name`` from the tensors ``kernels.unpack_gguf_blocks`` gives."""
        zero, group = _ZEROS_AND_GROUPS[type_name]
        blocks = cls(q, scale, low, NATIVE_BITS[type_name], zero, group, float32_scales=type_name.endswith("_K"))
        if not type_name.endswith("_K"):
            return blocks
        if dmin.numel() == 0:  # Q6_K, Q3_K
            return replace(blocks, supers=SuperScales(d, steps))
        return replace(blocks, supers=SuperScales(d, steps, dmin, min_steps))

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix, computed as llama.cpp computes it for the format."""
        q = self.q.float().view(self.q.shape[0], -1, self.group)
        if self.zero is not None:
            w = self.scale[..., None] * (q - self.zero)
        else:
            w = self.scale[..., None] * q + self.min[..., None]
        return w.view(self.q.shape)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantBlocks:
        """The blocks with ``fn`` applied to the rows of every tensor alike (a permutation, a slice, a move): a
        row's blocks stay whole."""
        return QuantBlocks.combine([self], lambda tensors: fn(tensors[0]))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor with a row per output feature, by name (``q``, ``scale``, ``min``, ``supers.d``, ...)."""
        named = {"q": self.q, "scale": self.scale, "min": self.min}
        if self.supers is not None:
            for f in fields(SuperScales):
                if getattr(self.supers, f.name) is not None:
                    named[f"supers.{f.name}"] = getattr(self.supers, f.name)
        return named

    def with_tensors(self, named: dict[str, torch.Tensor]) -> QuantBlocks:
        """These blocks' format with the tensors ``named`` as :meth:`tensors` names them."""
        supers = None
        if self.supers is not None:
            supers = SuperScales(
                named["supers.d"], named["supers.steps"], named.get("supers.dmin"), named.get("supers.min_steps")
            )
        return replace(self, q=named["q"], scale=named["scale"], min=named["min"], supers=supers)

    @staticmethod
    def combine(parts: list[QuantBlocks], fn: RowsFn) -> QuantBlocks:
        """Blocks of ``parts``' format (:meth:`same_format`) whose every row tensor (:meth:`tensors`) is ``fn`` of
        the parts' tensors of that name: a concatenation, an interleaving."""
        named = [p.tensors() for p in parts]
        return parts[0].with_tensors({name: fn([n[name] for n in named]) for name in named[0]})

    def same_format(self, other: QuantBlocks) -> bool:
        return self._format() == other._format()

    def _format(self) -> tuple:
        supers = None if self.supers is None else self.supers.min_steps is None
        return self.bits, self.zero, self.group, self.float32_scales, supers

    @staticmethod
    def alike(parts: list[QuantBlocks]) -> list[QuantBlocks]:
        """``parts`` in one format, each holding the same weights: as they are where they share one; 4-bit blocks
        with their scales and mins in float32 where any needs it; else as bytes with float32 scales and mins per
        the smallest group (any block converts to that exactly).  Super-block factors stay only where all the
        parts share a format."""
        first = parts[0]
        if all(p.same_format(first) for p in parts):
            return parts
        parts = [replace(p, supers=None) for p in parts]
        if all(p.bits == 4 and p.group == QUANT_GROUP for p in parts):
            wide = any(p.float32_scales for p in parts)
            return [replace(p, zero=None, float32_scales=wide) for p in parts]
        group = min(p.group for p in parts)
        return [p.as_bytes(group) for p in parts]

    def as_bytes(self, group: int) -> QuantBlocks:
        """The same weights as bytes with float32 scales and mins per ``group`` inputs (a divisor of this group)."""
        repeat = self.group // group
        scale, low = self.scale.repeat_interleave(repeat, -1), self.min.repeat_interleave(repeat, -1)
        mins = low if self.zero is None else -self.zero * scale
        return QuantBlocks(self.q, scale, mins, 8, None, group, float32_scales=True)

    @staticmethod
    def cat(parts: list[QuantBlocks]) -> QuantBlocks:
        """The rows of ``parts`` one after another, in one format (see :meth:`alike`)."""
        return QuantBlocks.combine(QuantBlocks.alike(parts), torch.cat)
