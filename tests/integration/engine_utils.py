"""Running the real engine in tests: one loaded model per dtype, a fresh LlmService per configuration."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from fiberserve.config import EngineConfig
from fiberserve.engine import LlmService, RequestOutput, SamplingParams
from fiberserve.model import LlamaModel, load_checkpoint

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about autumn.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.",
    "What is the boiling point of water?",
    "Give me a synonym for happy.",
    "What does CPU stand for?",
    "Translate 'hello' into Spanish.",
    "What is the largest planet in our solar system?",
    "Suggest a name for a pet turtle.",
    "What is the square root of 81?",
    "List two uses of copper.",
    "Why is the sky blue?",
]

_models: dict[tuple[str, str, str], LlamaModel] = {}


def load_model(model_path: str, dtype: str, quantization: str = "none") -> LlamaModel:
    key = (model_path, dtype, quantization)
    if key not in _models:
        torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
        checkpoint = load_checkpoint(model_path)
        _models[key] = LlamaModel(checkpoint, dtype=torch_dtype, quantization=quantization)
    return _models[key]


@dataclass
class Engine:
    model_path: str
    tokenizer: object

    def chat_prompts(self, count: int = 16) -> list[list[int]]:
        return [self.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:count]]

    def service(self, dtype: str = "bfloat16", **config) -> LlmService:
        config.setdefault("progress", False)
        config.setdefault("check_integrity", True)  # whenever the engine goes idle, not only at the end
        model = load_model(self.model_path, dtype, config.get("quantization", "none"))
        return LlmService(EngineConfig(dtype=dtype, **config), model, self.tokenizer, self.model_path)

    async def run(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], dtype: str = "bfloat16", **config
    ) -> list[RequestOutput]:
        """Submit every prompt at once on a fresh service; check it ends idle with its invariants intact."""
        svc = self.service(dtype, **config)
        await svc.start()
        try:
            plist = params if isinstance(params, list) else [params] * len(prompts)
            requests = [svc.submit(p, sp) for p, sp in zip(prompts, plist, strict=True)]
            outputs = await asyncio.gather(*(svc.wait(r) for r in requests))
            await asyncio.sleep(0)
            assert svc.is_idle()
            svc.check_integrity()
            assert svc.pages.used_pages == 0
            return list(outputs)
        finally:
            await svc.close()

    async def alone(
        self, prompts: list[list[int]], params: SamplingParams, dtype: str = "bfloat16", **config
    ) -> list[RequestOutput]:
        """Each prompt on its own (one after another), the reference for batch consistency."""
        svc = self.service(dtype, fibers=1, **config)
        await svc.start()
        try:
            return [await svc.generate(p, params) for p in prompts]
        finally:
            await svc.close()


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_near_tie(alone: RequestOutput, batched: RequestOutput, tolerance: float = 1e-4) -> bool:
    """Tokens equal; or, at the first difference, both runs saw the same logprobs within ``tolerance``.

    Returns True when the tokens are identical.  Needs ``top_logprobs`` >= 2 in the params.
    """
    a, b = alone.outputs[0], batched.outputs[0]
    i = first_difference(a.token_ids, b.token_ids)
    if i is None:
        return True
    assert i < len(a.logprobs) and i < len(b.logprobs), "outputs differ in length only"
    top_a, top_b = dict(a.logprobs[i].top), dict(b.logprobs[i].top)
    for token in set(top_a) & set(top_b):
        assert abs(top_a[token] - top_b[token]) < tolerance, (
            f"position {i}: logprob of {token} alone {top_a[token]} vs batched {top_b[token]}"
        )
    assert a.token_ids[i] in top_b and b.token_ids[i] in top_a, f"position {i}: not a near tie"
    return False
