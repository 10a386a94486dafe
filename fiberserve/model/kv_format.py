"""How the KV cache stores keys and values (``--kv-cache-dtype``): the Python side of ``kernels/csrc/kv_rows.h``,
bit for bit.

A cache tensor's dtype names its format: the model's dtype, ``float8_e4m3fn`` (fp8_e4m3: each value rounded to
float8 e4m3, saturated to +-448, no scale, as vLLM's fp8 cache without calibrated scales), or ``int8`` (q8_0, as
llama.cpp's ``-ctk/-ctv q8_0``: a head's row is ``head_dim`` int8 values, then one float16 scale per block of 32,
``scale = float16(max |x| / 127)`` and ``q = round(x / scale)``).  Rows are quantized from the model-dtype row the
unquantized cache would hold, when a token's K/V is written; every dequantized value is exact in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fiberserve.config import KV_CACHE_DTYPES

#: q8_0: values per float16 scale.
Q8_BLOCK = 32
#: The largest finite float8 e4m3fn; larger magnitudes are stored as it.
FP8_MAX = 448.0


@dataclass(frozen=True)
class KvFormat:
    """One storage format of the KV cache's rows."""

    name: str  #: the ``--kv-cache-dtype`` value it answers to (auto resolved)
    storage: torch.dtype  #: the cache tensor's dtype

    def row_width(self, head_dim: int) -> int:
        """Elements of the cache tensor that one head's row of ``head_dim`` values takes; a ValueError naming the
        flag where the format cannot store such rows."""
        if self.storage != torch.int8:
            return head_dim
        if head_dim % Q8_BLOCK:
            raise ValueError(
                f"--kv-cache-dtype q8_0 needs head_dim a multiple of {Q8_BLOCK}; this model's is {head_dim}"
            )
        return head_dim + head_dim // Q8_BLOCK * 2

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * torch.empty((), dtype=self.storage).element_size()

    def quantize(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [..., head_dim] in the model's dtype as this format stores them, [..., row_width]."""
        if self.storage == torch.float8_e4m3fn:
            return rows.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if self.storage != torch.int8:
            return rows.to(self.storage)
        blocks = rows.float().unflatten(-1, (-1, Q8_BLOCK))
        scales = (blocks.abs().amax(-1, keepdim=True) / 127.0).half()
        step = scales.float()
        values = torch.where(step == 0, 0.0, blocks / step).round_().clamp_(-127, 127).to(torch.int8)
        return torch.cat([values.flatten(-2), scales.flatten(-2).view(torch.int8)], -1)


def kv_format(name: str, model_dtype: torch.dtype) -> KvFormat:
    """The format ``--kv-cache-dtype name`` stores for a model computing in ``model_dtype``; a ValueError naming the
    flag where the two do not go together."""
    if name == "auto":
        return KvFormat("auto", model_dtype)
    if name == "bf16":
        if model_dtype != torch.bfloat16:
            raise ValueError(f"--kv-cache-dtype bf16 needs a bfloat16 model; this one computes in {model_dtype}")
        return KvFormat(name, torch.bfloat16)
    if name == "fp8_e4m3":
        return KvFormat(name, torch.float8_e4m3fn)
    if name == "q8_0":
        return KvFormat(name, torch.int8)
    raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def dequantize(stored: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row_width] (any format, told by their dtype) as values [..., head_dim] in ``dtype``."""
    if stored.dtype != torch.int8:
        return stored.to(dtype)
    values = stored[..., :head_dim].float().unflatten(-1, (-1, Q8_BLOCK))
    scales = stored[..., head_dim:].contiguous().view(torch.float16).float().unsqueeze(-1)
    return (values * scales).flatten(-2).to(dtype)
