"""The tokenizer read from a GGUF file and cached: loaded back as the class transformers' AutoTokenizer picks,
without the import of every model's tokenizer module that AutoTokenizer makes (a large part of start-up)."""

from __future__ import annotations

import json
import subprocess
import sys

from fiberserve.model.tokenizer import load_tokenizer, tokenizer_cache

TEXTS = ["Hello world", "<|im_start|>user\nhi<|im_end|>", "  spaces\t\ttabs\n\nnewlines ", "émoji 😀 ünïcödé"]

LOAD_IN_A_FRESH_PROCESS = """
import json, sys
from fiberserve.model.tokenizer import load_tokenizer
tokenizer = load_tokenizer(sys.argv[1], sys.argv[2])
print(json.dumps({
    "class": type(tokenizer.hf).__name__,
    "auto_imported": "transformers.models.auto.tokenization_auto" in sys.modules,
    "ids": [tokenizer.hf(text)["input_ids"] for text in json.loads(sys.argv[3])],
}))
"""


def test_a_cached_gguf_tokenizer_loads_as_autotokenizer_would_without_importing_it(model_path, cache_dir):
    from transformers import AutoTokenizer

    load_tokenizer(model_path, cache_dir)  # converts and caches it where no test has yet
    saved = tokenizer_cache(model_path, cache_dir)
    assert saved is not None and json.loads((saved / "tokenizer_config.json").read_text())["tokenizer_class"]
    reference = AutoTokenizer.from_pretrained(str(saved))
    run = subprocess.run(
        [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, model_path, cache_dir, json.dumps(TEXTS)],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = json.loads(run.stdout)
    assert loaded["class"] == type(reference).__name__
    assert loaded["auto_imported"] is False
    assert loaded["ids"] == [reference(text)["input_ids"] for text in TEXTS]
