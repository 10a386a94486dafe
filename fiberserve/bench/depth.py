"""Prefill and decode at a context depth, in process (``fiberserve bench depth``), as llama.cpp's
``llama-batched-bench`` measures them: ``batch`` sequences of ``depth`` random tokens prefilled one after another
in chunks, then ``steps`` decode steps of all of them at once.  No server, no scheduler: the model and its KV cache
alone, so a KV cache format's effect on long-context decode shows without the interleaving of other requests'
prefill chunks that a loaded server's time per token includes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fiberserve.model import ForwardBatch, KVCache, LlamaModel, SequenceSpan
from fiberserve.model.kv_format import kv_format

#: Prompt tokens per prefill pass (the engine's default token budget of a flight).
CHUNK = 512
PAGE = 16


@dataclass
class DepthResult:
    format: str
    depth: int
    batch: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  #: every sequence's tokens together
    kv_mib: float  #: the KV cache the run's sequences take


def _span_pass(
    model: LlamaModel, cache: KVCache, pages_each: int, tokens: list[int], starts: list[int], sequences: list[int]
) -> None:
    """One forward pass: sequence ``sequences[i]`` (pages ``i * pages_each`` on) gets ``tokens`` rows from position
    ``starts[i]`` (the rows split evenly between the sequences)."""
    per = len(tokens) // len(sequences)
    positions, slots, spans = [], [], []
    for i, (sequence, start) in enumerate(zip(sequences, starts, strict=True)):
        pages = tuple(range(sequence * pages_each, (sequence + 1) * pages_each))
        spans.append(SequenceSpan(i * per, per, start + per, pages=pages))
        for position in range(start, start + per):
            positions.append(position)
            slots.append(pages[position // PAGE] * PAGE + position % PAGE)
    batch = ForwardBatch(
        torch.tensor(tokens),
        torch.tensor(positions),
        torch.tensor(slots),
        spans,
        torch.tensor([i * per + per - 1 for i in range(len(sequences))]),
    )
    model.pick(batch, cache)


def depth_run(model: LlamaModel, format_name: str, depth: int, batch: int, steps: int, seed: int = 0) -> DepthResult:
    """``batch`` sequences prefilled to ``depth`` tokens, then ``steps`` decode steps of them all."""
    storage = kv_format(format_name, model.dtype)
    pages_each = -(-(depth + steps) // PAGE)
    cache = KVCache(model.config, pages_each * batch, PAGE, storage, "cpu")
    generator = torch.Generator().manual_seed(seed)
    vocabulary = model.config.vocab_size
    started = time.perf_counter()
    for sequence in range(batch):
        prompt = torch.randint(100, vocabulary, (depth,), generator=generator).tolist()
        for start in range(0, depth, CHUNK):
            _span_pass(model, cache, pages_each, prompt[start : start + CHUNK], [start], [sequence])
    prefilled = time.perf_counter()
    for step in range(steps):
        tokens = torch.randint(100, vocabulary, (batch,), generator=generator).tolist()
        _span_pass(model, cache, pages_each, tokens, [depth + step] * batch, list(range(batch)))
    decoded = time.perf_counter()
    kv_bytes = KVCache.bytes_per_page(model.config, PAGE, storage) * pages_each * batch
    return DepthResult(
        format_name,
        depth,
        batch,
        batch * depth / (prefilled - started),
        batch * steps / (decoded - prefilled),
        kv_bytes / 2**20,
    )


def depth_table(model_name: str, cpu: str, results: list[DepthResult]) -> str:
    lines = [
        f"{model_name}, in process, {cpu}:",
        "| KV cache | depth | sequences | prefill tok/s | decode tok/s | KV cache MiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.format} | {r.depth} | {r.batch} | {r.prefill_tokens_per_s:.0f} | {r.decode_tokens_per_s:.1f} "
            f"| {r.kv_mib:.0f} |"
        )
    return "\n".join(lines)
