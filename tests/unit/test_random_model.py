"""`fiberserve bench model`: random-weight GGUF files of real shapes, in every served format and llama.cpp's mixes."""

from __future__ import annotations

import pytest
import torch

from fiberserve.bench.random_model import SHAPES, Shape, tensor_format, write_random_model
from fiberserve.model import LlamaModel, load_checkpoint
from fiberserve.model.gguf_file import GgufFile
from fiberserve.model.tokenizer import load_tokenizer

#: A small shape with the embedded tokenizer's vocabulary and some room: rows of 256 inputs for the K formats.
SMALL = Shape(hidden=256, layers=8, heads=4, kv_heads=2, ffn=512, vocab=49152 + 64, tied=True)
TEXT = "The capital of France is Paris."


def test_llama_3_shapes_have_their_parameter_counts():
    def parameters(s: Shape) -> int:
        kv = s.kv_heads * s.hidden // s.heads
        layer = s.hidden * (2 * s.hidden + 2 * kv) + 3 * s.hidden * s.ffn + 2 * s.hidden
        return s.layers * layer + s.vocab * s.hidden * (1 if s.tied else 2) + s.hidden

    counts = {name: round(parameters(s) / 1e9, 2) for name, s in SHAPES.items()}
    assert counts == {"llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "llama-3.1-8b": 8.03}  # Meta's model cards


def test_q4_k_m_gives_the_head_and_llama_cpps_favoured_layers_q6_k():
    # llama.cpp's use_more_bits for 8 layers: the first eighth (0), the last (7), and every third between (3, 6)
    favoured = [i for i in range(8) if tensor_format(f"blk.{i}.ffn_down.weight", 8, "Q4_K_M", True) == "Q6_K"]
    assert favoured == [0, 3, 6, 7]
    assert tensor_format("blk.1.attn_v.weight", 8, "Q4_K_M", True) == "Q4_K"
    assert tensor_format("blk.0.attn_q.weight", 8, "Q4_K_M", True) == "Q4_K"
    assert tensor_format("token_embd.weight", 8, "Q4_K_M", tied=True) == "Q6_K"  # the head reads it
    assert tensor_format("token_embd.weight", 8, "Q4_K_M", tied=False) == "Q4_K"
    assert tensor_format("output.weight", 8, "Q5_K_M", tied=False) == "Q6_K"
    assert tensor_format("blk.0.ffn_down.weight", 8, "Q8_0", True) == "Q8_0"  # a plain format: every matrix


def test_q3_k_m_gives_llama_cpps_q4_k_and_q5_k_where_its_quantizer_does():
    """llama-quantize's Q3_K_M for a Llama of 32 layers: Q3_K but for attn_v (Q5_K in layers 0-1, else Q4_K),
    ffn_down (Q5_K in the first sixteenth, layers 0-1, else Q4_K), attn_output (Q4_K) and the head (Q6_K)."""
    kinds = {
        kind: [tensor_format(f"blk.{i}.{kind}.weight", 32, "Q3_K_M", False) for i in (0, 1, 2, 31)]
        for kind in ("attn_q", "attn_v", "attn_output", "ffn_up", "ffn_down")
    }
    assert kinds == {
        "attn_q": ["Q3_K"] * 4,
        "attn_v": ["Q5_K", "Q5_K", "Q4_K", "Q4_K"],
        "attn_output": ["Q4_K"] * 4,
        "ffn_up": ["Q3_K"] * 4,
        "ffn_down": ["Q5_K", "Q5_K", "Q4_K", "Q4_K"],
    }
    assert tensor_format("output.weight", 32, "Q3_K_M", False) == "Q6_K"
    assert tensor_format("token_embd.weight", 32, "Q3_K_M", False) == "Q3_K"


@pytest.mark.parametrize("file_format", ["Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_NL"])
def test_a_written_model_loads_and_runs_in_its_own_blocks(tmp_path, model_path, cache_dir, file_format):
    path = write_random_model(tmp_path / "m.gguf", SMALL, file_format, model_path, progress=False)
    file = GgufFile(path)
    kinds = {t.name: t.tensor_type.name for t in file.tensors}
    assert len(kinds) == 1 + 9 * SMALL.layers + 1  # embedding, 7 matrices and 2 norms a layer, the final norm
    assert all(kinds[n] == tensor_format(n, SMALL.layers, file_format, True) for n in kinds if "norm" not in n)
    assert {kinds[n] for n in kinds if "norm" in n} == {"F32"}
    assert len(file.fields["tokenizer.ggml.tokens"]) == SMALL.vocab == file.fields["llama.vocab_size"]
    source = GgufFile(model_path).fields
    for key in ("tokenizer.ggml.add_space_prefix", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.eos_token_id"):
        assert type(file.fields[key]) is type(source[key]) and file.fields[key] == source[key]  # llama.cpp checks types
    model = LlamaModel(load_checkpoint(path), torch.bfloat16, quantization="int4")
    assert model.config.vocab_size == SMALL.vocab and model.config.num_layers == SMALL.layers
    from tests.unit.test_model_math import logits_of

    logits = logits_of(model, load_tokenizer(model_path, cache_dir).encode(TEXT))
    assert logits.shape[-1] == SMALL.vocab and torch.isfinite(logits).all()


def test_a_written_model_tokenizes_as_the_embedded_model(tmp_path, model_path, cache_dir):
    """The tokenizer is written the same whatever the weights' format (the one format here saves the others'
    conversions of it)."""
    path = write_random_model(tmp_path / "m.gguf", SMALL, "Q4_0", model_path, progress=False)
    theirs, ours = load_tokenizer(model_path, cache_dir), load_tokenizer(path, cache_dir)
    assert ours.encode(TEXT) == theirs.encode(TEXT)


def test_an_unknown_format_is_refused_by_name(tmp_path, model_path):
    with pytest.raises(ValueError, match="unknown format 'IQ2_XS'; the formats are IQ4_NL, Q2_K, Q3_K, Q4_0"):
        write_random_model(tmp_path / "m.gguf", SMALL, "IQ2_XS", model_path, progress=False)
    assert not (tmp_path / "m.gguf").exists()
