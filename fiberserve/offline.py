"""Offline generation, like vLLM's ``LLM.generate``, on the same engine the server uses."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import torch
import torch.nn.functional as F

from fiberserve.config import EngineConfig
from fiberserve.engine import LlmService, RequestOutput, SamplingParams
from fiberserve.runtime import Worker


class LLM:
    """``LLM(model=None)`` serves the embedded default model; ``generate`` batches all prompts at once.

    The engine lives on a private event loop (a runtime ``Worker``), so the
    calls here are plain blocking functions.
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **overrides) -> None:
        config = replace(config or EngineConfig(), model=model or (config.model if config else None), **overrides)
        self.service = LlmService.load(config)
        self.tokenizer = self.service.tokenizer
        self._host = Worker("llm-host")
        self._host.submit(self.service.start).result()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt (text or token ids), in order."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]

        async def run() -> list[RequestOutput]:
            requests = [self.service.submit(p, params) for p in ids]
            return list(await asyncio.gather(*(self.service.wait(r) for r in requests)))

        return self._host.submit(run).result()

    def embed(
        self, prompts: str | list[str] | list[list[int]], pooling: str = "last", normalize: bool = True
    ) -> list[torch.Tensor]:
        """One embedding per prompt (text or token ids), in order: float32 [hidden] tensors, the prompt's final
        hidden states pooled (``last`` or ``mean``), L2-normalized unless ``normalize`` is False; all batched."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]

        async def run() -> list[torch.Tensor]:
            return list(await asyncio.gather(*(self.service.embed(p, pooling) for p in ids)))

        vectors = self._host.submit(run).result()
        return [F.normalize(v, dim=0) if normalize else v for v in vectors]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        ids = self.tokenizer.encode_chat(messages)
        return self.generate([ids], params)[0]

    def check_integrity(self) -> None:
        self._host.submit(self.service.check_integrity).result()

    def close(self) -> None:
        self._host.submit(self.service.close).result()
        self._host.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
