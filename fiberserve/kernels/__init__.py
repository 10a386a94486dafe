"""CPU kernels in C++ for the decoder layer, registered as ``torch.ops.fiberserve.*`` by :func:`load`.

* :func:`paged_attention`: each row attends to its own sequence's keys, read in place through the page table;
* :func:`add_rms_norm`, :func:`rope_store`, :func:`silu_mul`: the elementwise and row-wise work between the
  linear layers, fused (a layer is 9 dispatches instead of ~30);
* :func:`decoder_layers`: the whole loop over the layers in C++ when every product runs on this extension's
  kernels (no Python frame or dispatcher call per kernel).

Every kernel computes a row from that row alone, in a fixed order (``csrc/simd/vec16.h``), so the rows are batch
invariant in every dtype.  The sources (``csrc/``) are plain C++ with GCC/Clang vector extensions (intrinsics only
for instructions they cannot spell: the products' tiles, vdpbf16ps); a build for AVX-512 compiles the 16-lane
vectors to single registers, one for AVX2 to pairs of 8-lane halves (``csrc/simd/vec16_halves.h``), and the AVX2
and AMX tiles have folders of their own.

The install compiles one build per x86-64 level (``variants.py``) and :func:`load` registers the best one this CPU
runs (``loader.py``; ``FIBERSERVE_KERNEL_VARIANT`` forces another).  This module holds each op's Python wrapper
and contract; which file holds which op, for which instruction sets, and which test covers it: ``README.md`` here.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from fiberserve.kernels.loader import load as load
from fiberserve.kernels.loader import loaded as loaded
from fiberserve.kernels.loader import target_isa as target_isa
from fiberserve.kernels.loader import variant as variant
from fiberserve.kernels.variants import VARIANT_ENV as VARIANT_ENV
from fiberserve.kernels.variants import VariantError as VariantError
from fiberserve.model.block_formats import IQ4_NL_VALUES
from fiberserve.model.config import ModelConfig
from fiberserve.model.quant_blocks import QuantBlocks

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(config: ModelConfig, dtype: torch.dtype) -> bool:
    """Whether the kernels handle this model in ``dtype`` (sizes in multiples of 16 lanes, <= 16 heads per kv head)."""
    group = config.num_heads // config.num_kv_heads
    sizes = (config.head_dim, config.hidden_size, config.intermediate_size)
    return all(n % 16 == 0 for n in sizes) and config.head_dim <= 256 and group <= 16 and dtype in _DTYPES


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    row_span: torch.Tensor,
    row_keys: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each row of ``q`` [T, H, D] attends causally to its own sequence's keys in ``k``/``v`` [slots, KVH, D].

    ``pages`` int32 [S, P] is each sequence's page table; ``row_span`` int32 [T] names a row's sequence
    (-1: a padding row, output zero); ``row_keys`` int32 [T] is how many keys it sees, of which a sliding
    ``window`` keeps the last ``window``; ``softcap`` caps the scaled scores to ``softcap * tanh(s / softcap)``
    (Gemma 2).  Returns [T, H * D].  A row's result is bit-identical whatever else is in the batch (see the C++
    source).
    """
    return torch.ops.fiberserve.paged_attention(
        q, k, v, pages, row_span, row_keys, page_size, scale, window or 0, softcap or 0.0
    )


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """``residual += delta`` in place (float32 [T, W]; ``delta`` in ``dtype`` or None), then return
    ``rms_norm(residual) * weight`` in ``dtype``."""
    return torch.ops.fiberserve.add_rms_norm(residual, delta, weight, eps, dtype)


def rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """Rotary embedding of the fused ``qkv`` rows [T, (H + 2 KVH) * D] at ``positions``; returns q [T, H, D].

    ``cos``/``sin``: float32 [positions, D] tables, ``sin`` with the rotate-half sign folded in (its first half
    negated).  The first ``len(write_slots)`` rows' rotated k and plain v are written to those slots of
    ``k_cache``/``v_cache`` [slots, KVH, D]; later rows are padding and write nothing.
    """
    return torch.ops.fiberserve.rope_store(qkv, positions, cos, sin, write_slots, k_cache, v_cache, heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for rows ``[gate | up]`` [T, 2F] -> [T, F], computed in float32."""
    return torch.ops.fiberserve.silu_mul(gate_up)


def lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    rows: list[torch.Tensor],
    a: list[torch.Tensor],
    bt: list[torch.Tensor],
    layout: list[int],
) -> None:
    """``out[rows[g]] += `` adapter g's low-rank product of ``x[rows[g]]`` for every group g, in place, in one
    parallel pass: coordinates ``x a[g]^T`` (``a[g]`` [R, K], rounded to its dtype), then per part ``(start, end,
    first, last, offset)`` the coordinates ``first:last`` times the part's B transposed ([last - first, end - start]
    at element ``offset`` of ``bt[g]``) added to columns ``start:end``.  ``layout``: per group its count of parts,
    then its parts.  A row's bits depend on the row alone (see the C++ source)."""
    torch.ops.fiberserve.lora_add(out, x, rows, a, bt, layout)


#: Gate (then up) features per chunk of a gated product's weight rows: half a column group of each kernel.
BF16_GATE_CHUNK = 32
QUANT_GATE_CHUNK = 16


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor, chunk: int) -> torch.Tensor:
    """The rows of ``gate`` and ``up`` [F, ...] (F % chunk == 0) as a gated product's weight [2F, ...]: ``chunk``
    gate rows, the ``chunk`` up rows of the same features, the next ``chunk`` gate rows, and so on."""
    features = gate.shape[0]
    pairs = torch.stack([gate.reshape(features // chunk, chunk, -1), up.reshape(features // chunk, chunk, -1)], 1)
    return pairs.reshape(2 * features, *gate.shape[1:])


def bf16_gemm_available() -> bool:
    """Whether :func:`bf16_linear` was built (the compiler targets AVX512-BF16, i.e. this CPU has it)."""
    return bool(torch.ops.fiberserve.bf16_gemm_available())


def bf16_amx() -> bool:
    """Whether :func:`bf16_linear` runs on AMX tiles here (built for them, and Linux granted the tile registers)."""
    return bool(torch.ops.fiberserve.bf16_amx())


def bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] (N % 16 == 0, K even) laid out for :func:`bf16_linear`."""
    return torch.ops.fiberserve.bf16_pack(weight)


def bf16_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    gated: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for bf16 ``x`` [M, K], float32 accumulation, the result in ``out_dtype``
    (bfloat16 or float32); rows batch invariant at any M.

    ``gated=True``: the weight's rows interleave gate and up features in chunks of :data:`BF16_GATE_CHUNK`
    (see :func:`interleave_gate_up`) and the result is ``silu(gate) * up`` [M, N / 2], the same bits as
    :func:`silu_mul` of the product rounded to ``out_dtype``."""
    return torch.ops.fiberserve.bf16_linear(x, packed, bias, out_dtype, gated)


def quant_gemm_available() -> bool:
    """Whether :func:`quant_linear` was built (the compiler targets AVX512-VNNI, i.e. this CPU has it)."""
    return bool(torch.ops.fiberserve.quant_gemm_available())


def unpack_gguf_blocks(raw: np.ndarray, type_name: str) -> list[torch.Tensor]:
    """A GGUF tensor's blocks (``raw`` uint8 [N, bytes per row], a view of the file) unpacked in one pass: q uint8
    [N, K], scale and min float32 [N, groups], and for the K formats their float16 d, int8 steps, float16 dmin and
    int8 negated min steps (empty tensors where the format has none)."""
    return torch.ops.fiberserve.unpack_gguf_blocks(*_gguf_op_args(raw, type_name))


def pack_gguf_blocks(raw: np.ndarray, type_name: str, out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """As :func:`unpack_gguf_blocks` (N % 16 == 0), with q already packed as :func:`quant_pack` packs it (into
    ``out`` where given): the byte a weight is written for 16 rows at a time, never for the whole tensor."""
    return torch.ops.fiberserve.pack_gguf_blocks(*_gguf_op_args(raw, type_name), out)


def _gguf_op_args(raw: np.ndarray, type_name: str) -> tuple[torch.Tensor, str, torch.Tensor | None]:
    load()
    with warnings.catch_warnings():  # the file's mapping is read-only, and the kernels only read it
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(raw)
    table = torch.from_numpy(IQ4_NL_VALUES.astype(np.int8)) if type_name == "IQ4_NL" else None
    return blocks, type_name, table


def quant_pack(blocks: QuantBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``blocks`` (N % 16 == 0) -> (weights, scales, mins) in :func:`quant_linear`'s layout and one of its formats
    (see ``linear_quant.cpp``):

    * 4 bits: q two per byte, scales and mins float16 where their values are (Q4_1); Q4_0's float16 scales alone
      (its mins are -8 times them, which the kernel computes), the mins returned empty;
    * 8 bits with a zero of 128 and float16 scales per block (Q8_0, Q5_0, IQ4_NL): signed bytes, whose offset the
      kernel computes in integers, so the mins returned are empty;
    * the K formats in their own factors (:class:`.SuperScales`): int8 scales and mins, per column block and
      super-block 16 float16 ``d`` then the groups' steps; Q4_K 4-bit, Q5_K bytes with mins, Q6_K 6-bit (the
      4-bit layout's nibbles, then per block 2 loads of high bits) with a scale per 16 inputs (its mins empty),
      Q3_K 3-bit and Q2_K 2-bit with a scale per 16 inputs (Q3_K signed, its mins empty; Q2_K with a min per 16);
    * any other 8 bits (Q5_1, mixed formats): bytes with float32 scales and mins (``-zero * scale`` where the blocks
      have a zero), one per block or per half block; any other 4 bits likewise with float32 scales and mins."""
    return torch.ops.fiberserve.quant_pack_q(blocks.q, blocks.bits), *quant_pack_factors(blocks)


def quant_pack_factors(blocks: QuantBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales and mins of :func:`quant_pack`; reads every field of ``blocks`` but ``q``."""
    group, (n, groups) = blocks.group, blocks.scale.shape
    empty = torch.empty(0, dtype=torch.half)
    if blocks.supers is not None:
        own = blocks.supers
        mins = empty if own.dmin is None or own.min_steps is None else _super_rows(own.dmin, own.min_steps)
        return _super_rows(own.d, own.steps), mins
    signed = blocks.bits == 8 and blocks.zero == 128 and group == 32 and not blocks.float32_scales
    half = signed or (blocks.bits == 4 and not blocks.float32_scales)
    zero_eight = blocks.bits == 4 and blocks.zero == 8 and half  # Q4_0: no mins stored
    mins = blocks.min if blocks.zero is None else -blocks.zero * blocks.scale

    def per_group(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.half if half else torch.float32).view(n // 16, 16, groups).permute(0, 2, 1).contiguous()

    return per_group(blocks.scale), empty if signed or zero_eight else per_group(mins)


def _super_rows(d: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A K format's factors as :func:`quant_linear` reads them: int8 [N / 16, super-blocks, 32 + 16 * groups], per
    column block and super-block the 16 outputs' float16 ``d``, then each group's 16 steps."""
    n, supers = d.shape
    groups = steps.shape[1] // supers
    head = d.view(n // 16, 16, supers).permute(0, 2, 1).contiguous().view(torch.int8)
    body = steps.view(n // 16, 16, supers, groups).permute(0, 2, 3, 1).reshape(n // 16, supers, 16 * groups)
    return torch.cat([head, body], -1).contiguous()


def quant_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    gated: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for block-quantized weights (from :func:`quant_pack`) and ``x`` [M, K] (bf16
    or float32) quantized per row and block of 32 to int8 (llama.cpp's arithmetic for block formats times
    int8 activations); the result in ``out_dtype`` (bfloat16 or float32); rows batch invariant at any M.

    ``gated=True``: the weight's rows interleave gate and up features in chunks of :data:`QUANT_GATE_CHUNK`
    (see :func:`interleave_gate_up`) and the result is ``silu(gate) * up`` [M, N / 2], the same bits as
    :func:`silu_mul` of the product rounded to ``out_dtype``."""
    return torch.ops.fiberserve.quant_linear(x, packed, scales, mins, bias, out_dtype, gated)


def bf16_linear_race(
    x: torch.Tensor, packed: torch.Tensor, k: int, inv_temperature: torch.Tensor, seeds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``top_k_rows(bf16_linear(x, packed, None, torch.float32), k)``, the same values and indices, and each row's
    ``k`` best entries of the race of :func:`race_rows` over that product (rows with ``inv_temperature`` 0 run
    none), without writing the product: (values, indices, race values, race indices)."""
    return torch.ops.fiberserve.bf16_linear_race(x, packed, k, inv_temperature, seeds)


def quant_linear_race(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    k: int,
    inv_temperature: torch.Tensor,
    seeds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`bf16_linear_race`, for the product ``quant_linear(x, packed, scales, mins, None, torch.float32)``."""
    return torch.ops.fiberserve.quant_linear_race(x, packed, scales, mins, k, inv_temperature, seeds)


def race_rows(logits: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Each row's draw from ``softmax(logits * inv_temperature)`` (``logits`` float32 [R, V], ``-inf`` excludes a
    token; ``inv_temperature`` [R] > 0; ``seeds`` int64 [R]): the argmax of ``logit * inv_temperature + g`` with
    Gumbel noise ``g`` a pure function of (seed, token), so a row's pick depends on that row alone.  LongTensor
    [R], -1 for a row with no finite logit."""
    return torch.ops.fiberserve.race_rows(logits, inv_temperature, seeds)


def refined_race(
    candidates: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    inv_temperature: torch.Tensor,
    seeds: torch.Tensor,
    weight_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's pick over its logits after :func:`refine_top_logits` with ``k``, from a head's race
    ``candidates`` (with ``k + 1``) alone: the argmax (first maximum) for a row with ``inv_temperature`` 0, else
    exactly :func:`race_rows`' pick over the re-scored row.  LongTensor [R], -1 for a row of NaN.  ``weight``: the
    head [V, W]; or, with ``weight_rows`` int64 [R, k], any matrix whose row ``weight_rows[r, j]`` is row r's j-th
    candidate's."""
    return torch.ops.fiberserve.refined_race(*candidates, hidden, weight, inv_temperature, seeds, weight_rows)


def top_k_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` (<= 64) largest values of each row of ``x`` [R, n] (float32 or bf16, CPU), largest first, as
    float32 values and int64 indices [R, k]; equal values in index order (``k=1`` is ``argmax``'s first
    maximum).  NaN is never picked.  Much faster than ``torch.topk``/``argmax`` over a vocabulary: one pass
    per row, rows in parallel."""
    return torch.ops.fiberserve.top_k_rows(x, k)


def refine_top_logits(
    logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int, weight_rows: torch.Tensor | None = None
) -> None:
    """Re-score the ``k`` (<= 64) largest logits of each row in place: ``logits`` float32 [R, V] (contiguous,
    CPU), ``hidden`` float32 [R, W], ``weight`` [V, W] float32 or bf16; or, with ``weight_rows`` int64 [R, k], any
    such matrix whose row ``weight_rows[r, j]`` is row r's j-th candidate's (:func:`top_k_rows`' order).  Each
    candidate's logit becomes the dot product of its weight row and the row's hidden state, accumulated in float64
    and rounded once to float32 (in a fixed order: the same bits for a row alone or in any batch).  The candidates
    are :func:`top_k_rows`'s."""
    torch.ops.fiberserve.refine_top_logits(logits, hidden, weight, k, weight_rows)


def decoder_layers(
    h: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attention: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float],
    heads: int,
    eps: float,
    dtype: torch.dtype,
    layers: tuple[list, list, list, list, list, list],
    lora: tuple[torch.Tensor | None, list[int], list[torch.Tensor], list[int]] = (None, [], [], []),
) -> None:
    """Every decoder layer on the float32 residual ``h`` [T, W], in place, writing K/V into ``k_cache``/``v_cache``
    [layers, slots, KVH, D]: per layer ``add_rms_norm``, qkv, ``rope_store``, ``paged_attention``, o,
    ``add_rms_norm``, gated gate/up (SiLU x up in its epilogue), down, then the last layer's MLP output is added
    to ``h``.  Each gate/up product also pulls the next layer's keys and values (the pages the rows will read)
    into cache as its tiles run (``simd/prefetch.h``), so that layer's attention does not wait for memory.

    ``attention``: (pages, row_span, row_keys, page_size, scale) as for :func:`paged_attention`.  ``layers``:
    flat lists (norms: 2 per layer; weights, scales, mins, biases: the products of 4 linear layers per layer, in
    the order qkv, o, gate/up, down; gate/up's rows interleaved, see :func:`interleave_gate_up`) and the number
    of products of each linear layer (several: their outputs side by side); a product with scales runs
    :func:`quant_linear`, one without :func:`bf16_linear`.

    ``lora``: LoRA adapters' additions (:meth:`.LoraRows.kernel_args`: the rows of each group, their counts, the
    adapters' A and B transposed, their layout: see :func:`lora_add`), added to their rows after each product
    (gate/up's before its activation, in the gated kernel).
    """
    tables = (*attention, heads, eps, dtype)  # pages, row_span, row_keys, page_size, scale, ...
    torch.ops.fiberserve.decoder_layers(h, positions, cos, sin, write_slots, k_cache, v_cache, *tables, *layers, *lora)
