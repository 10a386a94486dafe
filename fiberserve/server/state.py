"""What the endpoints share: the engine (once loaded), the config, metrics, and request plumbing."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jinja2
from fastapi import Request as HttpRequest

from fiberserve.config import ServerConfig
from fiberserve.engine import InvalidParameter, LlmService, Request, RequestOutput, SamplingParams
from fiberserve.engine.sequence import FinishReason, Sequence
from fiberserve.engine.sequence_output import SequenceEvent
from fiberserve.server.errors import ApiError, failure, from_engine
from fiberserve.server.metrics import Metrics
from fiberserve.server.protocol import ChatMessage, chat_messages
from fiberserve.server.trailing_tools import parser_for_template

T = TypeVar("T")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@/-]")


def sanitize(text: str, limit: int = 64) -> str:
    """A request id fit for a log line: no control characters, no spaces, bounded length."""
    return _UNSAFE.sub("?", text[:limit])


class RequestDisconnected(Exception):
    """The client went away before the answer was ready."""


@dataclass
class ServerState:
    config: ServerConfig
    service: LlmService | None = None
    metrics: Metrics | None = None
    load_error: str | None = None
    #: Requests being served, for shutdown and leak checks.
    active: set[Request] = field(default_factory=set)

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.service.model_name if self.service else "loading"

    @property
    def tool_call_parser(self) -> str:
        """``--tool-call-parser``, or under ``auto`` the one the model's chat template asks for."""
        parser = self.config.tool_call_parser
        if parser != "auto":
            return parser
        return parser_for_template(getattr(self.ready_service().tokenizer.hf, "chat_template", None))

    def ready_service(self) -> LlmService:
        if self.service is None:
            message = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise ApiError(503, message, kind="unavailable", headers={"Retry-After": "1"})
        return self.service

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model, by its name or none); a request
        naming a model not served is refused (404), as vLLM does."""
        if not model or model == self.model_name:
            return None
        adapters = self.ready_service().adapters.loaded
        if model in adapters:
            return model
        served = ", ".join(repr(name) for name in [self.model_name, *adapters])
        raise ApiError(404, f"model {model!r} is not served here; try {served}", "model", kind="not_found_error")

    def name_of(self, adapter: str | None) -> str:
        """The model an answer names: the adapter it ran under, else the base model."""
        return adapter or self.model_name

    def encode(self, text: str, field: str) -> list[int]:
        if not text:
            raise ApiError(400, f"{field}: must not be empty", field)
        return self.ready_service().tokenizer.encode(text)

    def encode_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        variables: dict[str, Any] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        """The prompt of a chat, rendered by the model's template (with ``variables`` defined for it; the last
        message left open with ``continue_final``); 400 naming ``messages`` if it cannot be."""
        try:
            tokenizer = self.ready_service().tokenizer
            rendered = chat_messages(messages)
            return tokenizer.encode_chat(rendered, add_generation_prompt, tools, variables, continue_final)
        except InvalidParameter as exc:  # a content part that is not text
            raise ApiError(400, str(exc), exc.field) from None
        except (ValueError, jinja2.TemplateError) as exc:  # no chat template, or it refused the messages
            raise ApiError(400, f"messages: {exc}", "messages") from None

    def submit(
        self,
        http: HttpRequest,
        prompts: list[list[int]],
        params: SamplingParams,
        rids: list[str] | None,
        rename: dict[str, str] | None = None,
        adapters: list[str | None] | str | None = None,
    ) -> list[Request]:
        """Submit every prompt or none, each under its LoRA adapter (``adapters``: one for all, or one per prompt;
        None: the base model): a refusal of one aborts those already queued (nothing ran yet: no await separates
        the submissions).  The access log line of ``http`` gets their ids and prompt tokens."""
        service = self.ready_service()
        requests: list[Request] = []
        per_prompt = adapters if isinstance(adapters, list) else [adapters] * len(prompts)
        try:
            for i, ids in enumerate(prompts):
                requests.append(service.submit(ids, params, rids[i] if rids else None, per_prompt[i]))
        except Exception as exc:
            for r in requests:
                service.abort(r)
            raise from_engine(exc, rename) from None
        self.active.update(requests)
        http.state.prompt_tokens = sum(len(p) for p in prompts)
        http.state.request_ids = [r.id for r in requests]
        return requests

    def done(self, requests: list[Request]) -> None:
        """Count the requests' prompts (metrics) and forget them; abort any still running.

        Their sequences are counted as they finish, by the scheduler's finish listener.
        """
        service = self.ready_service()
        for r in requests:
            if r not in self.active:
                continue
            self.active.discard(r)
            if any(not s.finished for s in r.seqs):
                service.abort(r)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(r.prompt_ids))

    async def wait_all(self, http: HttpRequest, requests: list[Request]) -> list[RequestOutput]:
        """Wait for the requests; abort them if the client disconnects first."""
        service = self.ready_service()
        try:
            return await until_disconnected(http, asyncio.gather(*(service.wait(r) for r in requests)))
        finally:
            self.done(requests)

    async def collect(self, http: HttpRequest, requests: list[Request]) -> list[RequestOutput] | None:
        """Outputs of ``requests`` once all are done; None if the client left; ApiError 500 if one failed."""
        try:
            outputs = await self.wait_all(http, requests)
        except RequestDisconnected:
            return None
        for r in requests:
            for s in r.seqs:
                if s.finish_reason is FinishReason.ERROR:
                    raise failure(r.id, s)
        http.state.completion_tokens = sum(o.completion_tokens for o in outputs)
        return outputs

    async def merged_events(
        self, requests: list[Request], http: HttpRequest | None = None
    ) -> AsyncIterator[list[tuple[Sequence, SequenceEvent]]]:
        """The events of every sequence of ``requests``, in batches of those that came together (one wake of the
        consumer per landing step, however many sequences and tokens it carries); aborts the rest if the consumer
        stops.  A client that leaves is noticed by the streaming response (Starlette listens for the disconnect
        and cancels it), which ends this generator."""
        seqs = [s for r in requests for s in r.seqs]
        queue: asyncio.Queue[tuple[Sequence, SequenceEvent]] = asyncio.Queue()
        for seq in seqs:
            seq.forward_events(queue)
        remaining = len(seqs)
        try:
            while remaining:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                remaining -= sum(event.finished for _, event in batch)
                yield batch
        finally:
            # No await in here: when the client vanished, Starlette cancels this generator through an anyio
            # cancel scope that cancels every later await too, and the cleanup must still happen.
            self.done(requests)
            if http is not None:  # for the access log line
                http.state.completion_tokens = sum(len(s.output_ids) for s in seqs)


async def until_disconnected(http: HttpRequest, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first (then cancel it, raise RequestDisconnected)."""
    work_task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await http.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        raise
    finally:
        watcher.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    await asyncio.gather(work_task, return_exceptions=True)
    raise RequestDisconnected()
