"""How far a quantized KV cache moves a model's logits (``fiberserve bench kv-accuracy``).

Teacher-forced over a long text: the model reads the same tokens with its own dtype's cache and with each
quantized one, a chunk at a time as a long prompt is prefilled (each chunk's keys are written, quantized, before
its rows read them), and every position's logits are compared with the unquantized cache's: the largest absolute
difference as a share of the largest logit, and how often the top token agrees.

The text is Python's own standard-library source (English comments and code, the same on every machine with
the same Python), so a real model reads what it was trained on; a random-weight model's logits mean nothing,
but the cache's effect on them is measured the same way.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from tqdm import tqdm

from fiberserve.model import ForwardBatch, KVCache, LlamaModel, SequenceSpan
from fiberserve.model.kv_format import kv_format

#: Rows per prefill chunk (the engine's default token budget of a flight).
CHUNK = 512
#: Standard-library modules whose source is the text read.
TEXT_MODULES = ("argparse", "typing", "dataclasses", "inspect", "pathlib", "logging")


@dataclass
class FormatAccuracy:
    format: str
    context: int
    max_diff_share: float  #: max |logit - reference| / max |reference logit|, over every position
    mean_diff_share: float  #: mean |logit - reference| / max |reference logit|
    top1_agreement: float  #: share of positions whose top token is the reference's


def stdlib_text() -> str:
    import importlib

    return "\n".join(inspect.getsource(importlib.import_module(name)) for name in TEXT_MODULES)


def _logits(model: LlamaModel, cache: KVCache, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """One chunk's logits [n, vocab]: tokens at positions start.. of the one sequence the cache holds."""
    n, context = tokens.numel(), start + tokens.numel()
    slots = torch.arange(cache.num_pages * cache.page_size)
    positions = torch.arange(start, context)
    batch = ForwardBatch(tokens, positions, slots[start:context], [SequenceSpan(0, n, context, slots)], torch.arange(n))
    return model.forward(batch, cache)


def kv_cache_accuracy(
    model: LlamaModel, tokens: list[int], contexts: list[int], formats: list[str], progress: bool = True
) -> list[FormatAccuracy]:
    """Each format against the model's own dtype's cache, over the first ``context`` tokens for each context."""
    results = []
    for context in contexts:
        if context > len(tokens):
            raise ValueError(f"the text has {len(tokens)} tokens, fewer than the context {context}")
        pages = -(-context // 16)
        caches = {name: KVCache(model.config, pages, 16, kv_format(name, model.dtype), "cpu") for name in formats}
        reference = KVCache(model.config, pages, 16, model.dtype, "cpu")
        diff = dict.fromkeys(formats, 0.0)
        total = dict.fromkeys(formats, 0.0)
        agree = dict.fromkeys(formats, 0)
        top = 0.0
        ids = torch.tensor(tokens[:context])
        for start in tqdm(range(0, context, CHUNK), desc=f"{context} tokens", unit="chunk", disable=not progress):
            chunk = ids[start : start + CHUNK]
            expected = _logits(model, reference, chunk, start)
            top = max(top, float(expected.abs().max()))
            for name in formats:
                got = _logits(model, caches[name], chunk, start)
                error = (got - expected).abs()
                diff[name] = max(diff[name], float(error.max()))
                total[name] += float(error.mean(-1).sum())
                agree[name] += int((got.argmax(-1) == expected.argmax(-1)).sum())
        for name in formats:
            mean = total[name] / context
            results.append(FormatAccuracy(name, context, diff[name] / top, mean / top, agree[name] / context))
    return results


def accuracy_table(model_name: str, results: list[FormatAccuracy]) -> str:
    lines = [
        f"KV cache formats against the model's own dtype's cache, {model_name}, teacher-forced:",
        "| format | context | max abs diff / max logit | mean abs diff / max logit | top-1 agreement |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.format} | {r.context} | {r.max_diff_share:.4f} | {r.mean_diff_share:.5f} "
            f"| {100 * r.top1_agreement:.2f}% |"
        )
    return "\n".join(lines)
