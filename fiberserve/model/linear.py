"""Linear layers: a bf16 kernel of our own on AMX, AVX512-BF16 and AVX2 CPUs, oneDNN with prepacked weights otherwise.

``F.linear`` on a plain ``[out, in]`` weight makes oneDNN reorder the weight into its blocked layout on every
call; reordering once at load time (``mkldnn._reorder_linear_weight``) and calling
``mkldnn._linear_pointwise`` is what ``torch.compile``'s CPU freezing pass does, and it is the fallback here.
Where the CPU allows, bf16 weights go to :func:`.kernels.bf16_linear` instead, weights packed once:

* AVX512-BF16: ``vdpbf16ps`` tiles of 6 rows x 64 outputs;
* AMX: the same packed weights on the tile unit's ``tdpbf16ps`` (``tiles/linear_bf16_amx.h``); every row count takes
  the tile path, and since AMX rounds its sums otherwise a process never mixes the two;
* AVX2 and FMA: ``vdpbf16ps``'s arithmetic as multiply-adds (``tiles/linear_bf16_avx2.h``), so bf16 weights still
  read half the bytes of float32 ones.

Batch invariance: ``bf16_linear`` accumulates every output over k in order in its own lane, so a row has the
same bits at any row count.  oneDNN's rows do not depend on the rows around them from two rows on, but a single
row takes a matrix-vector path that rounds differently, hence :data:`MIN_ROWS` for the oneDNN and ``F.linear``
paths.  Where each path's time goes: ``docs/performance.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fiberserve import kernels
from fiberserve.model.gguf_rows import GgufRows
from fiberserve.model.quant_blocks import QUANT_GROUP, QuantBlocks

#: A matrix as the loader gives it: floats, blocks, or a GGUF file's rows not yet unpacked.
Weight = torch.Tensor | QuantBlocks | GgufRows


def unpacked(weight: QuantBlocks | GgufRows) -> QuantBlocks:
    """``weight``'s blocks, unpacked where they are still the file's rows."""
    return weight.unpack() if isinstance(weight, GgufRows) else weight


#: Fewest rows a product runs with (see module docstring).
MIN_ROWS = 2

#: A product's tensors as :func:`.kernels.decoder_layers` takes them: weight, scales, mins, bias.
KernelTensors = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
#: A head's candidates for :func:`.kernels.refined_race`: values, indices, race values, race indices [R, k].
RaceCandidates = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked products take bf16 weights only where the CPU has the instructions for them
    (AVX512-BW/VL/DQ or AVX-NE-CONVERT); elsewhere bf16 runs on ``F.linear``."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _can_use_bf16_kernel(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    kernels.load()
    out_features, in_features = weight.shape
    return kernels.bf16_gemm_available() and out_features % 16 == 0 and in_features % 2 == 0


class Linear:
    """``y = x @ weight.T + bias``, the same for a row alone or among any others.

    bf16 on a CPU with AMX, AVX512-BF16 or AVX2: :func:`.kernels.bf16_linear` (its own packed layout; faster
    than oneDNN below ~100 rows, as fast above, and exact per row at any row count).  Otherwise oneDNN with
    a prepacked weight, or ``F.linear`` off CPU.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.bf16_kernel = _can_use_bf16_kernel(weight)
        self.prepacked = not self.bf16_kernel and _can_prepack(weight)
        #: Fewest rows worth passing (see :data:`MIN_ROWS`); callers may pad once for all layers.
        self.min_rows = 1 if self.bf16_kernel else MIN_ROWS
        if self.bf16_kernel:
            self.weight = kernels.bf16_pack(weight)
            self.bias = None if bias is None else bias.float()
        elif self.prepacked:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        else:
            self.weight = weight

    def kernel_tensors(self) -> KernelTensors | None:
        """(weight, scales, mins, bias) for :func:`.kernels.decoder_layers` if the product runs on the
        extension's ``bf16_linear`` (no scales or mins), else None."""
        return (self.weight, None, None, self.bias) if self.bf16_kernel else None

    def race(
        self, x: torch.Tensor, k: int, inv_temperature: torch.Tensor, seeds: torch.Tensor
    ) -> RaceCandidates | None:
        """Each row's ``k`` largest outputs of the float32 product (as :func:`.kernels.top_k_rows` would pick them)
        and its ``k`` best race entries, without writing the product (:func:`.kernels.bf16_linear_race`, no
        bias); None elsewhere."""
        if not self.bf16_kernel or self.bias is not None:
            return None
        return kernels.bf16_linear_race(x, self.weight, k, inv_temperature, seeds)

    def __call__(self, x: torch.Tensor, wide: bool = False, gated: bool = False) -> torch.Tensor:
        """``wide=True`` asks for a float32 result where the kernel gives one unrounded (``bf16_linear``);
        elsewhere the result is in ``x``'s dtype either way.  ``gated=True`` (``bf16_linear`` only): see
        :class:`GateUp`."""
        if self.bf16_kernel:
            return kernels.bf16_linear(x, self.weight, self.bias, torch.float32 if wide else x.dtype, gated)
        if gated:
            raise ValueError("gated products run on the bf16_linear kernel only")
        rows = x.shape[0]
        if rows < MIN_ROWS:
            return self(torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])]))[:rows]
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class QuantLinear:
    """Weights in blocks of 32 input features, ``w = scale * q + min`` per block or half block
    (:class:`.QuantBlocks`: a file's own blocks of a served format, or blocks quantized from float weights).
    Products:

    * on CPUs with AVX512-VNNI, :func:`.kernels.quant_linear`, llama.cpp's block formats x int8
      arithmetic: each row of ``x`` is quantized per block of 32 to int8, and the integer dot products run
      on ``vpdpbusd`` (the block scaling shares its issue slots, so the gain over bf16 is below VNNI's 2x);
    * on CPUs with AVX2 but no AVX512-VNNI, the same kernel with ``vpmaddubsw`` / ``vpmaddwd`` in place of
      ``vpdpbusd`` (``tiles/linear_quant_avx2.h``; the same bits);
    * elsewhere (4 bits only) PyTorch's weight-only int4 kernel (``_weight_int4pack_mm_for_cpu``, activations
      in their dtype), which is fast at one row and slow at many.

    Both compute each row on its own, so rows are batch invariant like :class:`Linear`'s.
    """

    def __init__(
        self,
        weight: Weight,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        bits: int = 4,
    ) -> None:
        """``weight``: blocks, or a float matrix [out, in] (best float32) quantized to ``bits`` (Q4_1 or Q8_0
        blocks); ``dtype``: the activations' dtype (default: a float weight's, else bfloat16).  Without the
        extension's kernel (:func:`quant_kernel_available`) 8-bit blocks are requantized to 4 bits, and a float
        weight cannot be asked for in 8."""
        dtype = dtype or (weight.dtype if isinstance(weight, torch.Tensor) else torch.bfloat16)
        self.out_features, self.in_features = n, _ = weight.shape
        self.native = weight.device.type == "cpu" and n % 16 == 0 and quant_kernel_available()
        self.min_rows = 1 if self.native else MIN_ROWS
        if self.native:  # a file's rows are packed straight from its bytes
            packed = weight.pack() if isinstance(weight, GgufRows) else kernels.quant_pack(_blocks_of(weight, bits))
            self.weight, self.scales, self.mins = packed
            self.bias = None if bias is None else bias.float()
            return
        blocks = _blocks_of(weight, bits)
        if blocks.bits == 4 or bits == 4:  # PyTorch's int4 kernel takes 4-bit blocks only
            if blocks.bits != 4:
                blocks = QuantBlocks.quantize(blocks.dequantize(), 4)
            # the kernel computes (q - 8) * scale + zero, scale and zero in the activations' dtype
            scale, lo = blocks.scale, blocks.min
            self.scales_and_zeros = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(dtype)
            self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.to(torch.int32), 1)
            self.bias = None if bias is None else bias.to(dtype)
        else:
            raise ValueError("8-bit weights need the extension's quant_linear kernel (AVX512-VNNI or AVX2)")

    def packed_tensors(self) -> list[torch.Tensor]:
        """The packed weights, scales and mins (native products only)."""
        return [self.weight, self.scales, self.mins]

    def kernel_tensors(self) -> KernelTensors | None:
        """(weight, scales, mins, bias) for :func:`.kernels.decoder_layers` if the product runs on the
        extension's ``quant_linear``, else None."""
        return (self.weight, self.scales, self.mins, self.bias) if self.native else None

    def race(
        self, x: torch.Tensor, k: int, inv_temperature: torch.Tensor, seeds: torch.Tensor
    ) -> RaceCandidates | None:
        """As :meth:`Linear.race`, on :func:`.kernels.quant_linear_race`."""
        if not self.native or self.bias is not None:
            return None
        return kernels.quant_linear_race(x, self.weight, self.scales, self.mins, k, inv_temperature, seeds)

    def __call__(self, x: torch.Tensor, wide: bool = False, gated: bool = False) -> torch.Tensor:
        """``wide=True``: a float32 result from the extension's kernel; elsewhere the result is in ``x``'s
        dtype.  ``gated=True`` (the extension's kernel only): see :class:`GateUp`."""
        if self.native:
            out_dtype = torch.float32 if wide else x.dtype
            return kernels.quant_linear(x, self.weight, self.scales, self.mins, self.bias, out_dtype, gated)
        if gated:
            raise ValueError("gated products run on the quant_linear kernel only")
        rows = x.shape[0]
        if rows < MIN_ROWS:
            return self(torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])]))[:rows]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, QUANT_GROUP, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


class StackedLinear:
    """Products of consecutive output rows side by side: a qkv whose parts the file stores in different block
    formats, each multiplied in its own rather than all widened to one that holds every part (bytes with float32
    scales and mins)."""

    def __init__(self, parts: list[Linear | QuantLinear]) -> None:
        self.parts = parts
        self.min_rows = max(p.min_rows for p in parts)

    def kernel_parts(self) -> list[KernelTensors] | None:
        """Each product's tensors for :func:`.kernels.decoder_layers`, else None."""
        tensors = [p.kernel_tensors() for p in self.parts]
        return None if any(t is None for t in tensors) else tensors  # type: ignore[return-value]

    def __call__(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        return torch.cat([p(x, wide) for p in self.parts], -1)


def kernel_parts(linear: Linear | QuantLinear | GateUp | StackedLinear) -> list[KernelTensors] | None:
    """A linear layer's products' tensors for :func:`.kernels.decoder_layers` (one, or a stack's), else None."""
    if isinstance(linear, StackedLinear):
        return linear.kernel_parts()
    tensors = linear.kernel_tensors()
    return None if tensors is None else [tensors]


def quant_kernel_available() -> bool:
    """Whether :func:`.kernels.quant_linear` is built here (the CPU has AVX512-VNNI or AVX2)."""
    kernels.load()
    return kernels.quant_gemm_available()


class GateUp:
    """The first half of a SwiGLU MLP: ``silu(x @ gate.T) * (x @ up.T)`` [rows, F].

    On the extension's products (``bf16_linear``, ``quant_linear``) this is one product whose weight rows
    interleave gate and up features in chunks of half the kernel's column group
    (:func:`.kernels.interleave_gate_up`), so that every tile holds a gate block and its up block and computes
    SiLU x up in its epilogue: the same bits as the product of ``[gate; up]`` followed by
    :func:`.kernels.silu_mul`, without writing the [rows, 2F] product to memory, reading it back and one more
    kernel per layer.  Elsewhere: one product of ``[gate; up]``, then ``silu_mul`` where the model runs the
    extension's kernels (``silu_kernel``), else ``F.silu(gate) * up``.  ``gelu``: GeGLU instead (Gemma's
    tanh-approximated GELU), always the latter way.
    """

    def __init__(
        self,
        gate: Weight,
        up: Weight,
        quantization: str,
        dtype: torch.dtype,
        silu_kernel: bool,
        gelu: bool = False,
    ) -> None:
        self.gelu = gelu
        silu_kernel = self.silu_kernel = silu_kernel and not gelu
        chunk = _gate_chunk(gate, quantization, dtype) if silu_kernel else None
        self.gated = chunk is not None
        self.chunk = chunk
        weight = _stack_gate_up(gate, up, chunk)
        self.product = make_linear(weight, None, quantization, dtype)
        self.min_rows = self.product.min_rows

    def kernel_tensors(self) -> KernelTensors | None:
        """The gated product's tensors for :func:`.kernels.decoder_layers`, else None."""
        return self.product.kernel_tensors() if self.gated else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.product(x, gated=True)
        if self.silu_kernel:
            return kernels.silu_mul(self.product(x))
        return self.activate(self.product(x))

    def pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ [gate; up].T`` in float32 [rows, 2F], gate columns then up columns (a gated product's interleaved
        columns put back in that order): what :meth:`activate` takes."""
        both = self.product(x, wide=True).float()
        if self.chunk is None:
            return both
        rows = both.shape[0]
        return both.view(rows, -1, 2, self.chunk).transpose(1, 2).reshape(rows, -1)

    def activate(self, both: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of a [rows, 2F] gate-then-up product (SiLU, or Gemma's tanh GELU)."""
        gate, up = both.chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up


def _blocks_of(weight: Weight, bits: int) -> QuantBlocks:
    """``weight``'s blocks: a float matrix quantized to ``bits``, a file's rows unpacked."""
    return QuantBlocks.quantize(weight, bits) if isinstance(weight, torch.Tensor) else unpacked(weight)


def _stack_gate_up(gate: Weight, up: Weight, chunk: int | None) -> Weight:
    """One weight of the gate and up rows: interleaved in ``chunk``s for a gated kernel, else gate then up; a file's
    rows joined as stored where both are in one format, else blocks in one format (:meth:`.QuantBlocks.alike`)."""

    def join(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if chunk is None else kernels.interleave_gate_up(parts[0], parts[1], chunk)

    if isinstance(gate, GgufRows) and isinstance(up, GgufRows) and gate.same_format(up):
        return GgufRows.combine([gate, up], join)
    if not isinstance(gate, torch.Tensor) and not isinstance(up, torch.Tensor):
        return QuantBlocks.combine(QuantBlocks.alike([unpacked(gate), unpacked(up)]), join)
    return join([x if isinstance(x, torch.Tensor) else unpacked(x).dequantize() for x in (gate, up)])


def _gate_chunk(gate: Weight, quantization: str, dtype: torch.dtype) -> int | None:
    """The interleaving chunk of a gated product for these weights, or None where no kernel runs one."""
    if gate.device.type != "cpu":
        return None
    if quantization == "int4":
        chunk, runs = kernels.QUANT_GATE_CHUNK, quant_kernel_available()
    else:
        assert isinstance(gate, torch.Tensor), "blocks are passed for quantized products only"
        chunk, runs = kernels.BF16_GATE_CHUNK, _can_use_bf16_kernel(gate.to(dtype))
    return chunk if runs and gate.shape[0] % chunk == 0 else None


def make_linear(
    weight: Weight, bias: torch.Tensor | None, quantization: str, dtype: torch.dtype, bits: int = 4
) -> Linear | QuantLinear:
    """A :class:`Linear` in ``dtype``, or for ``quantization="int4"`` a :class:`QuantLinear`: of the blocks
    given, or of ``bits`` quantized from a float ``weight`` (best passed in float32)."""
    if quantization == "int4":
        return QuantLinear(weight, bias, dtype, bits)
    if quantization != "none":
        raise ValueError(f"quantization must be none or int4, got {quantization!r}")
    if not isinstance(weight, torch.Tensor):
        weight = unpacked(weight).dequantize()
    return Linear(weight.to(dtype).contiguous(), None if bias is None else bias.to(dtype))
