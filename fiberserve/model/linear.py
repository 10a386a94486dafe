"""Linear layers: a bf16 kernel of our own on AVX512-BF16 CPUs, oneDNN with prepacked weights otherwise.

``F.linear`` on a plain ``[out, in]`` weight makes oneDNN reorder the weight
into its blocked layout on every call.  Reordering once at load time
(``mkldnn._reorder_linear_weight``) and calling ``mkldnn._linear_pointwise``
is what ``torch.compile``'s CPU freezing pass does.  On CPUs with AVX512-BF16,
bf16 weights go to :func:`.kernels.bf16_linear` instead (``vdpbf16ps`` tiles of
6 rows x 64 outputs, weights packed once).  Measured on this machine for the
120 decoder products of one SmolLM2-135M step in bf16 (2 threads):

====  ==========  ======================
rows  prepacked   ``bf16_linear``
====  ==========  ======================
2     12.7 ms     7.5 ms
16    14.7 ms     12.1 ms
64    39.4 ms     35.7 ms (381 GFLOP/s)
640   323 ms      323 ms (420 GFLOP/s)
====  ==========  ======================

(``F.linear``, measured earlier: 17.1 / 28.5 / 66.8 ms at 1 / 16 / 64 rows.
``torch.mm`` of 2048^3 bf16 reaches 411 GFLOP/s on this machine the same day:
from ~64 rows on the product runs at the CPU's bf16 rate.)

Batch invariance: ``bf16_linear`` accumulates every output over k in order in
its own lane, so a row has the same bits at any row count.  oneDNN's rows do
not depend on the rows around them from two rows on, but a single row takes a
matrix-vector path that rounds differently (float32: always; bf16: seen on the
1536-wide down projection with the real weights), hence :data:`MIN_ROWS` for
the oneDNN and ``F.linear`` paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fiberserve.model import kernels

#: Fewest rows a product runs with (see module docstring).
MIN_ROWS = 2


def _can_prepack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and torch.backends.mkldnn.is_available()


def _can_use_bf16_kernel(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    kernels.load()
    out_features, in_features = weight.shape
    return kernels.bf16_gemm_available() and out_features % 16 == 0 and in_features % 2 == 0


class Linear:
    """``y = x @ weight.T + bias``, the same for a row alone or among any others.

    bf16 on a CPU with AVX512-BF16: :func:`.kernels.bf16_linear` (its own packed layout; faster than
    oneDNN below ~100 rows, as fast above, and exact per row at any row count).  Otherwise oneDNN with
    a prepacked weight, or ``F.linear`` off CPU.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.bf16_kernel = _can_use_bf16_kernel(weight)
        self.prepacked = not self.bf16_kernel and _can_prepack(weight)
        if self.bf16_kernel:
            self.weight = kernels.bf16_pack(weight)
            self.bias = None if bias is None else bias.float()
        elif self.prepacked:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        """``wide=True`` asks for a float32 result where the kernel gives one unrounded (``bf16_linear``);
        elsewhere the result is in ``x``'s dtype either way."""
        if self.bf16_kernel:
            return kernels.bf16_linear(x, self.weight, self.bias, torch.float32 if wide else x.dtype)
        rows = x.shape[0]
        if rows < MIN_ROWS:
            return self(torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])]))[:rows]
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


#: Input features per int4 quantization group (llama.cpp's Q4_0/Q4_1 block size).
INT4_GROUP = 32


class Int4Linear:
    """Weight-only int4 linear: groups of :data:`INT4_GROUP` input features, each with a scale and a zero.

    Quantization is min/max per group (``w ~ lo + scale * q``, ``q`` in 0..15), which
    is exactly how llama.cpp builds Q4_1 blocks; so for a Q4_1 GGUF it recovers the
    file's own 4-bit values and only the bf16 rounding of scale and zero is new.  The
    product is PyTorch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) with bf16
    activations: reading a quarter of the bf16 bytes, it runs a one-sequence decode
    step's linear layers in 4.4 ms instead of 11 ms, but it is slower than bf16 from
    ~16 rows on (measured: 23 ms at 16 rows, 88 ms at 64).  Its rows are batch
    invariant like :class:`Linear`'s.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = n, k = weight.shape
        if k % INT4_GROUP:
            raise ValueError(f"int4 weights need input features divisible by {INT4_GROUP}, got {k}")
        self.bias = bias
        groups = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
        # The kernel computes (q - 8) * scale + zero.
        self.scales_and_zeros = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous()
        self.scales_and_zeros = self.scales_and_zeros.to(weight.dtype)  # the activations' dtype
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)

    def __call__(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        """The result is in ``x``'s dtype (``wide`` is accepted for :class:`Linear`'s interface)."""
        rows = x.shape[0]
        if rows < MIN_ROWS:
            return self(torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])]))[:rows]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, quantization: str = "none"
) -> Linear | Int4Linear:
    """A :class:`Linear`, or an :class:`Int4Linear` for ``quantization="int4"``."""
    if quantization == "int4":
        return Int4Linear(weight, bias)
    if quantization != "none":
        raise ValueError(f"quantization must be none or int4, got {quantization!r}")
    return Linear(weight, bias)
