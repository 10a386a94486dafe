"""LoRA adapters in the model: transformers + PEFT's logits, llama.cpp's GGUF adapters, mixed batches bit for bit,
and bad adapters named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fiberserve.model import KVCache, LlamaModel, load_checkpoint
from fiberserve.model.lora import (
    PANEL,
    LoraAdapter,
    LoraError,
    LoraRows,
    LowRank,
    Placement,
    from_panels,
    in_panels,
)
from tests.lora_adapters import EVERY_TARGET, write_gguf_adapter, write_peft_adapter
from tests.tiny_models import TINY, random_weights, write_hf
from tests.unit.test_model_math import PAGE, TOKENS, prefill_batch


def adapter_logits(model: LlamaModel, adapter: LoraAdapter | None, tokens: list[int]) -> torch.Tensor:
    cache = KVCache(model.config, 64, PAGE, model.dtype, "cpu")
    batch = prefill_batch([(tokens, list(range(64)))])
    if adapter is not None:
        batch.lora = LoraRows([(adapter, torch.arange(len(tokens)))])
    return model.forward(batch, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_adds_the_low_rank_product_to_its_rows_only_each_row_alone_in_its_bits(dtype):
    """Two parts (ranks 3 and 5, their coordinates rounded to the adapter's dtype) into columns 0:32 and 48:64 of
    rows 1 and 3; the other rows and columns keep their bits; a row added alone gets the bits it gets beside
    others."""
    from fiberserve import kernels

    kernels.load()
    torch.manual_seed(4)
    x = torch.randn(5, 48).to(dtype)
    a = torch.randn(8, 48).to(dtype)
    b1, b2 = torch.randn(32, 3).to(dtype), torch.randn(16, 5).to(dtype)
    bt = torch.cat([in_panels(b1.t()), in_panels(b2.t())])
    assert torch.equal(from_panels(bt[:96], 3), b1.t()) and torch.equal(from_panels(bt[96:], 5), b2.t())
    layout = [0, 32, 0, 3, 0, 48, 64, 3, 8, 96]
    out = torch.randn(5, 64).to(dtype)
    before = out.clone()
    rows = torch.tensor([3, 1])
    kernels.lora_add(out, x, [rows], [a], [bt], [2, *layout])
    coordinates = (x.float() @ a.float().t()).to(dtype).float()
    expected = before.float().clone()  # (a float32 tensor's .float() is itself)
    expected[:, :32] += coordinates[:, :3] @ b1.float().t()
    expected[:, 48:64] += coordinates[:, 3:] @ b2.float().t()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[rows].float(), expected[rows], atol=tolerance, rtol=tolerance)
    assert torch.equal(out[[0, 2, 4]], before[[0, 2, 4]]) and torch.equal(out[rows, 32:48], before[rows, 32:48])
    alone = before.clone()
    kernels.lora_add(alone, x, [torch.tensor([1])], [a], [bt], [2, *layout])
    assert torch.equal(alone[1], out[1])
    with pytest.raises(RuntimeError, match="part 1 does not fit"):
        kernels.lora_add(out, x, [rows], [a], [bt[:-1]], [2, *layout])


@pytest.mark.parametrize("columns", [32, 24])
def test_a_low_rank_addition_adds_the_same_through_the_kernel_or_pytorch(columns):
    """A product of 32 columns runs in lora_add (B^T in panels), one of 24 in PyTorch's products (B^T whole): either
    adds scale-free ``(x a^T) b^T`` of each part to its columns of the given rows only."""
    torch.manual_seed(7)
    parts = [
        (Placement("qkv", 0, columns, 48), torch.randn(3, 48), torch.randn(columns, 3)),
        (Placement("qkv", columns, 2 * columns, 48), torch.randn(5, 48), torch.randn(columns, 5)),
    ]
    low = LowRank(parts, torch.float32)
    assert low.kernel_fits == (columns % PANEL == 0)
    x, out = torch.randn(4, 48), torch.randn(4, 2 * columns)
    before, rows = out.clone(), torch.tensor([2, 0])
    low.add_to(out, x, rows)
    expected = before.clone()
    for place, a, b in parts:
        expected[rows, place.start : place.end] += (x[rows] @ a.T) @ b.T
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[[1, 3]], before[[1, 3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_of_several_groups_in_one_pass_gives_each_row_its_bits_alone(dtype):
    """Three adapters' groups (1, 4 and 7 rows, in tiles of any size) in one call: every row gets the bits it gets
    added alone; rows of no group keep theirs."""
    from fiberserve import kernels

    kernels.load()
    torch.manual_seed(5)
    width, columns, rank = 64, 96, 16
    x = torch.randn(16, width).to(dtype)
    before = torch.randn(16, columns)
    groups = [torch.tensor([9]), torch.tensor([0, 5, 2, 7]), torch.tensor([15, 1, 3, 4, 12, 11, 6])]
    weights = [(torch.randn(rank, width).to(dtype), torch.randn(rank * columns).to(dtype)) for _ in groups]
    layout = [1, 0, columns, 0, rank, 0]
    together = before.clone()
    kernels.lora_add(together, x, groups, [a for a, _ in weights], [bt for _, bt in weights], layout * 3)
    for rows, (a, bt) in zip(groups, weights, strict=True):
        for row in rows.tolist():
            alone = before.clone()
            kernels.lora_add(alone, x, [torch.tensor([row])], [a], [bt], layout)
            assert torch.equal(alone[row], together[row]), row
    untouched = [8, 10, 13, 14]
    assert torch.equal(together[untouched], before[untouched])
    with pytest.raises(RuntimeError, match="layout is shorter"):
        kernels.lora_add(together, x, groups, [a for a, _ in weights], [bt for _, bt in weights], layout * 2)


@pytest.mark.parametrize("rank", [8, 64])
@pytest.mark.parametrize("base", ["hf", "gguf"])
def test_an_adapter_gives_transformers_peft_logits_on_the_merged_model(tiny_dirs, tmp_path, rank, base):
    """Every target module (q, k, v, o, gate, up, down) at ranks 8 and 64, over the model read from its Hugging
    Face directory and from its GGUF file (whose q and k rows the loader un-permutes)."""
    merged = write_peft_adapter(tiny_dirs["hf"], tmp_path / "adapter", rank, alpha=2 * rank, targets=EVERY_TARGET)
    model = LlamaModel(load_checkpoint(tiny_dirs[base]))
    adapter = LoraAdapter.load("tuned", tmp_path / "adapter", model.config, model.dtype, max_rank=64)
    assert adapter.rank == rank and all(set(layer) == {"qkv", "o", "gate_up", "down"} for layer in adapter.layers)
    with torch.no_grad():
        reference = merged(torch.tensor([TOKENS])).logits[0]
    ours = adapter_logits(model, adapter, TOKENS)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
    assert (ours - adapter_logits(model, None, TOKENS)).abs().max() > 0.05  # the adapter changes the answer


def test_llama_cpp_s_gguf_adapter_gives_the_peft_adapter_s_logits(tiny_dirs, tmp_path):
    write_peft_adapter(tiny_dirs["hf"], tmp_path / "peft", 8, alpha=16, targets=EVERY_TARGET, seed=4)
    heads = (TINY["num_attention_heads"], TINY["num_key_value_heads"])
    gguf_file = write_gguf_adapter(tmp_path / "peft", tmp_path / "adapter.gguf", alpha=16, heads=heads)
    model = LlamaModel(load_checkpoint(tiny_dirs["gguf"]))
    peft = LoraAdapter.load("peft", tmp_path / "peft", model.config, model.dtype, max_rank=8)
    ours = LoraAdapter.load("gguf", gguf_file, model.config, model.dtype, max_rank=8)
    torch.testing.assert_close(
        adapter_logits(model, ours, TOKENS), adapter_logits(model, peft, TOKENS), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("second_targets", [EVERY_TARGET, ["v_proj", "gate_proj"]], ids=["every", "gate-not-up"])
@pytest.mark.parametrize("quantization", ["int4", "none"])
def test_mixed_adapters_in_one_batch_keep_every_row_s_bits(tmp_path, quantization, second_targets):
    """A flight of sequences under two adapters and the base model, prefill chunks beside decode tokens: each
    row's logits are the bits it gets alone (the base alone runs the C++ layer loop with no LoRA), the C++ loop
    adds the adapters as the Python loop does, bit for bit (the gate/up additions in the gated int4 or bf16
    kernel's epilogue, whose buffer is written where the adapters add to both gate and up, zeroed first where one
    adds to gate only), and an adapter of scale 0 gives the base model's bits."""
    from fiberserve import kernels
    from fiberserve.model.linear import quant_kernel_available

    kernels.load()
    if quantization == "int4" and not quant_kernel_available():
        pytest.skip("the int4 products need AVX512-VNNI or AVX2")
    if quantization == "none" and not kernels.bf16_gemm_available():
        pytest.skip("the bf16 products need AVX512-BF16 or AVX2")
    base = write_hf(tmp_path / "m", TINY, random_weights(TINY))
    for name, seed, alpha, targets in (
        ("one", 1, 16, EVERY_TARGET),
        ("two", 2, 8, second_targets),
        ("zero", 3, 0, EVERY_TARGET),
    ):
        write_peft_adapter(base, tmp_path / name, 8, alpha, targets, seed)
    dtype = torch.bfloat16 if quantization == "none" or kernels.bf16_gemm_available() else torch.float32
    model = LlamaModel(load_checkpoint(base), dtype, quantization=quantization)
    assert model.native_layers is not None
    one, two, zero = (LoraAdapter.load(n, tmp_path / n, model.config, dtype, 8) for n in ("one", "two", "zero"))
    assert zero.layers == [{}, {}]  # a zero addition is none
    a, b, c = TOKENS * 2, TOKENS[:7], TOKENS[2:] + TOKENS
    pages = {"a": [3, 1, 4, 0, 5, 9], "b": [2, 6], "c": [7, 8, 10, 11, 12, 13]}
    tokens = {"a": a, "b": b, "c": c}
    adapters = {"a": one, "b": None, "c": two}

    def run(names: list[str], adapters: dict) -> dict[str, torch.Tensor]:
        """Prefill the first 6 tokens of each, then the rest in one chunk beside the others' next decode token;
        the logits of each sequence's rows of both passes."""
        cache = KVCache(model.config, 16, PAGE, dtype, "cpu")
        out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        for start, end in ((0, 6), (6, None)):
            seqs = [(tokens[n][: end or (len(tokens[n]) if n == "a" else start + 1)], pages[n]) for n in names]
            batch = prefill_batch(seqs, [start] * len(names))
            groups, row = [], 0
            for n, (toks, _) in zip(names, seqs, strict=True):
                if adapters[n] is not None:
                    groups.append((adapters[n], torch.arange(row, row + len(toks) - start)))
                row += len(toks) - start
            batch.lora = LoraRows(groups)
            logits, row = model.forward(batch, cache), 0
            for n, (toks, _) in zip(names, seqs, strict=True):
                out[n].append(logits[row : row + len(toks) - start])
                row += len(toks) - start
        return {n: torch.cat(parts) for n, parts in out.items()}

    assert one.kernel_layout is not None and two.kernel_layout is not None  # the C++ layer loop adds them
    together = run(["a", "b", "c"], adapters)
    for name in "abc":
        assert torch.equal(run([name], adapters)[name], together[name]), name
    native, model.native_layers = model.native_layers, None  # the Python layer loop: the same additions
    in_python = run(["a", "b", "c"], adapters)
    model.native_layers = native
    for name in "abc":
        torch.testing.assert_close(in_python[name], together[name], atol=0, rtol=0)
    assert not torch.equal(together["a"][:6], run(["a"], {"a": None})["a"][:6])
    assert torch.equal(run(["b"], {"b": zero})["b"], together["b"])


def test_adapters_that_do_not_fit_are_named(tiny_dirs, tmp_path):
    model = LlamaModel(load_checkpoint(tiny_dirs["hf"]))
    write_peft_adapter(tiny_dirs["hf"], tmp_path / "good", 16, 16, ["q_proj", "v_proj"])

    def error_of(path: Path, max_rank: int = 64) -> str:
        with pytest.raises(LoraError) as caught:
            LoraAdapter.load("x", path, model.config, model.dtype, max_rank)
        return str(caught.value)

    assert "no such adapter" in error_of(tmp_path / "missing")
    assert "rank 16 is over --max-lora-rank 8" in error_of(tmp_path / "good", max_rank=8)
    other = dict(TINY, hidden_size=128, intermediate_size=256)  # a model of other shapes
    write_peft_adapter(write_hf(tmp_path / "other", other, random_weights(other)), tmp_path / "wide", 8, 8, ["q_proj"])
    assert "another base model" in error_of(tmp_path / "wide")
    assert "wide/adapter_model.safetensors: layer 0 q_proj" in error_of(tmp_path / "wide")
    write_peft_adapter(tiny_dirs["hf"], tmp_path / "head", 8, 8, ["lm_head"])
    assert "unexpected tensor 'base_model.model.lm_head." in error_of(tmp_path / "head")  # not a decoder layer's
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 8}))
    (tmp_path / "cut" / "adapter_model.safetensors").write_bytes(b"\x10\x00")
    assert "cannot be read" in error_of(tmp_path / "cut")
    (tmp_path / "not.gguf").write_bytes(b"GGUF\x03\x00")
    assert "not.gguf: not a GGUF file" in error_of(tmp_path / "not.gguf")
    assert "not a GGUF LoRA adapter" in error_of(tiny_dirs["gguf"])
