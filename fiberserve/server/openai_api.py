"""The OpenAI-compatible API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fiberserve.engine import InvalidParameter
from fiberserve.engine import Request as EngineRequest
from fiberserve.engine.grammar import GrammarSpec
from fiberserve.engine.sampling_params import SamplingParams
from fiberserve.engine.sequence import FinishReason
from fiberserve.engine.sequence_output import TokenLogprob
from fiberserve.engine.service import CompletionOutput, RequestOutput
from fiberserve.server.errors import ApiError, failure_body, from_engine
from fiberserve.server.protocol import ChatCompletionRequest, CompletionRequest
from fiberserve.server.reasoning import MARKERS, ReasoningStream, ThinkMarkers, split_reasoning
from fiberserve.server.state import ServerState
from fiberserve.server.tools import NamedToolChoice, ToolCallRenderer, template_tools

router = APIRouter(prefix="/v1")

#: Engine parameter names as OpenAI clients know them (for error messages).
_OPENAI_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "top_logprobs": "logprobs",
    "prompt": "prompt",
    "input_ids": "prompt",
}
_CHAT_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "prompt": "messages"}


def _state(request: Request) -> ServerState:
    return request.app.state.fiberserve


def _reason(reason: FinishReason | None) -> str | None:
    """A finish reason as the API names it (the engine's own name), None while the sequence runs."""
    return None if reason is None else reason.value


def _usage(requests: list[EngineRequest]) -> dict:
    prompt = sum(len(r.prompt_ids) for r in requests)
    completion = sum(len(s.output_ids) for r in requests for s in r.seqs)
    cached = sum(max(s.cached_tokens for s in r.seqs) for r in requests)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@router.get("/models")
async def models(request: Request) -> dict:
    state = _state(request)
    service = state.ready_service()
    base = {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "fiberserve",
        "root": service.model_path,
        "parent": None,
        "max_model_len": service.max_context,  # vLLM's field: clients size prompts by it
    }
    # Each LoRA adapter is a model of its own whose parent is the base (vLLM's convention).
    adapters = [
        {**base, "id": name, "root": adapter.path, "parent": state.model_name}
        for name, adapter in service.adapters.loaded.items()
    ]
    return {"object": "list", "data": [base, *adapters]}


def _completion_logprobs(state: ServerState, lps: list[TokenLogprob], first: int | None = None) -> dict:
    """The legacy completions' logprobs of ``lps``; ``first``: an echoed prompt's first token, which has none.
    Each position's ``top_logprobs`` holds the most likely tokens and the chosen one, as OpenAI and vLLM give them."""
    decode = state.ready_service().tokenizer.decode
    unscored = [] if first is None else [decode([first])]
    tops = [{decode([t]): v for t, v in [*lp.top, (lp.token_id, lp.logprob)]} for lp in lps]
    return {
        "tokens": unscored + [decode([lp.token_id]) for lp in lps],
        "token_logprobs": [None] * len(unscored) + [lp.logprob for lp in lps],
        "top_logprobs": [None] * len(unscored) + tops,
        "text_offset": [],
    }


def _chat_logprobs(state: ServerState, lps: list[TokenLogprob]) -> dict:
    decode = state.ready_service().tokenizer.decode

    def entry(token: int, value: float) -> dict:
        text = decode([token])
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return {
        "content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]
    }


async def _serve(
    request: Request,
    state: ServerState,
    prompts: list[list[int]],
    params,
    names: dict,
    stream: bool,
    include_usage: bool,
    render,
    adapter: str | None,
) -> Response:
    # The engine's request ids are the answer's id (one per prompt, as vLLM numbers them), so that the access
    # log, the metrics and a 500's message name what the client saw.
    rids = [render.id] if len(prompts) == 1 else [f"{render.id}-{i}" for i in range(len(prompts))]
    requests = state.submit(request, prompts, params, rids, names, adapter)
    if stream:
        return StreamingResponse(render.stream(state, request, requests, include_usage), media_type="text/event-stream")
    outputs = await state.collect(request, requests)
    if outputs is None:
        return Response(status_code=499)  # the client left; nobody reads this
    n = params.n
    choices = [render.choice(state, i * n + c.index, c, o) for i, o in enumerate(outputs) for c in o.outputs]
    return JSONResponse(render.body(state, requests, choices))


class _Completions:
    """Renders a completions answer.  ``echo``: each prompt's text, put before its completions (with its
    tokens' logprobs ahead of theirs, when logprobs are asked for)."""

    object = "text_completion"

    def __init__(self, logprobs: bool, echo: list[str] | None = None) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.logprobs = logprobs
        self.echo = echo

    def choice(self, state: ServerState, index: int, comp: CompletionOutput, output: RequestOutput) -> dict:
        lps, text = comp.logprobs, comp.text
        first = None
        if self.echo is not None:
            text = self.echo[index // len(output.outputs)] + text
            if comp.prompt_logprobs is not None:
                scored = cast(list[TokenLogprob], comp.prompt_logprobs[1:])  # every position after the first
                lps, first = scored + lps, output.prompt_token_ids[0]
        logprobs = _completion_logprobs(state, lps, first) if self.logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _reason(comp.finish_reason)}

    def body(self, state: ServerState, requests, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": state.name_of(requests[0].adapter),
            "choices": choices,
            "usage": _usage(requests),
        }

    def delta_choice(self, index: int, delta: str, finish: str | None) -> dict | None:
        """The streamed choice for a sequence's next text (its logprobs filled in by the caller); None: nothing
        to send yet."""
        if not delta and finish is None:
            return None
        return {"index": index, "text": delta, "logprobs": None, "finish_reason": finish}

    def delta_logprobs(self, state: ServerState, lps: list[TokenLogprob]) -> dict:
        return _completion_logprobs(state, lps)

    async def stream(self, state: ServerState, http: Request, requests, include_usage: bool) -> AsyncIterator[str]:
        n = len(requests[0].seqs)
        prompt_index = {s.uid: i for i, r in enumerate(requests) for s in r.seqs}
        # Every chunk of a choice is the same object around its choice: encoded once, the choice each time.
        head = json.dumps(self.body(state, requests, []) | {"object": self.chunk_object, "usage": None})
        head, tail = head[: head.index('"choices": [') + len('"choices": [')], "]}\n\n"
        for i, prompt in enumerate(self.echo or []):
            for c in range(n):
                if (choice := self.delta_choice(i * n + c, prompt, None)) is not None:
                    yield f"data: {head}{json.dumps(choice)}{tail}"
        sent = dict.fromkeys(prompt_index, 0)  # logprobs streamed so far, per sequence
        async for batch in state.merged_events(requests, http):
            events = []  # every event of the batch in one write
            for seq, event in batch:
                if event.finished and seq.finish_reason is FinishReason.ERROR:
                    body = failure_body(seq.request_id, seq)
                    events.append(f"data: {json.dumps(body)}\n\n")
                    continue
                index = prompt_index[seq.uid] * n + seq.index
                choice = self.delta_choice(index, event.delta, _reason(seq.finish_reason) if event.finished else None)
                if choice is None:
                    continue  # text held back (a stop string may be starting): its tokens' logprobs come later
                if self.logprobs:
                    choice["logprobs"] = self.delta_logprobs(state, seq.output.logprobs[sent[seq.uid] :])
                    sent[seq.uid] = len(seq.output.logprobs)
                events.append(f"data: {head}{json.dumps(choice)}{tail}")
            if events:
                yield "".join(events)
        if include_usage:
            yield self._usage_chunk(state, requests)
        yield "data: [DONE]\n\n"

    def _usage_chunk(self, state: ServerState, requests) -> str:
        """The last streamed event: the usage alone."""
        return f"data: {json.dumps(self.body(state, requests, []) | {'object': self.chunk_object})}\n\n"

    chunk_object = "text_completion"


class _ChatCompletions(_Completions):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self, logprobs: bool, tools: ToolCallRenderer | None = None, reasoning: ThinkMarkers | None = None
    ) -> None:
        """``tools``: the answers may be tool calls; ``reasoning``: their thinking goes to ``reasoning_content``
        (server/reasoning.py), and tool calls are read from the rest."""
        super().__init__(logprobs)
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.started: set[int] = set()
        self.tools = tools
        self.reasoning = reasoning
        self.thinking: dict[int, ReasoningStream] = {}  # per streamed choice

    def choice(self, state: ServerState, index: int, comp: CompletionOutput, output: RequestOutput) -> dict:
        lps = _chat_logprobs(state, comp.logprobs) if self.logprobs else None
        thinking, text = split_reasoning(self.reasoning, comp.text) if self.reasoning else (None, comp.text)
        message, finish = {"role": "assistant", "content": text}, _reason(comp.finish_reason)
        if self.tools is not None:
            message, finish = self.tools.message(text, finish)
        if thinking is not None:
            message |= {"reasoning_content": thinking, "reasoning": thinking}  # vLLM's newer name too
        return {"index": index, "message": message, "logprobs": lps, "finish_reason": finish}

    def delta_choice(self, index: int, delta: str, finish: str | None) -> dict | None:
        thinking = ""
        if self.reasoning is not None:
            stream = self.thinking.setdefault(index, ReasoningStream(self.reasoning))
            thinking, delta = stream.feed(delta, final=finish is not None)
        if not delta and not thinking and finish is None:
            return None
        first = index not in self.started
        self.started.add(index)
        content: dict | None
        if self.tools is not None:
            made = self.tools.delta(index, delta, finish, first)
            content, finish = (None, finish) if made is None else made
        elif delta or (finish is None and not thinking):
            content = {"content": delta}
        else:
            content = {}
        if thinking:
            content = {**(content or {}), "reasoning_content": thinking, "reasoning": thinking}
        if content is None:
            return None
        if first:
            content = {"role": "assistant", **content}
        return {"index": index, "delta": content, "logprobs": None, "finish_reason": finish}

    def delta_logprobs(self, state: ServerState, lps: list[TokenLogprob]) -> dict:
        return _chat_logprobs(state, lps)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    state.ready_service()
    adapter = state.check_model(body.model)
    if refused := body.unsupported():
        raise from_engine(refused, _OPENAI_NAMES)
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts = [state.encode(prompt, "prompt")]
    elif not prompt:
        raise ApiError(400, "prompt: must not be empty", "prompt")
    elif isinstance(prompt[0], str):
        prompts = [state.encode(p, "prompt") for p in prompt]
    elif isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = prompt
        if any(not p for p in prompts):
            raise ApiError(400, "prompt: token lists must not be empty", "prompt")
    try:
        params = body.params()
    except InvalidParameter as exc:
        raise from_engine(exc, _OPENAI_NAMES) from None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    echo = None
    if body.echo:  # the prompts as given; token ids as their text, once the engine has checked them
        texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt[0], str) else None
        service = state.ready_service()
        try:
            for ids in prompts:
                service.validate(ids, params)
        except InvalidParameter as exc:
            raise from_engine(exc, _OPENAI_NAMES) from None
        echo = texts or [service.tokenizer.decode(p, params.skip_special_tokens) for p in prompts]
    render = _Completions(params.logprobs, echo)
    return await _serve(request, state, prompts, params, _OPENAI_NAMES, body.stream, include_usage, render, adapter)


def _think_markers(
    state: ServerState, body: ChatCompletionRequest, tool_mode: str | None, grammar: GrammarSpec | None
) -> ThinkMarkers | None:
    """How the answers' thinking is marked, where it is split from them: under ``--reasoning-parser``, unless
    the client turned it off (SGLang's ``separate_reasoning``) or the answers are tool calls by grammar.  A
    constrained answer follows its grammar from its first token: it thinks only where it opens with the start
    marker."""
    markers = MARKERS.get(state.config.reasoning_parser)
    if markers is None or not body.separate_reasoning or tool_mode in ("named", "required"):
        return None
    return dataclasses.replace(markers, begins_inside=False) if grammar is not None else markers


def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams, _ChatCompletions]:
    """A chat request's prompt, its sampling parameters and the renderer of its answers (the Anthropic API's
    route answers through the same); ApiError 400 for what is refused."""
    try:
        tool_mode = body.tool_mode(state.tool_call_parser)
        params = body.params()
        variables = body.template_variables()
        generation_prompt = body.generation_prompt()
    except InvalidParameter as exc:
        raise from_engine(exc, _CHAT_NAMES) from None
    if tool_mode == "auto" and body.skip_special_tokens is None:  # a model's call tags may be special tokens
        params = dataclasses.replace(params, skip_special_tokens=False)
    tools_shown = template_tools(body.tools)
    prompt = state.encode_chat(body.messages, generation_prompt, tools_shown, variables, body.continue_final_message)
    choice = body.tool_choice
    named = choice.function.name if tool_mode == "named" and isinstance(choice, NamedToolChoice) else None
    tools = ToolCallRenderer(tool_mode, named, state.tool_call_parser) if tool_mode else None
    return (
        prompt,
        params,
        _ChatCompletions(params.logprobs, tools, _think_markers(state, body, tool_mode, params.grammar)),
    )


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    state.ready_service()
    adapter = state.check_model(body.model)
    prompt, params, render = prepare_chat(state, body)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _serve(request, state, [prompt], params, _CHAT_NAMES, body.stream, include_usage, render, adapter)
