"""The model layer on tiny random models: loaders agree, logits match transformers, batching is exact."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fiberserve.model import ForwardBatch, KVCache, LlamaModel, SequenceSpan, UnsupportedModelError, load_checkpoint
from tests.tiny_models import TINY, random_weights, write_gguf, write_hf

PAGE = 4


def prefill_batch(seqs: list[tuple[list[int], list[int]]], start: list[int] | None = None) -> ForwardBatch:
    """seqs: (tokens of the whole sequence, its pages); computes tokens[start:] for each."""
    tokens, positions, write, spans, rows = [], [], [], [], []
    row = 0
    for i, (toks, pages) in enumerate(seqs):
        s = start[i] if start else 0
        slots = (torch.tensor(pages).unsqueeze(1) * PAGE + torch.arange(PAGE)).flatten()[: len(toks)]
        tokens += toks[s:]
        positions.append(torch.arange(s, len(toks)))
        write.append(slots[s:])
        spans.append(SequenceSpan(row, len(toks) - s, len(toks), slots))
        row += len(toks) - s
        rows.extend(range(row - (len(toks) - s), row))
    return ForwardBatch(torch.tensor(tokens), torch.cat(positions), torch.cat(write), spans, torch.tensor(rows))


def logits_of(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    cache = KVCache(model.config, 64, PAGE, model.dtype, "cpu")
    return model.forward(prefill_batch([(tokens, list(range(64)))]), cache)


def hf_logits(path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


TOKENS = [5, 17, 200, 3, 99, 42, 7, 7, 150, 33, 12]


def test_gguf_and_hf_loaders_give_the_same_logits(tiny_dirs):
    a = LlamaModel(load_checkpoint(tiny_dirs["gguf"]))
    b = LlamaModel(load_checkpoint(tiny_dirs["hf"]))
    assert a.config.num_kv_heads == 2 and a.config.vocab_size == 256
    torch.testing.assert_close(logits_of(a, TOKENS), logits_of(b, TOKENS), atol=1e-5, rtol=0)


def test_logits_match_transformers(tiny_dirs):
    ours = logits_of(LlamaModel(load_checkpoint(tiny_dirs["gguf"])), TOKENS)
    torch.testing.assert_close(ours, hf_logits(tiny_dirs["hf"], TOKENS), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "variant",
    [
        {"arch": "Qwen2ForCausalLM", "bias": True},
        {"tie_word_embeddings": True},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            }
        },
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"shards": 3},
    ],
    ids=["qwen2-bias", "tied", "llama3-rope", "linear-rope", "sharded"],
)
def test_architecture_variants_match_transformers(tmp_path, variant):
    variant = dict(variant)
    arch = variant.pop("arch", "LlamaForCausalLM")
    bias = variant.pop("bias", False)
    shards = variant.pop("shards", 1)
    cfg = {**TINY, **variant}
    path = write_hf(tmp_path / "m", cfg, random_weights(cfg, seed=3, bias=bias), arch=arch, shards=shards)
    ours = logits_of(LlamaModel(load_checkpoint(path)), TOKENS * 3)
    torch.testing.assert_close(ours, hf_logits(path, TOKENS * 3), atol=1e-4, rtol=0)


def test_sliding_window_models_are_served_up_to_their_window(tmp_path):
    """Mistral's sliding window: within the window it is full attention, so the logits match transformers'
    MistralForCausalLM there, and the context served stops at the window (from config.json and from GGUF)."""
    from fiberserve.config import EngineConfig
    from fiberserve.engine import InvalidParameter, LlmService, SamplingParams
    from fiberserve.model.config import ModelConfig

    cfg = {**TINY, "sliding_window": 12}
    weights = random_weights(cfg, seed=4)
    path = write_hf(tmp_path / "m", cfg, weights, arch="MistralForCausalLM")
    ck = load_checkpoint(path)
    assert (ck.config.sliding_window, ck.config.max_context) == (12, 12)
    tokens = (TOKENS * 2)[:12]
    model = LlamaModel(ck)
    torch.testing.assert_close(logits_of(model, tokens), hf_logits(path, tokens), atol=1e-4, rtol=0)
    longer = (TOKENS * 2)[:16]  # past the window the two differ: why the context stops there
    assert not torch.allclose(logits_of(model, longer)[-1], hf_logits(path, longer)[-1], atol=1e-3)
    gguf_config = load_checkpoint(write_gguf(tmp_path / "m.gguf", cfg, weights)).config
    assert (gguf_config.sliding_window, gguf_config.max_context) == (12, 12)
    qwen = ModelConfig.from_hf({**cfg, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False})
    assert (qwen.sliding_window, qwen.max_context) == (None, 512)
    service = LlmService(EngineConfig(dtype="float32", kv_pages=8), model, tokenizer=None, model_path=str(path))
    service.validate(tokens[:8], SamplingParams(max_new_tokens=4))  # 12 tokens: fits
    with pytest.raises(InvalidParameter, match="exceeds the context length 12"):
        service.validate(tokens[:8], SamplingParams(max_new_tokens=5))


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantized_gguf_is_dequantized_by_the_gguf_package(tmp_path, qtype):
    import gguf
    from gguf.quants import dequantize, quantize

    cfg = {**TINY, "hidden_size": 64, "intermediate_size": 256}
    weights = random_weights(cfg, seed=5)
    kind = gguf.GGMLQuantizationType[qtype]
    ck = load_checkpoint(write_gguf(tmp_path / "q.gguf", cfg, weights, qtype=kind))
    expected = dequantize(quantize(weights["model.layers.1.mlp.down_proj.weight"].numpy(), kind), kind)
    torch.testing.assert_close(ck.weights["model.layers.1.mlp.down_proj.weight"], torch.from_numpy(expected))
    # and the whole model runs close to the float weights
    full = logits_of(LlamaModel(load_checkpoint(write_hf(tmp_path / "f", cfg, weights))), TOKENS)
    approx = logits_of(LlamaModel(ck), TOKENS)
    assert (approx - full).abs().max() < (0.05 if qtype in ("F16", "BF16", "Q8_0") else 1.5)


def test_the_fast_gguf_reader_reads_what_gguf_reads(tiny_dirs, tmp_path):
    """``open_gguf`` (``model/gguf_file.py``) reads every field, tensor name, type, shape and byte as
    ``gguf.GGUFReader`` does, the tensors still mapped, not copied; string arrays are decoded on demand."""
    import gguf
    import numpy as np

    from fiberserve.model.config import open_gguf
    from fiberserve.model.gguf_file import StringArray

    # a file with every kind of metadata a model file holds: strings, numbers, and arrays of both
    kinds = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(kinds), "llama")
    writer.add_token_list(["<s>", "héllo", "", "▁world"] * 50)
    writer.add_token_types([1, 2, 3, 6] * 50)
    writer.add_token_scores([0.5, -1.25, 0.0, 3.0] * 50)
    writer.add_chat_template("{{ messages }}")
    writer.add_rope_freq_base(5e5)
    writer.add_tensor("blk.0.ffn_up.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path in (kinds, tiny_dirs["gguf"]):
        ours, theirs = open_gguf(path), gguf.GGUFReader(str(path))
        header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the reader's own pseudo-fields
        assert list(ours.fields) == [key for key in theirs.fields if key not in header]
        for key, field in ((k, f) for k, f in theirs.fields.items() if k not in header):
            value = ours.fields[key]
            assert (value.items() if isinstance(value, StringArray) else value) == field.contents(), key
        assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == [
            (t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors
        ]
        for a, b in zip(ours.tensors, theirs.tensors, strict=True):
            assert a.data.shape == b.data.shape and np.array_equal(a.data, b.data) and not a.data.flags.owndata
    bad = tiny_dirs["gguf"].parent / "not-gguf.bin"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match=r"--model .*not-gguf\.bin: not a GGUF file"):
        open_gguf(bad)


def test_unsupported_architecture_is_named(tmp_path):
    path = write_hf(tmp_path / "m", TINY, random_weights(TINY))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_checkpoint(path)


def test_batched_forward_equals_one_by_one_and_touches_only_its_own_pages(tiny_dirs):
    model = LlamaModel(load_checkpoint(tiny_dirs["hf"]))
    seqs = [(TOKENS[:3], [9, 2]), (TOKENS * 2, [0, 5, 11, 3, 7, 8]), (TOKENS[:1], [1]), (TOKENS[2:9], [4, 6])]
    alone = [logits_of(model, toks) for toks, _ in seqs]
    cache = KVCache(model.config, 16, PAGE, torch.float32, "cpu")
    cache.k.fill_(1234.0)
    cache.v.fill_(1234.0)
    batched = model.forward(prefill_batch(seqs), cache)
    offset = 0
    for (toks, _), ref in zip(seqs, alone, strict=True):
        torch.testing.assert_close(batched[offset : offset + len(toks)], ref, atol=1e-4, rtol=0)
        offset += len(toks)
    # Only slots of the sequences' own tokens were written: every other slot keeps its sentinel.
    used = set()
    for toks, pages in seqs:
        used |= {(pages[i // PAGE]) * PAGE + i % PAGE for i in range(len(toks))}
    untouched = [s for s in range(16 * PAGE) if s not in used]
    assert bool((cache.k[:, untouched] == 1234.0).all()) and bool((cache.v[:, untouched] == 1234.0).all())


def test_prefill_chunks_and_decode_steps_in_one_call(tiny_dirs):
    """A chunked prefill beside decode tokens gives the logits of one whole prefill."""
    model = LlamaModel(load_checkpoint(tiny_dirs["hf"]))
    a, b = TOKENS * 2, TOKENS[:7]
    ref_a, ref_b = logits_of(model, a), logits_of(model, b)
    cache = KVCache(model.config, 16, PAGE, torch.float32, "cpu")
    pa, pb = [3, 1, 4, 0, 5, 9], [2, 6]
    first = model.forward(prefill_batch([(a[:13], pa), (b[:6], pb)]), cache)
    torch.testing.assert_close(first[:13], ref_a[:13], atol=1e-4, rtol=0)
    # second call: the rest of a's prompt (a chunk) and one decode token of b
    second = model.forward(prefill_batch([(a, pa), (b, pb)], start=[13, 6]), cache)
    torch.testing.assert_close(second[: len(a) - 13], ref_a[13:], atol=1e-4, rtol=0)
    torch.testing.assert_close(second[-1], ref_b[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("bits, fallback", [(4, False), (8, False), (4, True)])
def test_quant_linear_recovers_llama_cpp_blocks_and_is_row_invariant(bits, fallback, monkeypatch):
    """Weights built like llama.cpp's Q4_1 blocks (min + step * q, q from 0 to 15, both ends used) or Q8_0
    blocks (step * q, |q| up to 127), steps and minimums in float16, come back exactly: the product is theirs
    with the activations' rounding.  ``fallback``: the path of CPUs without the extension's kernel (PyTorch's int4
    kernel, activations unquantized), taken here on purpose."""
    import fiberserve.model.linear as linear_module
    from fiberserve.model.linear import QUANT_GROUP, QuantLinear, quant_kernel_available

    if fallback:
        monkeypatch.setattr(linear_module, "quant_kernel_available", lambda: False)
    elif bits == 8 and not quant_kernel_available():
        pytest.skip("8-bit blocks need the extension's kernel (AVX512-VNNI or AVX2)")
    torch.manual_seed(0)
    n, blocks = 48, 3
    if bits == 4:
        q = torch.randint(0, 16, (n, blocks, QUANT_GROUP))
        q[:, :, 0], q[:, :, 1] = 0, 15
        weight = -torch.rand(n, blocks, 1).half().float() + (torch.rand(n, blocks, 1) * 0.1).half().float() * q
    else:
        q = torch.randint(-127, 128, (n, blocks, QUANT_GROUP))
        q[:, :, 0] = 127
        weight = (torch.rand(n, blocks, 1) * 0.01).half().float() * q
    weight = weight.view(n, blocks * QUANT_GROUP)
    x = torch.randn(5, blocks * QUANT_GROUP)
    layer = QuantLinear(weight, bits=bits)
    assert layer.native == (not fallback and quant_kernel_available())
    if layer.native:  # llama.cpp's arithmetic: activations in int8 per block of 32
        blocks_of_x = x.view(5, blocks, QUANT_GROUP)
        step = blocks_of_x.abs().amax(-1, keepdim=True) / 127
        x = torch.round(blocks_of_x / step) * step
        x = x.view(5, -1)
    torch.testing.assert_close(layer(x), x @ weight.T, atol=1e-5, rtol=0)
    assert torch.equal(layer(x[:1]), layer(x)[:1])
    with pytest.raises(ValueError, match="divisible by 32"):
        QuantLinear(torch.randn(4, 40))


@pytest.mark.parametrize("page", [1, 6, 16])
def test_any_page_size_gives_the_same_logits(tiny_dirs, page):
    """Key buffers pad to a multiple of both 64 and the page size; the page size must not change the math."""
    model = LlamaModel(load_checkpoint(tiny_dirs["hf"]))
    tokens = TOKENS * 2
    pages = [7, 3, 11, 0, 5, 9, 2, 8, 4, 10, 1, 6][: -(-len(tokens) // page)] if page > 1 else None
    pages = pages or list(range(len(tokens) - 1, -1, -1))  # page size 1: one page per token, in reverse
    slots = (torch.tensor(pages).unsqueeze(1) * page + torch.arange(page)).flatten()[: len(tokens)]
    batch = ForwardBatch(
        torch.tensor(tokens),
        torch.arange(len(tokens)),
        slots,
        [SequenceSpan(0, len(tokens), len(tokens), slots)],
        torch.arange(len(tokens)),
    )
    cache = KVCache(model.config, max(pages) + 1, page, torch.float32, "cpu")
    torch.testing.assert_close(model.forward(batch, cache), logits_of(model, tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("quantization, bias", [("none", False), ("int4", False), ("int4", True)])
def test_layer_loop_in_cpp_gives_the_python_loops_bits(tmp_path, quantization, bias):
    """``kernels.decoder_layers`` runs the same kernels in the same order as ``_layers_fused``: the same logits
    and the same K/V, bit for bit, for prefill chunks beside decode tokens (bias: Qwen2's qkv bias)."""
    from fiberserve import kernels
    from fiberserve.model.linear import quant_kernel_available

    kernels.load()
    # bf16 where the CPU has the bf16 products; the int4 products (AVX512-VNNI or AVX2) also take float32 rows.
    dtype = torch.bfloat16 if kernels.bf16_gemm_available() else torch.float32
    runs = quant_kernel_available() if quantization == "int4" else dtype == torch.bfloat16
    if not runs:
        pytest.skip("the C++ layer loop needs the extension's products: AVX512-BF16, or int4 on AVX512-VNNI / AVX2")
    arch = "Qwen2ForCausalLM" if bias else "LlamaForCausalLM"
    path = write_hf(tmp_path / "m", TINY, random_weights(TINY, bias=bias), arch=arch)
    model = LlamaModel(load_checkpoint(path), dtype, quantization=quantization)
    assert model.native_layers is not None
    a, b = TOKENS * 2, TOKENS[:7]
    seqs, start = [(a, [3, 1, 4, 0, 5, 9]), (b, [2, 6])], [13, 6]
    results = []
    for native in (model.native_layers, None):
        model.native_layers = native
        cache = KVCache(model.config, 16, PAGE, dtype, "cpu")
        model.forward(prefill_batch([(a[:13], seqs[0][1]), (b[:6], seqs[1][1])]), cache)
        results.append((model.forward(prefill_batch(seqs, start=start), cache), cache.k, cache.v))
    for ours, theirs in zip(*results, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_greedy_gives_the_argmax_of_forward(tiny_dirs, quantization):
    """``greedy`` (the int4 head keeps its top candidates as its tiles go; no logits written) picks the first
    maximum of ``forward``'s logits, row by row."""
    from fiberserve import kernels
    from fiberserve.model.linear import quant_kernel_available

    if quantization == "int4" and not quant_kernel_available():
        pytest.skip("the int4 mode's head runs on the extension's kernel (AVX512-VNNI or AVX2)")
    model = LlamaModel(load_checkpoint(tiny_dirs["gguf"]), torch.bfloat16, quantization=quantization)
    seqs = [(TOKENS * 2, [3, 1, 4, 0, 5, 9]), (TOKENS[:7], [2, 6])]
    batch = prefill_batch(seqs)
    logits = model.forward(batch, KVCache(model.config, 16, PAGE, torch.bfloat16, "cpu"))
    tokens = model.pick(batch, KVCache(model.config, 16, PAGE, torch.bfloat16, "cpu"))
    assert len(tokens) == logits.shape[0] == len(TOKENS) * 2 + 7
    assert tokens == kernels.top_k_rows(logits, 1)[1][:, 0].tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("quantization", "dtype"), [("none", torch.bfloat16), ("int4", torch.bfloat16), ("none", torch.float32)]
)
def test_pick_draws_what_the_race_over_forward_draws(tiny_dirs, quantization, dtype):
    """``pick`` with a race (in bf16 the head's kernel keeps each row's top logits and race entries, no logits
    written; in float32 the logits are written and raced) gives exactly ``race_rows`` over ``forward``'s re-scored
    logits for sampled rows and the argmax for greedy ones, whether the winner is among the re-scored candidates
    or not."""
    from fiberserve import kernels
    from fiberserve.model.head import REFINED_LOGITS
    from fiberserve.model.linear import quant_kernel_available

    if quantization == "int4" and not quant_kernel_available():
        pytest.skip("the int4 mode's head runs on the extension's kernel (AVX512-VNNI or AVX2)")
    model = LlamaModel(load_checkpoint(tiny_dirs["gguf"]), dtype, quantization=quantization)
    batch = prefill_batch([(TOKENS * 2, [3, 1, 4, 0, 5, 9]), (TOKENS[:7], [2, 6])])
    cache = KVCache(model.config, 16, PAGE, dtype, "cpu")
    logits = model.forward(batch, cache)
    rows = logits.shape[0]
    inverse = torch.tensor([0.0 if row % 5 == 0 else (0.5, 1.0, 3.0)[row % 3] for row in range(rows)])
    drawn = inverse > 0
    refined = kernels.top_k_rows(logits, REFINED_LOGITS)[1]
    inside = outside = 0
    for trial in range(12):
        seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=torch.Generator().manual_seed(trial))
        picks = torch.tensor(model.pick(batch, cache, (inverse, seeds)))
        expected = logits.argmax(-1)
        expected[drawn] = kernels.race_rows(logits[drawn], inverse[drawn], seeds[drawn])
        assert torch.equal(picks, expected)
        among = (refined == picks[:, None]).any(-1)[drawn]
        inside, outside = inside + int(among.sum()), outside + int((~among).sum())
    assert inside > 0 and outside > 0  # both ways of winning were checked


@pytest.mark.parametrize("qtype", [None, "F16", "Q4_1", "Q4_0", "Q8_0", "Q6_K"])
def test_default_quantization_is_the_files_own_where_int4_is_faster(tmp_path, tiny_dirs, qtype):
    """``--quantization auto``: int4 only for a GGUF whose decoder matrices are all in formats served in their own
    blocks (so the file's weights exactly), and, on a CPU whose bf16 products run on AMX tiles, only for a model
    too large for a bf16 copy (this one is small)."""
    import gguf

    from fiberserve import kernels
    from fiberserve.engine.service import resolve_quantization

    cfg = {**TINY, "hidden_size": 256, "intermediate_size": 512}  # K formats quantize rows of 256
    kind = None if qtype is None else gguf.GGMLQuantizationType[qtype]
    ck = load_checkpoint(write_gguf(tmp_path / "q.gguf", cfg, random_weights(cfg, seed=5), qtype=kind))
    assert ck.decoder_weight_types == {qtype or "F32"}
    kernels.load()
    int4_faster = "none" if kernels.bf16_amx() else "int4"
    assert resolve_quantization("auto", ck, "cpu") == (int4_faster if qtype not in (None, "F16") else "none")
    assert resolve_quantization("auto", ck, "cuda") == "none"
    # a 1B model's shape in the same blocks: its own blocks on every CPU (a bf16 copy would be 2.4 GB)
    big = dataclasses.replace(ck.config, hidden_size=2048, intermediate_size=8192, num_layers=16, head_dim=64)
    big = dataclasses.replace(big, num_heads=32, num_kv_heads=8)
    large = dataclasses.replace(ck, config=big)
    assert resolve_quantization("auto", large, "cpu") == ("int4" if qtype not in (None, "F16") else "none")
    assert resolve_quantization("none", ck, "cpu") == "none" and resolve_quantization("int4", ck, "cpu") == "int4"
    hf = load_checkpoint(tiny_dirs["hf"])
    assert hf.decoder_weight_types == frozenset() and resolve_quantization("auto", hf, "cpu") == "none"


def test_model_files_are_known_by_their_content_and_bad_ones_are_named(tmp_path, tiny_dirs):
    from fiberserve.model.config import read_config

    blob = tmp_path / "sha256-0a1b2c"  # how Ollama stores a GGUF: no suffix
    blob.write_bytes(tiny_dirs["gguf"].read_bytes())
    assert read_config(blob) == read_config(tiny_dirs["gguf"])
    assert load_checkpoint(blob).weights.keys() == load_checkpoint(tiny_dirs["gguf"]).weights.keys()
    with pytest.raises(FileNotFoundError, match=r"--model .*nowhere\.gguf: does not exist"):
        load_checkpoint(tmp_path / "nowhere.gguf")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"not a GGUF file \(it starts with b'hell', not b'GGUF'\)"):
        load_checkpoint(text)
    whole = tiny_dirs["gguf"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 1000])
    with pytest.raises(
        ValueError, match=rf"truncated: its tensors end at byte {len(whole)}, the file has {len(whole) - 1000} bytes"
    ):
        load_checkpoint(cut)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 100000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ],
    ids=["base", "linear", "llama3"],
)
def test_configs_written_by_the_installed_transformers_are_read_whole(tmp_path, rope):
    """transformers 5 keeps RoPE's base and scaling in ``rope_parameters`` (no top-level ``rope_theta``)."""
    from transformers import LlamaConfig

    path = write_hf(tmp_path / "m", TINY, random_weights(TINY, seed=4))
    hf_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    written = LlamaConfig(
        **{k: TINY[k] for k in hf_keys},
        num_key_value_heads=TINY["num_key_value_heads"],
        max_position_embeddings=TINY["max_position_embeddings"],
        rms_norm_eps=TINY["rms_norm_eps"],
        rope_parameters=dict(rope),
    )
    written.save_pretrained(path)
    config = load_checkpoint(path).config
    assert config.rope_theta == rope["rope_theta"]
    assert (config.rope_scaling or {}).get("rope_type", "default") == rope["rope_type"]
    ours = logits_of(LlamaModel(load_checkpoint(path)), TOKENS * 3)
    torch.testing.assert_close(ours, hf_logits(path, TOKENS * 3), atol=1e-4, rtol=0)


def test_a_model_the_kernels_do_not_take_runs_the_generic_path_faithfully(tmp_path):
    """Head size 12 is not a multiple of the kernels' 16 lanes: the model runs PyTorch's attention and products
    (the path other devices take), and still matches transformers, batched or alone, prefilled in chunks or whole."""
    cfg = {**TINY, "hidden_size": 48, "intermediate_size": 96}
    path = write_hf(tmp_path / "m", cfg, random_weights(cfg, seed=6))
    model = LlamaModel(load_checkpoint(path))
    assert not model.fused and model.native_layers is None
    tokens = TOKENS * 2
    whole = logits_of(model, tokens)
    torch.testing.assert_close(whole, hf_logits(path, tokens), atol=1e-4, rtol=0)
    cache = KVCache(model.config, 16, PAGE, torch.float32, "cpu")
    other = TOKENS[:5]
    first = model.forward(prefill_batch([(tokens[:9], [3, 1, 4]), (other, [0, 2])]), cache)
    rest = model.forward(prefill_batch([(tokens, [3, 1, 4, 5, 6, 7])], start=[9]), cache)
    torch.testing.assert_close(torch.cat([first[:9], rest]), whole, atol=1e-4, rtol=0)
    torch.testing.assert_close(first[9:], logits_of(model, other), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_more_architectures_match_transformers_from_both_files(tmp_path, arch):
    """Qwen3 (q/k norms), Gemma 2 (GeGLU, extra norms, embedding scale, soft-capping, alternating sliding windows),
    Gemma 3 (q/k norms, five sliding layers with their own RoPE base per global one), Phi-3 (fused qkv and
    gate/up): transformers' own tiny models, past the window, from the directory and from the GGUF file."""
    from tests.tiny_models import write_gguf_like_llama_cpp, write_transformers_model

    hf_dir = write_transformers_model(tmp_path / arch, arch, seed=7)
    tokens = TOKENS * 2  # 22 tokens: the sliding layers' window of 8 hides the early keys
    reference = hf_logits(hf_dir, tokens)
    from_dir = LlamaModel(load_checkpoint(hf_dir))
    torch.testing.assert_close(logits_of(from_dir, tokens), reference, atol=1e-4, rtol=0)
    from_gguf = LlamaModel(load_checkpoint(write_gguf_like_llama_cpp(tmp_path / f"{arch}.gguf", hf_dir)))
    eps = from_dir.config.rms_norm_eps  # GGUF stores it in float32
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=eps) == from_dir.config
    assert from_gguf.config.rms_norm_eps == pytest.approx(eps, rel=1e-6)
    torch.testing.assert_close(logits_of(from_gguf, tokens), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_has_the_same_bits_decoded_alone_or_in_any_span_and_batch(tmp_path, arch, dtype):
    """Architectures off the fused loop (sliding windows, soft-capping, extra norms) keep batch invariance: a
    row's logits are the same bits decoded one token at a time alone, in a span of several (a draft's
    verification, a prefill chunk) and beside other sequences, past the sliding window."""
    from tests.tiny_models import write_transformers_model

    path = write_transformers_model(tmp_path / arch, arch, seed=3, head_dim=256, query_pre_attn_scalar=256)
    model = LlamaModel(load_checkpoint(path), dtype)
    a, b = TOKENS * 2, TOKENS[3:] + TOKENS
    pa, pb = [3, 1, 4, 0, 5, 9], [2, 6, 7, 8, 10]

    def run(steps: list[list[tuple[list[int], list[int], int]]]) -> list[torch.Tensor]:
        cache = KVCache(model.config, 16, PAGE, dtype, "cpu")
        model.forward(prefill_batch([(a[:12], pa), (b[:10], pb)]), cache)
        return [model.forward(prefill_batch([s[:2] for s in step], [s[2] for s in step]), cache) for step in steps]

    one_by_one = torch.cat(run([[(a[: n + 1], pa, n)] for n in range(12, 20)]))
    spans = run([[(a[:15], pa, 12), (b[:11], pb, 10)], [(a[:16], pa, 15)], [(a[:20], pa, 16), (b[:14], pb, 11)]])
    assert torch.equal(torch.cat([spans[0][:3], spans[1], spans[2][:4]]), one_by_one)


def test_the_final_hidden_states_an_embedding_pools_are_transformers_last_hidden_state(tiny_dirs):
    """What ``final_hidden`` gives for the batch's logit rows is the final norm's output, transformers'
    ``last_hidden_state``; the head over it is :meth:`forward`'s logits."""
    from transformers import AutoModel

    model = LlamaModel(load_checkpoint(tiny_dirs["gguf"]))
    cache = KVCache(model.config, 64, PAGE, model.dtype, "cpu")
    hidden = model.final_hidden(prefill_batch([(TOKENS, list(range(64)))]), cache)
    with torch.no_grad():
        theirs = AutoModel.from_pretrained(str(tiny_dirs["hf"]), torch_dtype=torch.float32)(torch.tensor([TOKENS]))
    torch.testing.assert_close(hidden, theirs.last_hidden_state[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(model.logits_of(hidden), logits_of(model, TOKENS), atol=1e-5, rtol=0)
