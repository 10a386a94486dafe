"""GGUF block formats served in their own blocks: read bit-exactly as gguf reads them, multiplied as llama.cpp
multiplies them, and put into the model untouched."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from fiberserve import kernels
from fiberserve.bench.block_quantizers import quantize_blocks
from fiberserve.model import LlamaModel, load_checkpoint
from fiberserve.model.block_formats import NATIVE_BITS
from fiberserve.model.gguf_rows import GgufRows
from fiberserve.model.linear import QuantLinear, quant_kernel_available
from fiberserve.model.quant_blocks import QUANT_GROUP, QuantBlocks
from tests.tiny_models import TINY, random_weights, write_gguf

FORMATS = sorted(NATIVE_BITS)


def file_tensor(kind: str, rows: int = 48, inputs: int = 256, seed: int = 0) -> np.ndarray:
    """A matrix quantized into ``kind``'s bytes, [rows, bytes per row]: by gguf, or for the formats gguf cannot write
    (the K formats, IQ4_NL) by fiberserve/bench/block_quantizers.py."""
    rng = np.random.default_rng(seed)
    weight = rng.normal(0, 0.1, (rows, inputs)).astype(np.float32)
    weight[:, :5] *= 20  # a few large values: blocks whose scale and min differ
    return quantize_blocks(weight, kind)


@pytest.mark.parametrize("kind", FORMATS)
def test_blocks_dequantize_bit_exactly_as_gguf_does(kind):
    raw = file_tensor(kind)
    blocks = QuantBlocks.from_gguf(raw, kind)
    assert blocks.bits == NATIVE_BITS[kind] and int(blocks.q.max()) < 2**blocks.bits
    assert torch.equal(blocks.dequantize(), torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[kind])))
    # w == scale * q + min too, with min exactly -zero * scale where the format has a zero; scales kept in float16
    # where the format's are float16 values
    if not blocks.float32_scales:
        assert torch.equal(blocks.scale.half().float(), blocks.scale)
        assert torch.equal(blocks.min.half().float(), blocks.min)
    grouped = blocks.q.float().view(48, -1, blocks.group)
    wide = blocks.scale[..., None] * grouped + blocks.min[..., None]
    torch.testing.assert_close(wide.view(48, -1), blocks.dequantize(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_files_rows_pack_in_one_pass_to_what_unpacking_then_packing_gives(kind):
    """GgufRows.pack (the C++ pack_gguf_blocks, 16 rows at a time) gives quant_pack's tensors of the unpacked
    blocks, bit for bit, for every format; the file's rows joined or reordered as stored unpack to the blocks
    joined or reordered."""
    raw = np.concatenate([file_tensor(kind, seed=1), file_tensor(kind, rows=16, seed=2)])
    for ours, theirs in zip(
        GgufRows(raw, kind).pack(), kernels.quant_pack(QuantBlocks.from_gguf(raw, kind)), strict=True
    ):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    first, second = GgufRows(raw[:48], kind), GgufRows(raw[48:], kind)
    joined = GgufRows.combine([second, first], lambda parts: torch.cat(parts).flip(0)).unpack()
    expected = QuantBlocks.cat([QuantBlocks.from_gguf(raw[48:], kind), QuantBlocks.from_gguf(raw[:48], kind)])
    assert torch.equal(joined.dequantize(), expected.dequantize().flip(0))


def test_rows_of_the_files_mapping_are_released_once_read_into_memory_of_their_own():
    raw, released = file_tensor("Q4_0"), []
    rows = GgufRows(raw, "Q4_0", lambda: released.append(1))
    assert rows.map_rows(lambda t: t) is not None and released == []  # the same bytes: still the mapping's
    moved = rows.map_rows(lambda t: t.flip(0))
    assert released == [1] and not np.may_share_memory(moved.raw, raw)
    moved.unpack()
    assert released == [1]


def test_k_formats_keep_their_scales_exactly_in_float32():
    """Q4_K's d x 6-bit scale is not a float16 value in general; the blocks keep the product exactly."""
    blocks = QuantBlocks.from_gguf(file_tensor("Q4_K"), "Q4_K")
    assert blocks.float32_scales and not torch.equal(blocks.scale.half().float(), blocks.scale)
    assert QuantBlocks.from_gguf(file_tensor("Q6_K"), "Q6_K").group == 16


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_formats_keep_their_files_factors_and_pack_them_at_their_size(kind):
    """A K format's scales are its super-block's float16 times each group's integer step, kept as the file has
    them: packed, the scales and mins take 16 bits per super-block and 8 per group (Q4_K 4.6 bits a weight)."""
    blocks = QuantBlocks.from_gguf(file_tensor(kind), kind)
    own = blocks.supers
    assert own is not None and own.steps.dtype == torch.int8
    per_super = 256 // blocks.group
    assert torch.equal(own.d.float().repeat_interleave(per_super, -1) * own.steps.float(), blocks.scale)
    if own.dmin is not None:
        assert torch.equal(own.dmin.float().repeat_interleave(per_super, -1) * own.min_steps.float(), blocks.min)
    if quant_kernel_available():
        weights, scales, mins = kernels.quant_pack(blocks)
        factor_bits = 8 * (scales.numel() + mins.numel()) / blocks.q.numel()
        assert factor_bits == {"Q2_K": 1.125, "Q3_K": 0.5625, "Q4_K": 0.625, "Q5_K": 0.625, "Q6_K": 0.5625}[kind]
        assert weights.numel() * 8 / blocks.q.numel() == blocks.bits


@pytest.mark.skipif(not quant_kernel_available(), reason="the extension's kernel needs AVX512-VNNI or AVX2")
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_k_formats_multiply_in_their_own_factors_with_the_bits_of_their_float32_scales(kind):
    """The kernel computes each group's scale and min from the factors as float32 products, exactly the float32
    scales and mins the blocks also hold, so the products have the same bits either way."""
    blocks = QuantBlocks.from_gguf(file_tensor(kind, rows=64, inputs=512), kind)
    own, wide = kernels.quant_pack(blocks), kernels.quant_pack(dataclasses.replace(blocks, supers=None))
    assert own[1].dtype == torch.int8 and wide[1].dtype == torch.float32
    x = torch.randn(13, 512).bfloat16()
    for rows in (1, 2, 6, 13):
        for out in (torch.float32, torch.bfloat16):
            assert torch.equal(
                kernels.quant_linear(x[:rows], *own, None, out), kernels.quant_linear(x[:rows], *wide, None, out)
            )


def test_blocks_of_different_formats_stack_into_one_holding_each_ones_weights():
    """Q4_K_M files keep some v and down projections in Q6_K: stacked with Q4_K blocks (qkv), every part's weights
    are unchanged; two 4-bit formats stay 4-bit."""
    kinds = ["Q4_K", "Q6_K", "Q8_0"]
    parts = [QuantBlocks.from_gguf(file_tensor(kind, seed=i), kind) for i, kind in enumerate(kinds)]
    stacked = QuantBlocks.cat(parts)
    assert (stacked.bits, stacked.group) == (8, 16)
    exact = stacked.scale.double().repeat_interleave(
        16, -1
    ) * stacked.q.double() + stacked.min.double().repeat_interleave(16, -1)
    assert torch.equal(exact.float(), torch.cat([p.dequantize() for p in parts]))  # each rounded once
    four = QuantBlocks.cat([parts[0], QuantBlocks.from_gguf(file_tensor("Q4_0"), "Q4_0")])
    assert four.bits == 4 and four.float32_scales


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_quantizing_a_files_weights_gives_its_own_blocks_back(kind):
    raw = file_tensor(kind)
    own = QuantBlocks.from_gguf(raw, kind)
    again = QuantBlocks.quantize(own.dequantize(), own.bits)
    assert torch.equal(again.q, own.q) and torch.equal(again.scale, own.scale) and torch.equal(again.min, own.min)


@pytest.mark.parametrize("kind", FORMATS)
def test_the_product_is_the_blocks_times_int8_activations(kind):
    if NATIVE_BITS[kind] == 8 and not quant_kernel_available():
        pytest.skip("8-bit blocks need the extension's kernel (AVX512-VNNI or AVX2)")
    blocks = QuantBlocks.from_gguf(file_tensor(kind), kind)
    weight = blocks.dequantize()
    x = torch.randn(5, weight.shape[1])
    layer = QuantLinear(blocks, dtype=torch.float32)
    if layer.native:  # llama.cpp's arithmetic: activations in int8 per block of 32
        grouped = x.view(5, -1, QUANT_GROUP)
        step = grouped.abs().amax(-1, keepdim=True) / 127
        x = (torch.round(grouped / step) * step).view(5, -1)
    torch.testing.assert_close(layer(x), x @ weight.T, atol=1e-4, rtol=1e-4)
    assert torch.equal(layer(x[:1]), layer(x)[:1])


@pytest.mark.parametrize("kind", FORMATS)
def test_a_file_in_a_served_format_runs_in_its_own_blocks(tmp_path, kind):
    if NATIVE_BITS[kind] == 8 and not quant_kernel_available():
        pytest.skip("8-bit blocks need the extension's kernel (AVX512-VNNI or AVX2)")
    cfg = {**TINY, "hidden_size": 256, "intermediate_size": 512}  # K formats quantize rows of 256
    path = write_gguf(tmp_path / "q.gguf", cfg, random_weights(cfg, seed=5), qtype=gguf.GGMLQuantizationType[kind])
    checkpoint = load_checkpoint(path)
    model = LlamaModel(checkpoint, torch.bfloat16, quantization="int4")
    own = checkpoint.weights.blocks("model.layers.1.mlp.down_proj.weight").unpack()
    assert own is not None
    down = model.layers[1].down
    if down.native:
        packed = kernels.quant_pack(own)
        assert torch.equal(down.weight, packed[0]) and torch.equal(down.scales, packed[1])
    # the whole model: close to the file's weights computed in float32
    tokens = [5, 17, 200, 3, 99, 42, 7]
    from tests.unit.test_model_math import logits_of

    exact = logits_of(LlamaModel(load_checkpoint(path)), tokens)
    assert (logits_of(model, tokens) - exact).abs().max() < 0.2


@pytest.mark.skipif(not quant_kernel_available(), reason="the extension's kernel needs AVX512-VNNI or AVX2")
def test_a_qkv_of_two_formats_runs_each_part_in_its_own(tmp_path):
    """Q4_K_M files keep some layers' v in Q6_K beside Q4_K q and k: those qkv run as two products, each in its
    file's format (not widened to bytes with float32 scales and mins); the C++ layer loop gives the Python loop's
    logits bit for bit, and both are close to the file's weights in float32."""
    from fiberserve.model.linear import StackedLinear
    from tests.unit.test_model_math import logits_of

    cfg = {**TINY, "hidden_size": 256, "intermediate_size": 512}

    def kind(name: str) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType.Q6_K if name.endswith("attn_v.weight") else gguf.GGMLQuantizationType.Q4_K

    path = write_gguf(tmp_path / "m.gguf", cfg, random_weights(cfg, seed=3), qtype=kind)
    model = LlamaModel(load_checkpoint(path), torch.bfloat16, quantization="int4")
    qkv = model.layers[0].qkv
    assert isinstance(qkv, StackedLinear) and [p.weight.dim() for p in qkv.parts] == [5, 5]  # 4-bit and 6-bit
    assert [p.scales.dtype for p in qkv.parts] == [torch.int8, torch.int8]
    assert model.native_layers is not None and model.native_layers[-1][0] == 2
    tokens = [5, 17, 200, 3, 99, 42, 7]
    native = logits_of(model, tokens)
    model.native_layers = None
    assert torch.equal(native, logits_of(model, tokens))
    exact = logits_of(LlamaModel(load_checkpoint(path)), tokens)
    assert (native - exact).abs().max() < 0.2


@pytest.mark.skipif(not quant_kernel_available(), reason="the extension's kernel needs AVX512-VNNI or AVX2")
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_large_head_is_packed_a_few_rows_at_a_time_into_the_same_tensors(tmp_path, monkeypatch, kind):
    """The head's blocks are read and packed ROWS_AT_ONCE rows at a time (never whole as bytes), into exactly
    the tensors packing them whole gives."""
    from fiberserve.model import gguf_rows

    cfg = {**TINY, "hidden_size": 256, "intermediate_size": 512}
    path = write_gguf(tmp_path / "m.gguf", cfg, random_weights(cfg, seed=4), qtype=gguf.GGMLQuantizationType[kind])
    checkpoint = load_checkpoint(path)
    head = "model.embed_tokens.weight" if "lm_head.weight" not in checkpoint.weights else "lm_head.weight"
    whole = kernels.quant_pack(checkpoint.weights.blocks(head).unpack())
    monkeypatch.setattr(gguf_rows, "ROWS_AT_ONCE", 48)  # 256 rows: 5 whole pieces and a short one
    model = LlamaModel(load_checkpoint(path), torch.bfloat16, quantization="int4")
    assert model.head.linear.out_features == cfg["vocab_size"] == 256
    for ours, theirs in zip(model.head.linear.packed_tensors(), whole, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("tied", [False, True])
def test_int4_reads_embedding_and_head_rows_from_the_file_with_the_same_bits(tmp_path, tied):
    """No copy of the embedding or the head in memory: their rows are dequantized from the file's blocks when
    looked up or re-scored, and every logit and pick is what the matrices read whole give."""
    if not quant_kernel_available():
        pytest.skip("8-bit blocks need the extension's kernel (AVX512-VNNI or AVX2)")
    from fiberserve.model.file_rows import FileRows
    from tests.unit.test_model_math import PAGE, KVCache, prefill_batch

    cfg = {**TINY, "hidden_size": 256, "intermediate_size": 512, "tie_word_embeddings": tied}
    weights = random_weights(cfg, seed=9)
    path = write_gguf(tmp_path / "q.gguf", cfg, weights, qtype=gguf.GGMLQuantizationType.Q8_0)
    model = LlamaModel(load_checkpoint(path), torch.bfloat16, quantization="int4")
    assert isinstance(model.embed, FileRows) and isinstance(model.head.rows, FileRows)
    assert (model.head.rows is model.embed) == tied
    whole = LlamaModel(load_checkpoint(path), torch.bfloat16, quantization="int4")
    ck = load_checkpoint(path)
    whole.embed = ck.weights.read_as("model.embed_tokens.weight", torch.bfloat16)
    whole.head.rows = whole.embed if tied else ck.weights.read_as("lm_head.weight", torch.bfloat16)
    tokens = torch.tensor([[5, 17, 5], [200, 3, 99]])
    assert torch.equal(model.embed[tokens], whole.embed[tokens])
    seqs = [([5, 17, 200, 3, 99, 42, 7], list(range(8))), ([9, 9, 1], list(range(8, 16)))]
    for m in (model, whole):
        m.cache = KVCache(m.config, 16, PAGE, m.dtype, "cpu")
    logits = model.forward(prefill_batch(seqs), model.cache)
    assert torch.equal(logits, whole.forward(prefill_batch(seqs), whole.cache))
    assert model.pick(prefill_batch(seqs), model.cache) == whole.pick(prefill_batch(seqs), whole.cache)
    for seed in range(8):  # sampled rows too: the race's draws over the re-scored candidates
        rows = logits.shape[0]
        race = torch.linspace(0.5, 2.0, rows), torch.arange(rows) + 100 * seed
        assert model.pick(prefill_batch(seqs), model.cache, race) == whole.pick(prefill_batch(seqs), whole.cache, race)


def mapped_kib(path) -> int:
    """KiB of ``path`` mapped into this process's memory (its pages resident through a mapping)."""
    total, current = 0, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                current = parts[-1]
            elif parts and parts[0] == "Rss:" and current == str(path):
                total += int(parts[1])
    return total


def test_embedding_rows_are_read_from_the_file_without_mapping_its_pages(tmp_path):
    """A lookup reads its rows' bytes with positioned reads: the rows gguf's view of the mapping holds, and no
    page of the file becomes resident in this process (a read through the mapping brings the pages around it)."""
    from fiberserve.model.gguf_file import GgufFile

    cfg = {**TINY, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 4096}
    path = write_gguf(tmp_path / "m.gguf", cfg, random_weights(cfg, seed=2), qtype=gguf.GGMLQuantizationType.Q4_K)
    file = GgufFile(path)
    embedding = next(t for t in file.tensors if t.name == "token_embd.weight")
    index = np.array([4095, 7, 7, 0, 1234])
    file.release(embedding)
    before = mapped_kib(path)
    rows = file.read_rows(embedding, index)
    assert mapped_kib(path) == before
    assert np.array_equal(rows, embedding.data[index])


def descriptors_of(path: Path) -> int:
    """How many of this process's file descriptors refer to ``path`` (not a count of all of them, which other
    tests' objects change as the collector closes them)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # a descriptor closed since the listing
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path.resolve())
    return count


def test_the_row_reads_file_is_closed_with_the_gguf_file(tmp_path):
    import gc

    from fiberserve.model.gguf_file import GgufFile

    path = write_gguf(tmp_path / "m.gguf", TINY, random_weights(TINY, seed=1), qtype=gguf.GGMLQuantizationType.Q8_0)
    file = GgufFile(path)
    embedding = next(t for t in file.tensors if t.name == "token_embd.weight")
    file.read_rows(embedding, np.array([1, 2]))
    assert descriptors_of(Path(path)) >= 1
    del file, embedding
    gc.collect()
    assert descriptors_of(Path(path)) == 0


def test_asking_whether_a_checkpoint_has_a_tensor_reads_nothing():
    """``name in weights`` is a lookup: a Mapping's default test reads the tensor (an 8B head: 2 GB in float32)."""
    from fiberserve.model.loader import LazyWeights

    def unreadable() -> torch.Tensor:
        raise AssertionError("read")

    weights = LazyWeights()
    weights.add("lm_head.weight", unreadable)
    assert "lm_head.weight" in weights and "model.norm.weight" not in weights


def test_file_rows_hand_over_the_table_a_lookup_grew_for_more_rows_than_it_held():
    """A lookup of more distinct rows than the table holds (a long prompt's logits re-scored: 512 rows x 8
    candidates) gets the grown table with its places, not the table it replaced."""
    from fiberserve.model.file_rows import CACHED_ROWS, FileRows

    matrix = torch.randn(3 * CACHED_ROWS, 16)
    rows = FileRows(lambda index: matrix[torch.from_numpy(index)], len(matrix), 16, torch.float32)
    rows[torch.arange(10)]  # a table in use
    index = torch.randperm(len(matrix))[: 2 * CACHED_ROWS].view(-1, 8)
    table, places = rows.table_rows(index)
    assert table.shape[0] >= 2 * CACHED_ROWS and torch.equal(table[places], matrix[index])
