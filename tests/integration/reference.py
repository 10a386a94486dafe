"""A model of ours checked against transformers' own reading of the same file."""

from __future__ import annotations

from pathlib import Path

import torch

from fiberserve.model import ForwardBatch, KVCache, LlamaModel, SequenceSpan


def transformers_gguf_model(path: str | Path) -> torch.nn.Module:
    """transformers' float32 model of a GGUF file (it dequantizes the file itself)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = Path(path)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def assert_teacher_forced_match(ours: LlamaModel, reference: torch.nn.Module, ids: list[int], steps: int) -> None:
    """Logits within 1e-3 for the prefill of ``ids`` and ``steps`` teacher-forced decode steps (the reference's
    greedy continuation fed back); our greedy tokens identical to it."""
    generated = list(ids)
    with torch.no_grad():
        for _ in range(steps):  # the reference's greedy continuation, through EOS if it comes
            generated.append(int(reference(torch.tensor([generated])).logits[0, -1].argmax()))
        ref_logits = reference(torch.tensor([generated])).logits[0]
    continuation = generated[len(ids) :]
    assert len(continuation) == steps

    page = 16
    cache = KVCache(ours.config, 16, page, torch.float32, "cpu")
    slots = torch.arange(16 * page)
    n = len(ids)
    batch = ForwardBatch(torch.tensor(ids), torch.arange(n), slots[:n], [SequenceSpan(0, n, n, slots)], torch.arange(n))
    prefill = ours.forward(batch, cache)
    assert (prefill - ref_logits[:n]).abs().max() < 1e-3
    greedy = [int(prefill[-1].argmax())]
    for step in range(steps - 1):  # teacher-forced: feed the reference's token, compare the next logits
        pos = n + step
        token = continuation[step]
        batch = ForwardBatch(
            torch.tensor([token]),
            torch.tensor([pos]),
            slots[pos : pos + 1],
            [SequenceSpan(0, 1, pos + 1, slots)],
            torch.tensor([0]),
        )
        logits = ours.forward(batch, cache)[0]
        assert (logits - ref_logits[pos]).abs().max() < 1e-3, f"step {step}"
        greedy.append(int(logits.argmax()))
    assert greedy == continuation
