"""The C++ CPU kernels against plain PyTorch, and their batch invariance (bit-identical rows)."""

import dataclasses
import functools
import operator
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fiberserve import kernels
from fiberserve.kernels import variants
from fiberserve.model.quant_blocks import QuantBlocks, SuperScales

#: The instruction sets of the build this CPU runs (``FIBERSERVE_KERNEL_VARIANT`` may force a narrower one).
ISA = kernels.target_isa()

kernels.load()
PAGE = 4


def greedy_candidates(race_op, x, *weights, k):
    """A head kernel's race op (``bf16_linear_race``, ``quant_linear_race``) for greedy rows: values, indices."""
    rows = x.shape[0]
    return race_op(x, *weights, k, torch.zeros(rows), torch.zeros(rows, dtype=torch.long))[:2]


def bf16_linear_on_variant(variant: str, tmp_path, x, weight, bias) -> torch.Tensor:
    """``bf16_linear(x, weight, bias)`` in float32 as a fresh process that forces the kernel build ``variant``
    computes it."""
    torch.save((x, weight, bias), tmp_path / "operands.pt")
    code = (
        "import sys, torch\n"
        "from fiberserve import kernels\n"
        "kernels.load()\n"
        "x, weight, bias = torch.load(sys.argv[1])\n"
        "assert kernels.variant().name == sys.argv[2], kernels.variant().name\n"
        "torch.save(kernels.bf16_linear(x, kernels.bf16_pack(weight), bias, torch.float32), sys.argv[3])\n"
    )
    args = [str(tmp_path / "operands.pt"), variant, str(tmp_path / "out.pt")]
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, variants.VARIANT_ENV: variant},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return torch.load(tmp_path / "out.pt")


def reference_attention(q, k, v, tables, spans, keys, window=None, softcap=None):
    """Row by row with PyTorch in float32: each row sees its span's first ``keys`` positions (their last
    ``window``), scores capped as transformers' Gemma 2 caps them."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = []
    for row in range(q.shape[0]):
        if spans[row] < 0:
            out.append(torch.zeros(q.shape[1] * q.shape[2]))
            continue
        slots = (tables[spans[row]].long()[:, None] * PAGE + torch.arange(PAGE)).flatten()[: keys[row]]
        slots = slots[-window:] if window else slots
        kk = k[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [H, n, D]
        vv = v[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        scores = q[row].float().unsqueeze(1) @ kk.transpose(1, 2) * q.shape[-1] ** -0.5  # [H, 1, n]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out.append((scores.softmax(-1) @ vv).flatten())
    return torch.stack(out)


def attention_case(dtype, head_dim=32):
    """Two spans: a 5-token prefill chunk (positions 3..7 of 8) and a decode row at 11 keys, plus a padding row."""
    torch.manual_seed(0)
    k = torch.randn(64 * PAGE, 2, head_dim).to(dtype)
    v = torch.randn(64 * PAGE, 2, head_dim).to(dtype)
    q = torch.randn(7, 6, head_dim).to(dtype)
    tables = torch.tensor([[9, 3, 0], [5, 17, 40]], dtype=torch.int32)
    spans = torch.tensor([0, 0, 0, 0, 0, 1, -1], dtype=torch.int32)
    keys = torch.tensor([4, 5, 6, 7, 8, 11, 0], dtype=torch.int32)
    return q, k, v, tables, spans, keys


@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64 and 128: the compiled-size paths (bf16: vdpbf16ps scores)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_attention_matches_reference(dtype, head_dim):
    q, k, v, tables, spans, keys = attention_case(dtype, head_dim)
    out = kernels.paged_attention(q, k, v, tables, spans, keys, PAGE, q.shape[-1] ** -0.5)
    expected = reference_attention(q, k, v, tables, spans, keys)
    tolerance = 2e-6 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == (7, 6 * q.shape[-1])
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(out[6], torch.zeros_like(out[6]))  # the padding row


@pytest.mark.parametrize("window, softcap", [(3, None), (None, 2.0), (6, 1.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_sliding_windows_and_soft_capping(dtype, window, softcap):
    """A row sees the last ``window`` of its keys (the decode row past them, the chunk's rows both within and past
    them); capped scores as Gemma 2 caps them (scores of a few units, where tanh bends)."""
    q, k, v, tables, spans, keys = attention_case(dtype, head_dim=64)
    q = q * 4
    out = kernels.paged_attention(q, k, v, tables, spans, keys, PAGE, 0.125, window, softcap)
    expected = reference_attention(q, k, v, tables, spans, keys, window, softcap)
    tolerance = 2e-6 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    assert not torch.allclose(out.float(), reference_attention(q, k, v, tables, spans, keys), atol=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_rows_are_batch_invariant(dtype):
    """Every row alone (as a one-row decode) gives the bits it gets inside the prefill chunk and the batch."""
    q, k, v, tables, spans, keys = attention_case(dtype, head_dim=64)
    scale = 0.125
    batch = kernels.paged_attention(q, k, v, tables, spans, keys, PAGE, scale)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # fewer rows than threads: the threads share a row's kv heads (see the C++ source)
    try:
        for row in range(7):
            one = slice(row, row + 1)
            table = tables[spans[one].long().clamp(min=0)]  # the row's span becomes span 0 (padding stays -1)
            alone = kernels.paged_attention(q[one], k, v, table, spans[one].clamp(max=0), keys[one], PAGE, scale)
            assert torch.equal(alone[0], batch[row])  # row 6, a padding row: zeros
    finally:
        torch.set_num_threads(threads)
    strided = torch.cat([q, torch.randn_like(q)], dim=1)[:, :6]  # rows of a wider tensor, read in place
    assert torch.equal(kernels.paged_attention(strided, k, v, tables, spans, keys, PAGE, scale), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_row_decoded_alone_shares_its_heads_and_keeps_its_bits(dtype):
    """One row with many keys and fewer rows than threads: the threads split its kv heads between them; its
    result is the reference's, and the bits it gets inside a batch (where rows are the threads' work)."""
    torch.manual_seed(2)
    k, v = torch.randn(64 * PAGE, 3, 64).to(dtype), torch.randn(64 * PAGE, 3, 64).to(dtype)
    q = torch.randn(4, 9, 64).to(dtype)
    tables = torch.randperm(64, dtype=torch.int32)[:50].view(1, 50)
    spans, keys = torch.zeros(4, dtype=torch.int32), torch.tensor([197, 198, 199, 200], dtype=torch.int32)
    batch = kernels.paged_attention(q, k, v, tables, spans, keys, PAGE, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = kernels.paged_attention(q[3:], k, v, tables, spans[3:], keys[3:], PAGE, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], batch[3])
    expected = reference_attention(q[3:], k, v, tables, spans[3:], keys[3:])  # its scale: 64 ** -0.5
    torch.testing.assert_close(alone.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_chunk_attends_as_the_reference_and_each_row_alone_keeps_its_bits(dtype, window):
    """A prefill chunk of 15 rows (8 tiles: on AVX512-BF16 its keys are transposed once for all of them) and a
    decode row of another span: the reference's result, and each row alone (whose tile transposes its own keys)
    gets the bits it gets in the batch; with a window, the rows' first keys are odd and even positions alike."""
    torch.manual_seed(3)
    k, v = torch.randn(64 * PAGE, 3, 64).to(dtype), torch.randn(64 * PAGE, 3, 64).to(dtype)
    q = torch.randn(16, 9, 64).to(dtype)
    tables = torch.randperm(64, dtype=torch.int32)[:40].view(2, 20)
    spans = torch.tensor([0] * 15 + [1], dtype=torch.int32)
    keys = torch.tensor([*range(50, 65), 77], dtype=torch.int32)
    batch = kernels.paged_attention(q, k, v, tables, spans, keys, PAGE, 0.125, window or 0)
    expected = reference_attention(q, k, v, tables, spans, keys, window)  # its scale: 64 ** -0.5
    tolerance = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(batch.float(), expected, atol=tolerance, rtol=tolerance)
    for row in range(16):
        one = slice(row, row + 1)
        alone = kernels.paged_attention(
            q[one], k, v, tables[spans[one].long()], spans[one] * 0, keys[one], PAGE, 0.125, window or 0
        )
        assert torch.equal(alone[0], batch[row])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(dtype):
    torch.manual_seed(1)
    residual = torch.randn(5, 96)
    delta = torch.randn(5, 96).to(dtype)
    weight = torch.rand(96) + 0.5
    expected_residual = residual + delta.float()
    expected = F.rms_norm(expected_residual, (96,), weight, 1e-5)
    out = kernels.add_rms_norm(residual, delta, weight, 1e-5, dtype)
    torch.testing.assert_close(residual, expected_residual)  # updated in place
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    again = kernels.add_rms_norm(residual[2:3].clone(), None, weight, 1e-5, dtype)
    assert torch.equal(again[0], out[2])  # a row alone: the same bits


def test_rope_store_rotates_and_writes_the_cache():
    torch.manual_seed(2)
    heads, kv_heads, dim, rows = 4, 2, 16, 3
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    positions = torch.tensor([5, 0, 9])
    angles = torch.outer(torch.arange(16.0), 1.0 / (10000 ** (torch.arange(0, dim, 2) / dim)))
    cos, sin = angles.cos().repeat(1, 2), torch.cat([-angles.sin(), angles.sin()], dim=1)
    k_cache = torch.zeros(20, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    q = kernels.rope_store(qkv, positions, cos, sin, torch.tensor([7, 3]), k_cache, v_cache, heads)

    x = qkv.float()[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    angle = angles[positions].unsqueeze(1)
    expected = x * torch.cat([angle.cos()] * 2, -1) + rotated * torch.cat([angle.sin()] * 2, -1)
    torch.testing.assert_close(q.float(), expected[:, :heads], atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(k_cache[[7, 3]].float(), expected[:2, heads:], atol=2e-2, rtol=1e-2)
    assert torch.equal(v_cache[[7, 3]], qkv[:2, (heads + kv_heads) * dim :].view(2, kv_heads, dim))
    written = torch.zeros(20, dtype=torch.bool)
    written[[7, 3]] = True
    assert not k_cache[~written].any() and not v_cache[~written].any()  # the padding row wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    torch.manual_seed(3)
    gate_up = (torch.randn(4, 64) * 6).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    out = kernels.silu_mul(gate_up)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), F.silu(gate) * up, atol=tolerance, rtol=tolerance)
    assert torch.equal(kernels.silu_mul(gate_up[1:2])[0], out[1])


def test_bf16_linear_is_built_where_the_target_has_avx512_bf16_or_avx2():
    assert kernels.bf16_gemm_available() == ("avx512_bf16" in ISA or {"avx2", "fma"} <= ISA)


@pytest.mark.skipif(
    not kernels.bf16_gemm_available() or "avx512_bf16" in ISA,
    reason="checks the AVX2 tile; vdpbf16ps rounds as the hardware does",
)
def test_bf16_linear_on_avx2_adds_each_pair_odd_then_even_as_vdpbf16ps_pseudo_code():
    """Per output, in float32: acc += x[2p+1] w[2p+1], then acc += x[2p] w[2p], pair after pair (a product of two
    bf16 is exact in float32, so only the additions round)."""
    torch.manual_seed(5)
    weight, x = torch.randn(48, 96).bfloat16(), torch.randn(7, 96).bfloat16()
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(7, 48)
    for p in range(48):
        acc = acc + xf[:, 2 * p + 1 : 2 * p + 2] * wf[:, 2 * p + 1]
        acc = acc + xf[:, 2 * p : 2 * p + 1] * wf[:, 2 * p]
    out = kernels.bf16_linear(x, kernels.bf16_pack(weight), None, torch.float32)
    assert torch.equal(out, acc)
    assert not torch.equal(out, xf @ wf.t())  # another order rounds differently somewhere


@pytest.mark.skipif(not kernels.bf16_gemm_available(), reason="this CPU has neither AVX512-BF16 nor AVX2")
def test_bf16_linear_matches_float32_and_rows_are_exact_at_any_count():
    """144 outputs = column groups of 4, 4 and 1 blocks: with 2 threads the work splits inside a group (by
    row tiles from 7 rows on, by blocks below), and no split may change a row's bits."""
    torch.manual_seed(4)
    weight, bias = torch.randn(144, 576).bfloat16(), torch.randn(144)
    x = torch.randn(13, 576).bfloat16()
    packed = kernels.bf16_pack(weight)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = kernels.bf16_linear(x, packed, bias)
        expected = x.float() @ weight.float().t() + bias
        assert out.dtype == torch.bfloat16 and out.shape == (13, 144)
        torch.testing.assert_close(out.float(), expected, atol=0.1, rtol=1e-2)
        for rows in range(1, 13):  # tiles of up to 6 (AVX-512) or 5 rows: the same bits for every row
            assert torch.equal(kernels.bf16_linear(x[:rows], packed, bias), out[:rows])
        assert torch.equal(kernels.bf16_linear(x[7:8], packed, bias)[0], out[7])
        torch.set_num_threads(1)
        assert torch.equal(kernels.bf16_linear(x, packed, bias), out)
    finally:
        torch.set_num_threads(threads)
    wide = kernels.bf16_linear(x, packed, bias, torch.float32)  # the same sums, not rounded to bf16
    assert wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), out)
    assert (wide != out.float()).any()


@pytest.mark.skipif(not kernels.bf16_gemm_available(), reason="this CPU has neither AVX512-BF16 nor AVX2")
def test_bf16_linear_runs_on_amx_tiles_exactly_where_the_cpu_has_them():
    assert kernels.bf16_amx() == ("amx_bf16" in ISA and "avx512_bf16" in ISA)


@pytest.mark.skipif(not kernels.bf16_amx(), reason="this CPU has no AMX tiles")
def test_bf16_linear_on_amx_tiles_keeps_every_row_exact_at_any_count(tmp_path):
    """Tiles of 16 rows, the last padded: 1 to 40 rows (one tile, several, split between threads by blocks or by
    (group, row tile)), plain, with bias, gated and top-k, give a row the same bits.  The AVX-512 build's
    vdpbf16ps tiles give the same products, other roundings."""
    torch.manual_seed(13)
    weight, bias = torch.randn(144, 576).bfloat16(), torch.randn(144)
    packed = kernels.bf16_pack(weight)
    x = torch.randn(40, 576).bfloat16()
    gated, _ = gated_and_plain("bf16", torch.randn(64, 576) * 0.2, torch.randn(64, 576) * 0.2, torch.randn(128))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        wide, out, gate_up = (
            kernels.bf16_linear(x, packed, bias, torch.float32),
            kernels.bf16_linear(x, packed, bias),
            gated(x, torch.bfloat16),
        )
        top_values, top_indices = greedy_candidates(kernels.bf16_linear_race, x, packed, k=8)
        torch.testing.assert_close(wide, x.float() @ weight.float().t() + bias, atol=1e-3, rtol=1e-4)
        for rows in [1, 2, 5, 15, 16, 17, 31, 33]:
            assert torch.equal(kernels.bf16_linear(x[:rows], packed, bias), out[:rows]), rows
            assert torch.equal(gated(x[:rows], torch.bfloat16), gate_up[:rows]), rows
        assert torch.equal(kernels.bf16_linear(x[21:22], packed, bias, torch.float32)[0], wide[21])
        no_bias = kernels.bf16_linear(x[:17], packed, None, torch.float32)
        assert torch.equal(kernels.top_k_rows(no_bias, 8)[0], top_values[:17])
        assert torch.equal(greedy_candidates(kernels.bf16_linear_race, x[:17], packed, k=8)[1], top_indices[:17])
    finally:
        torch.set_num_threads(threads)
    vector = bf16_linear_on_variant("avx512", tmp_path, x, weight, bias)
    torch.testing.assert_close(vector, wide, atol=1e-3, rtol=1e-4)
    assert not torch.equal(vector, wide)  # tdpbf16ps rounds its sums otherwise than vdpbf16ps: other bits


def test_quant_linear_is_built_where_the_target_has_avx512_vnni_or_avx2():
    assert kernels.quant_gemm_available() == ("avx512_vnni" in ISA or {"avx2", "f16c"} <= ISA)


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel sees it: int8 per row and block of 32 (step max|x| / 127), dequantized, float64."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    step = amax / 127
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * step).double().view_as(x)


#: The kernel's weight formats (see kernels.quant_pack): bits, zero, inputs per scale, float32 scales, K factors.
QUANT_FORMATS = {
    "4-bit": (4, None, 32, False, False),  # Q4_1
    "4-bit, mins of -8 scales": (4, 8, 32, False, False),  # Q4_0: no mins stored
    "4-bit, K factors": (4, None, 32, True, True),  # Q4_K
    "4-bit, float32 scales": (4, None, 32, True, False),  # 4-bit blocks of mixed formats
    "signed bytes": (8, 128, 32, False, False),  # Q8_0, Q5_0, IQ4_NL
    "6-bit, K factors": (6, 32, 16, True, True),  # Q6_K
    "3-bit signed per 16, K factors": (3, 4, 16, True, True),  # Q3_K
    "2-bit with mins per 16, K factors": (2, None, 16, True, True),  # Q2_K
    "bytes with mins, K factors": (8, None, 32, True, True),  # Q5_K
    "bytes with mins": (8, None, 32, True, False),  # Q5_1
    "bytes with mins per 16": (8, None, 16, True, False),  # blocks of mixed formats
}


def random_blocks(n: int, k: int, kind: str) -> QuantBlocks:
    """Blocks of a kernel format with random q, scales and mins (float16 values where the format keeps them so;
    a float16 per 256 inputs times an integer step per group where it has K factors)."""
    bits, zero, group, wide, factors = QUANT_FORMATS[kind]
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    if factors:
        d, dmin = (torch.rand(n, k // 256) * 0.001).half(), (torch.rand(n, k // 256) * 0.001).half()
        steps = torch.randint(-128 if zero else 0, 128 if zero else 64, (n, k // group), dtype=torch.int8)
        min_steps = None if zero else -torch.randint(0, 64, (n, k // group), dtype=torch.int8)
        scales = d.float().repeat_interleave(256 // group, -1) * steps.float()
        mins = None if zero else dmin.float().repeat_interleave(256 // group, -1) * min_steps.float()
        supers = SuperScales(d, steps, None if zero else dmin, min_steps)
        return QuantBlocks(q, scales, -zero * scales if zero else mins, bits, zero, group, True, supers)
    scales = torch.rand(n, k // group) * 0.01
    mins = -torch.rand(n, k // group) * 0.05
    if not wide:
        scales, mins = scales.half().float(), mins.half().float()
    return QuantBlocks(q, scales, -zero * scales if zero else mins, bits, zero, group, wide)


@pytest.mark.skipif(not kernels.quant_gemm_available(), reason="this CPU has neither AVX512-VNNI nor AVX2")
def test_q4_0_blocks_pack_without_mins_and_multiply_as_with_them():
    """Q4_0's mins are -8 times its scales: packed without them, its products have the bits of the same blocks
    packed with them stored (the kernel computes the same float32 mins)."""
    torch.manual_seed(9)
    blocks = random_blocks(64, 512, "4-bit, mins of -8 scales")
    own = kernels.quant_pack(blocks)
    stored = kernels.quant_pack(dataclasses.replace(blocks, zero=None))
    assert own[2].numel() == 0 and torch.equal(stored[2].float(), (-8 * stored[1].float()))
    x = torch.randn(13, 512).bfloat16()
    for rows in (1, 2, 6, 13):
        for out in (torch.float32, torch.bfloat16):
            mine = kernels.quant_linear(x[:rows], *own, None, out)
            assert torch.equal(mine, kernels.quant_linear(x[:rows], *stored, None, out))


def packed_by_definition(q: torch.Tensor, bits: int) -> torch.Tensor:
    """quant_linear's layout of ``q`` (see linear_quant.cpp), written with tensor permutes."""
    n, k = q.shape
    if bits == 8:
        return q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    steps = q.view(n // 16, 16, k // 32, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # [N/16, K/32, half, load, 16, 4]

    def pair_loads(two_bits: torch.Tensor) -> torch.Tensor:
        """Loads 2i and 2i + 1's 2-bit fields, low half then high, in load i's bytes."""
        pairs = two_bits.reshape(n // 16, k // 32, 2, 2, 2, 16, 4)  # [.., half, i, load of the pair, 16, 4]
        fields = [pairs[:, :, half, :, pair] << (2 * (2 * pair + half)) for pair in (0, 1) for half in (0, 1)]
        return fields[0] | fields[1] | fields[2] | fields[3]

    if bits <= 3:
        packed = pair_loads(steps & 3)
        if bits == 3:  # the third bit of load j's half h at bit 2j + h
            third = (steps >> 2) & 1
            bits_of = [third[:, :, half, j] << (2 * j + half) for j in range(4) for half in (0, 1)]
            packed = torch.cat([packed, functools.reduce(operator.or_, bits_of)[:, :, None]], 2)
        return packed.contiguous()
    packed = (steps[:, :, 0] & 0x0F) | ((steps[:, :, 1] & 0x0F) << 4)
    if bits == 6:  # each high-bit load: the 2 high bits of loads 2i, 2i + 1, low half then high
        packed = torch.cat([packed, pair_loads(steps >> 4)], 2)
    return packed.contiguous()


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_weights_pack_into_the_kernels_layout(bits):
    q = torch.randint(0, 2**bits, (48, 256), dtype=torch.uint8)
    assert torch.equal(torch.ops.fiberserve.quant_pack_q(q, bits), packed_by_definition(q, bits))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.fiberserve.quant_pack_q(q[:40], bits)


def exact_weights(blocks: QuantBlocks) -> torch.Tensor:
    """``scale * q + min`` in float64."""
    n, k = blocks.shape
    grouped = blocks.q.double().view(n, -1, blocks.group)
    return (grouped * blocks.scale.double()[..., None] + blocks.min.double()[..., None]).view(n, k)


@pytest.mark.skipif(not kernels.quant_gemm_available(), reason="this CPU has neither AVX512-VNNI nor AVX2")
@pytest.mark.parametrize("kind", QUANT_FORMATS)
def test_quant_linear_is_exact_block_arithmetic_and_rows_are_exact_at_any_count(kind):
    """The result is the float64 product of the dequantized weights and the int8-quantized rows, up to
    float32 rounding; a row gets the same bits in one row tile, in several, in the last, partial one, in a
    16-row tile (AMX's, where it runs) or beside one, and alone (where a thread's tile takes several column groups
    at once: 21 column blocks, the last group partial)."""
    torch.manual_seed(5)
    n, k = 336, 1536
    blocks = random_blocks(n, k, kind)
    bias = torch.randn(n)
    x = torch.randn(37, k).bfloat16()
    x[3, 64:96] = 0  # an all-zero block quantizes to zeros
    packed = kernels.quant_pack(blocks)
    wide = kernels.quant_linear(x, *packed, bias, torch.float32)
    expected = quantized_rows(x) @ exact_weights(blocks).t() + bias.double()
    torch.testing.assert_close(wide.double(), expected, atol=2e-5 * expected.abs().max().item(), rtol=0)
    for rows in range(1, 37):
        assert torch.equal(kernels.quant_linear(x[:rows], *packed, bias, torch.float32), wide[:rows])
    assert torch.equal(kernels.quant_linear(x[7:8], *packed, bias, torch.float32)[0], wide[7])
    assert torch.equal(kernels.quant_linear(x[20:], *packed, bias, torch.float32), wide[20:])
    narrow = kernels.quant_linear(x, *packed, bias, torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, wide.bfloat16())
    assert torch.equal(
        kernels.quant_linear(x.float(), *packed, bias, torch.float32), wide
    )  # bf16 rows are exact in float32


@pytest.mark.skipif(not kernels.quant_gemm_available(), reason="this CPU has neither AVX512-VNNI nor AVX2")
def test_quant_linear_refuses_scales_that_fit_no_format():
    weight, scales, mins = kernels.quant_pack(random_blocks(32, 64, "bytes with mins"))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="float32 scales and mins"):
        kernels.quant_linear(x, weight, scales.half(), mins.half())
    with pytest.raises(RuntimeError, match="mins must match"):
        kernels.quant_linear(x, weight, scales, mins[:1])


def gated_and_plain(kernel: str, gate: torch.Tensor, up: torch.Tensor, bias: torch.Tensor):
    """(gated product, plain product of [gate; up]) as callables of (x, out_dtype), for one kernel."""
    if kernel == "bf16":
        chunk = kernels.BF16_GATE_CHUNK
        interleaved = kernels.bf16_pack(kernels.interleave_gate_up(gate, up, chunk).bfloat16())
        plain = kernels.bf16_pack(torch.cat([gate, up]).bfloat16())

        def run(weight, x, out_dtype, bias, gated):
            return kernels.bf16_linear(x, weight, bias, out_dtype, gated)
    else:
        chunk = kernels.QUANT_GATE_CHUNK

        def pack(weight):  # 4-bit blocks of the weights, or Q8_0 ones as bytes with mins per 16 (Q6_K's format)
            blocks = QuantBlocks.quantize(weight, 4 if kernel == "int4" else 8)
            return kernels.quant_pack(blocks if kernel == "int4" else blocks.as_bytes(16))

        interleaved, plain = pack(kernels.interleave_gate_up(gate, up, chunk)), pack(torch.cat([gate, up]))

        def run(weight, x, out_dtype, bias, gated):
            return kernels.quant_linear(x, *weight, bias, out_dtype, gated)

    gated_bias = kernels.interleave_gate_up(*bias.chunk(2), chunk)
    return (
        lambda x, out_dtype: run(interleaved, x, out_dtype, gated_bias, True),
        lambda x, out_dtype: run(plain, x, out_dtype, bias, False),
    )


@pytest.mark.parametrize("kernel", ["bf16", "int4", "bytes per 16"])
def test_a_gated_product_is_silu_mul_of_the_product_bit_for_bit(kernel):
    """SiLU x up in the product's epilogue (GateUp) gives the bits of the product rounded to its dtype and
    silu_mul after it, at every row count (1 to 13 and 40 rows: one row tile, several, split between threads; one
    row: several gate/up pairs in a tile)."""
    if not (kernels.bf16_gemm_available() if kernel == "bf16" else kernels.quant_gemm_available()):
        pytest.skip(f"this CPU has no {kernel} kernel")
    torch.manual_seed(8)
    features, k = 192, 576
    gate, up = torch.randn(features, k) * 0.2, torch.randn(features, k) * 0.2
    gated, plain = gated_and_plain(kernel, gate, up, torch.randn(2 * features))
    x = torch.randn(40, k).bfloat16()
    inputs = [x] if kernel == "bf16" else [x, x.float()]  # quant_linear also takes float32 rows
    for rows in [*range(1, 14), 40]:
        for xs in inputs:
            out_dtype = xs.dtype
            expected = kernels.silu_mul(plain(xs[:rows], out_dtype))
            got = gated(xs[:rows], out_dtype)
            assert got.shape == (rows, features) and got.dtype == out_dtype
            assert torch.equal(got, expected), (rows, out_dtype)
    g, u = plain(x, torch.float32).chunk(2, -1)
    torch.testing.assert_close(gated(x, torch.bfloat16).float(), F.silu(g) * u, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_rows_matches_topk_and_argmax(dtype):
    torch.manual_seed(6)
    x = torch.randn(5, 1000).to(dtype)
    x[2, 7] = x[2, 900] = 9.0  # a tie for the first place: the lower index comes first, as argmax picks it
    x[3, 5] = float("nan")
    values, indices = kernels.top_k_rows(x, 16)
    expected = x.float().nan_to_num(-1e9).topk(16)
    assert torch.equal(values, expected.values) and torch.equal(x.float().gather(1, indices), values)
    assert indices[2, :2].tolist() == [7, 900]
    assert torch.equal(kernels.top_k_rows(x, 1)[1][:, 0], x.float().nan_to_num(-1e9).argmax(-1))
    assert torch.equal(kernels.top_k_rows(x[2:3], 16)[1][0], indices[2])  # a row alone: the same


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_refine_top_logits_rescores_the_top_k_as_float64_dot_products(weight_dtype):
    torch.manual_seed(7)
    rows, vocab, width, k = 6, 300, 72, 16  # 72: a tail after the 8-wide steps
    hidden, weight = torch.randn(rows, width), torch.randn(vocab, width).to(weight_dtype)
    logits = (hidden @ weight.float().T).to(torch.bfloat16).float()  # coarse, as the bf16 head gives them
    top = logits.topk(k).indices
    exact = torch.einsum("rw,rkw->rk", hidden.double(), weight.double()[top]).float()
    expected = logits.scatter(1, top, exact)

    refined = logits.clone()
    kernels.refine_top_logits(refined, hidden, weight, k)
    assert torch.equal(refined, expected)  # the k best re-scored, every other logit untouched
    alone = logits[4:5].clone()
    kernels.refine_top_logits(alone, hidden[4:5], weight, k)
    assert torch.equal(alone[0], refined[4])  # a row alone: the same bits
    # each candidate's row found elsewhere (a table of rows read from the file's blocks): the same bits
    top_rows = kernels.top_k_rows(logits, k)[1]
    table, places = weight[top_rows].flatten(0, 1).flip(0), torch.arange(rows * k).flip(0).view(rows, k)
    elsewhere = logits.clone()
    kernels.refine_top_logits(elsewhere, hidden, table, k, places)
    assert torch.equal(elsewhere, expected)
    with pytest.raises(RuntimeError, match="weight_rows must index weight's rows"):
        kernels.refine_top_logits(logits.clone(), hidden, table, k, places + 1)


@pytest.mark.skipif(not kernels.quant_gemm_available(), reason="this CPU has neither AVX512-VNNI nor AVX2")
@pytest.mark.parametrize("kind", QUANT_FORMATS)
def test_quant_linear_race_keeps_top_k_rows_of_the_product_bit_for_bit(kind):
    """The top k kept as the tiles go equal top_k_rows of the written product: values, indices and the order of
    ties (outputs 5 and 300 have the same weights, so every row ties them, 5 first, across the threads' ranges);
    in vector tiles and in 16-row tiles (AMX's, where it runs)."""
    torch.manual_seed(11)
    n, k_in = 400, 768
    blocks = random_blocks(n, k_in, kind)
    blocks = blocks.map_rows(lambda t: torch.cat([t[:300], t[5:6], t[301:]]))
    x = torch.randn(21, k_in).bfloat16()
    x[4] = x[4].abs()  # rows where the tied outputs rank high are likelier with the weights below
    blocks.q[5] = blocks.q[300] = 2**blocks.bits - 1
    packed = kernels.quant_pack(blocks)
    for rows in (1, 6, 13, 21):
        product = kernels.quant_linear(x[:rows], *packed, None, torch.float32)
        for k in (1, 17, 64):
            values, indices = greedy_candidates(kernels.quant_linear_race, x[:rows], *packed, k=k)
            expected_values, expected_indices = kernels.top_k_rows(product, k)
            assert torch.equal(values, expected_values) and torch.equal(indices, expected_indices)
    assert torch.equal(product[:, 5], product[:, 300])
    order = greedy_candidates(kernels.quant_linear_race, x, *packed, k=64)[1].tolist()
    assert any(5 in row for row in order)
    assert all(row.index(5) < row.index(300) for row in order if 5 in row and 300 in row)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_refined_race_of_a_greedy_row_is_the_argmax_of_the_refined_logits(weight_dtype):
    """From the k + 1 best coarse logits alone: the argmax over the row once its k best are re-scored, including
    rows where the best of the rest (not re-scored) wins, and a row of NaN (no candidate: -1)."""
    torch.manual_seed(3)
    rows, vocab, width, k = 40, 500, 64, 16
    hidden, weight = torch.randn(rows, width), torch.randn(vocab, width).to(weight_dtype)
    logits = (hidden @ weight.float().T).to(torch.bfloat16).float()
    logits[::2] = torch.randn(rows // 2, vocab) * 3  # unrelated to the exact dots: the rest often wins there
    logits[1, 7] = logits[1, 9] = 1e4  # coarse ties
    logits[3] = float("nan")
    refined = logits.clone()
    kernels.refine_top_logits(refined, hidden, weight, k)
    expected = kernels.top_k_rows(refined, 1)[1][:, 0]
    candidates = kernels.top_k_rows(logits, k + 1)  # a greedy row's race lists are not read
    greedy = torch.zeros(rows), torch.zeros(rows, dtype=torch.long)
    picked = kernels.refined_race((*candidates, *candidates), hidden, weight, *greedy)
    assert torch.equal(picked, expected) and picked[3] == -1
    # each row's first k candidates' rows in a table of their own (the row of NaN's: any)
    table = weight[candidates[1][:, :k].clamp(min=0)].flatten(0, 1)
    places = torch.arange(rows * k).view(rows, k)
    assert torch.equal(kernels.refined_race((*candidates, *candidates), hidden, table, *greedy, places), picked)
    rest = kernels.top_k_rows(logits, k + 1)[1][:, k]
    assert bool((picked == rest).any()) and bool((picked != rest).any())


def test_race_rows_picks_a_kept_token_from_the_row_alone():
    """A row's draw depends on its logits, temperature and seed only (alone or in a batch, any thread count), never
    picks an excluded (-inf) token, reaches the tokens past the last group of 16, and a row with no finite logit
    gives -1."""
    torch.manual_seed(5)
    rows, vocab = 24, 1000  # 62 groups of 16 and a tail of 8
    logits = torch.randn(rows, vocab) * 2
    logits[:, 500:] = float("-inf")
    logits[5, :] = float("-inf")
    logits[6, :-3] = float("-inf")
    logits[6, -3:] = torch.tensor([0.5, -0.5, 1.0])  # only the tail is kept
    inverse = torch.linspace(0.5, 3.0, rows)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,))
    picked = kernels.race_rows(logits, inverse, seeds)
    assert picked[5] == -1 and vocab - 3 <= picked[6] < vocab
    assert bool((picked[picked >= 0] < 500).sum() == rows - 2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for row in (0, 7, rows - 1):
            assert kernels.race_rows(logits[row : row + 1], inverse[row : row + 1], seeds[row : row + 1]) == picked[row]
    finally:
        torch.set_num_threads(threads)
    other = kernels.race_rows(logits, inverse, seeds + 1)  # the seed decides the draw
    assert bool((other != picked).any())


@pytest.mark.skipif(not kernels.bf16_gemm_available(), reason="this CPU has neither AVX512-BF16 nor AVX2")
def test_bf16_linear_race_keeps_top_k_rows_of_the_product_bit_for_bit():
    """As for quant_linear_race: one row tile (the column split) and several (the (group, row tile) split), with
    outputs 5 and 300 tied in every row."""
    torch.manual_seed(12)
    weight = torch.randn(400, 96).bfloat16()
    weight[300] = weight[5] = weight[5].abs()
    packed = kernels.bf16_pack(weight)
    x = torch.randn(13, 96).bfloat16()
    x[:, :] = x.abs()  # the tied outputs rank high
    for rows in (1, 6, 13):
        product = kernels.bf16_linear(x[:rows], packed, None, torch.float32)
        for k in (1, 17, 64):
            values, indices = greedy_candidates(kernels.bf16_linear_race, x[:rows], packed, k=k)
            expected_values, expected_indices = kernels.top_k_rows(product, k)
            assert torch.equal(values, expected_values) and torch.equal(indices, expected_indices)
    order = greedy_candidates(kernels.bf16_linear_race, x, packed, k=64)[1].tolist()
    assert all(row.index(5) < row.index(300) for row in order)
