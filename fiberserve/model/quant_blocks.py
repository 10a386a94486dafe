"""Matrices in llama.cpp's blocks of 32 inputs, the form the quantized products take: ``w = scale * q + min``.

Two kinds of block, by the bits of ``q``:

* 4 bits (``q`` in 0..15, any ``min``): llama.cpp's Q4_1, and Q4_0 (``w = d * (q - 8)``, so ``min = -8 d``);
* 8 bits (``q`` in 0..255 with ``min = -128 scale``): llama.cpp's Q8_0 (its signed q stored as q + 128),
  Q5_0 (``w = d * (q - 16)`` with q in 0..31, stored as q + 112), and IQ4_NL (``w = d * table[q]``, its 4-bit
  index looked up in llama.cpp's table of 16 int8 values, stored as table[q] + 128).

Scales and mins hold float16 values (as the files store them), so a file in one of these formats is served in its
own blocks (:meth:`QuantBlocks.from_gguf`) and its weights are exactly what llama.cpp reads; any other matrix is
quantized to Q4_1 or Q8_0 blocks from its values (:meth:`QuantBlocks.quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: Input features per block (llama.cpp's block size).
QUANT_GROUP = 32

#: The GGUF block formats served in their own blocks, and the bits of their ``q`` here.
NATIVE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 8, "Q8_0": 8, "IQ4_NL": 8}

#: IQ4_NL's values for its 4-bit indices (llama.cpp's ``kvalues_iq4nl``).
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)


@dataclass
class QuantBlocks:
    """A matrix [N, K] as blocks of :data:`QUANT_GROUP` inputs; ``zero``, where the format has one, makes
    :meth:`dequantize` compute ``scale * (q - zero)``, the file's own arithmetic, rather than ``scale * q + min``."""

    q: torch.Tensor  #: uint8 [N, K]
    scale: torch.Tensor  #: float32 [N, K / 32], float16 values
    min: torch.Tensor  #: float32 [N, K / 32], float16 values (``-zero * scale`` where there is a zero)
    bits: int  #: 4 or 8
    zero: int | None = None

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
        """The blocks of a GGUF tensor of a :data:`NATIVE_BITS` format; ``raw`` uint8 [N, bytes per row]."""
        n = raw.shape[0]
        sizes = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "IQ4_NL": 18}
        blocks = np.ascontiguousarray(raw).reshape(n, -1, sizes[type_name])
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        if type_name == "Q8_0":
            q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
            return cls._of(q, d, -128 * d, 8, 128)
        if type_name == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            return cls._of(_nibbles(blocks[..., 4:]), d, m, 4, None)
        if type_name == "Q4_0":
            return cls._of(_nibbles(blocks[..., 2:]), d, -8 * d, 4, 8)
        if type_name == "IQ4_NL":
            return cls._of(IQ4_NL_VALUES[_nibbles(blocks[..., 2:])] + 128, d, -128 * d, 8, 128)
        if type_name == "Q5_0":
            high = blocks[..., 2:6].copy().view(np.uint32)  # bit j: the fifth bit of element j
            fifth = (high >> np.arange(QUANT_GROUP, dtype=np.uint32)) & 1
            q = _nibbles(blocks[..., 6:]).astype(np.int16) | (fifth.astype(np.int16) << 4)
            return cls._of(q + 112, d, -128 * d, 8, 128)  # d * (q - 16) == d * ((q + 112) - 128)
        raise ValueError(f"{type_name} is not served in its own blocks")

    @classmethod
    def _of(cls, q: np.ndarray, d: np.ndarray, m: np.ndarray, bits: int, zero: int | None) -> QuantBlocks:
        n = q.shape[0]
        return cls(
            torch.from_numpy(q.astype(np.uint8).reshape(n, -1)),
            torch.from_numpy(np.ascontiguousarray(d)),
            torch.from_numpy(np.ascontiguousarray(m.astype(np.float32))),
            bits,
            zero,
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix, computed as llama.cpp computes it for the format."""
        q = self.q.float().view(self.q.shape[0], -1, QUANT_GROUP)
        if self.zero is not None:
            w = self.scale[..., None] * (q - self.zero)
        else:
            w = self.scale[..., None] * q + self.min[..., None]
        return w.view(self.q.shape)

    def map_rows(self, fn) -> QuantBlocks:
        """The blocks with ``fn`` applied to the rows of ``q``, ``scale`` and ``min`` alike (a permutation, a
        slice): a row's blocks stay whole."""
        return QuantBlocks(fn(self.q), fn(self.scale), fn(self.min), self.bits, self.zero)

    @staticmethod
    def cat(parts: list[QuantBlocks]) -> QuantBlocks | None:
        """The rows of ``parts`` one after another; None where their bits differ."""
        first = parts[0]
        if any(p.bits != first.bits for p in parts):
            return None
        zero = first.zero if all(p.zero == first.zero for p in parts) else None
        return QuantBlocks(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.min for p in parts]),
            first.bits,
            zero,
        )


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """llama.cpp's 16 bytes of a 4-bit block as its 32 values: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
