"""The quantized KV cache (--kv-cache-dtype fp8_e4m3 / q8_0): the formats' arithmetic, the kernels' stores and
reads of them (bit for bit against the Python side), and the model over such a cache."""

import pytest
import torch

from fiberserve import kernels
from fiberserve.model.kv_format import FP8_MAX, Q8_BLOCK, dequantize, kv_format

from .test_kernels import PAGE, attention_case

QUANTIZED = ["fp8_e4m3", "q8_0"]


def test_q8_0_rows_are_blocks_of_32_int8_with_a_float16_scale_each():
    x = torch.tensor([[0.5, -1.0, 0.25, 2.0] * 8 + [0.0] * 32]).to(torch.bfloat16)  # a zero block: scale 0
    stored = kv_format("q8_0", torch.bfloat16).quantize(x)
    assert stored.dtype == torch.int8 and stored.shape == (1, 64 + 4)
    scales = stored[0, 64:].view(torch.float16).float()
    assert scales.tolist() == [torch.tensor(2.0 / 127).half().item(), 0.0]
    assert stored[0, :4].tolist() == [32, -64, 16, 127] and not stored[0, 32:64].any()
    back = dequantize(stored, 64, torch.float32)
    assert back.shape == (1, 64) and back[0, 3] == 127 * scales[0] and not back[0, 32:].any()
    assert (back - x.float()).abs().max() <= scales[0] / 2  # within half a step


def test_fp8_rows_round_to_e4m3_and_saturate():
    x = torch.tensor([1.0, 1.0625, 1.1875, -3.0, 500.0, -1e4, 2.0**-9, 0.0]).to(torch.bfloat16)
    back = dequantize(kv_format("fp8_e4m3", torch.bfloat16).quantize(x), 8, torch.float32)
    # 1.0625 is halfway between 1 and 1.125 (ties to even), 1.1875 to 1.25; +-448 the largest; 2^-9 the least
    assert back.tolist() == [1.0, 1.0, 1.25, -3.0, FP8_MAX, -FP8_MAX, 2.0**-9, 0.0]


def test_a_format_that_needs_another_model_dtype_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--kv-cache-dtype bf16"):
        kv_format("bf16", torch.float32)
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        kv_format("int4", torch.bfloat16)
    assert kv_format("auto", torch.float32).storage == torch.float32


def quantized_case(name: str, dtype: torch.dtype, head_dim: int):
    q, k, v, tables, spans, keys = attention_case(dtype, head_dim)
    storage = kv_format(name, dtype)
    return q, storage.quantize(k * 3), storage.quantize(v), tables, spans, keys


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", QUANTIZED)
def test_attention_over_a_quantized_cache_is_the_float32_path_over_its_dequantized_rows(name, dtype, head_dim):
    """Rows are dequantized exactly as they are read: the bits of float32 attention over the dequantized cache."""
    q, k, v, tables, spans, keys = quantized_case(name, dtype, head_dim)
    out = kernels.paged_attention(q, k, v, tables, spans, keys, PAGE, 0.125)
    wide_k, wide_v = dequantize(k, head_dim, torch.float32), dequantize(v, head_dim, torch.float32)
    expected = kernels.paged_attention(q.float(), wide_k, wide_v, tables, spans, keys, PAGE, 0.125)
    assert out.dtype == dtype and torch.equal(out, expected.to(dtype))


@pytest.mark.parametrize("name", QUANTIZED)
def test_attention_over_a_quantized_cache_keeps_rows_batch_invariant(name):
    q, k, v, tables, spans, keys = quantized_case(name, torch.bfloat16, 64)
    batch = kernels.paged_attention(q, k, v, tables, spans, keys, PAGE, 0.125)
    for row in range(q.shape[0]):
        one = slice(row, row + 1)
        table = tables[spans[one].long().clamp(min=0)]
        alone = kernels.paged_attention(q[one], k, v, table, spans[one].clamp(max=0), keys[one], PAGE, 0.125)
        assert torch.equal(alone[0], batch[row])


@pytest.mark.parametrize("name", QUANTIZED)
def test_rope_store_quantizes_as_the_python_side(name):
    """The kernel's store of rotated keys and values: the Python format's quantization of the rows a model-dtype
    cache would hold, bit for bit."""
    torch.manual_seed(3)
    heads, kv_heads, dim, rows = 4, 2, 64, 3
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim) * 4).to(torch.bfloat16)
    qkv[1, (heads + kv_heads) * dim :] = 0  # an all-zero value row: zero scales
    positions = torch.tensor([5, 0, 9])
    angles = torch.outer(torch.arange(16.0), 1.0 / (10000 ** (torch.arange(0, dim, 2) / dim)))
    cos, sin = angles.cos().repeat(1, 2), torch.cat([-angles.sin(), angles.sin()], dim=1)
    storage = kv_format(name, torch.bfloat16)
    width = storage.row_width(dim)
    k_cache = torch.zeros(20, kv_heads, width, dtype=storage.storage)
    v_cache = torch.zeros_like(k_cache)
    model_k = torch.zeros(20, kv_heads, dim, dtype=torch.bfloat16)
    model_v = torch.zeros_like(model_k)
    slots = torch.tensor([7, 3, 11])
    q = kernels.rope_store(qkv, positions, cos, sin, slots[:2], k_cache, v_cache, heads)
    model_q = kernels.rope_store(qkv, positions, cos, sin, slots[:2], model_k, model_v, heads)
    assert torch.equal(q, model_q)
    for cache, model in ((k_cache, model_k), (v_cache, model_v)):
        assert torch.equal(cache[slots[:2]].view(torch.uint8), storage.quantize(model[slots[:2]]).view(torch.uint8))
        assert not cache[slots[2]].view(torch.uint8).any()  # the padding row wrote nothing


@pytest.mark.parametrize("name", ["auto", *QUANTIZED])
def test_the_cache_stores_rows_in_its_format_at_their_slots(name):
    """KVCache.store (the layer loop in PyTorch ops: Gemma's, a GPU's) writes each format's rows, nothing else."""
    from fiberserve.model import KVCache
    from fiberserve.model.config import ModelConfig
    from tests.tiny_models import TINY

    config = ModelConfig.from_hf(dict(TINY, model_type="llama", num_attention_heads=2, num_key_value_heads=1))
    storage = kv_format(name, torch.bfloat16)
    cache = KVCache(config, 4, PAGE, storage, "cpu")
    keys = torch.randn(2, config.num_kv_heads, config.head_dim).to(torch.bfloat16)
    slots = torch.tensor([5, 13])
    cache.store(1, slots, keys, -keys)
    for stored, rows in ((cache.k, keys), (cache.v, -keys)):
        assert torch.equal(stored[1, slots].view(torch.uint8), storage.quantize(rows).view(torch.uint8))
        assert not stored[0].view(torch.uint8).any() and stored[1].view(torch.uint8).count_nonzero() > 0
        assert not stored[1, [s for s in range(4 * PAGE) if s not in (5, 13)]].view(torch.uint8).any()


def test_a_q8_0_cache_needs_head_dim_in_blocks_of_32():
    q = torch.randn(1, 2, 16, dtype=torch.bfloat16)
    k = torch.zeros(PAGE, 2, 16 + 16 // Q8_BLOCK * 2, dtype=torch.int8)
    table, span, keys = (
        torch.zeros(1, 1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
    )
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.paged_attention(q, k, k, table, span, keys, PAGE, 0.25)
