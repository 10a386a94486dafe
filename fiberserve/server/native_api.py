"""SGLang's native API (``/generate``, ``/get_model_info``, ...) plus shortfin's ``/health``."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fiberserve import __version__
from fiberserve.engine import InvalidParameter
from fiberserve.engine import Request as EngineRequest
from fiberserve.engine.faults import FaultPoint
from fiberserve.engine.sequence import FinishReason, Sequence
from fiberserve.engine.sequence_output import TokenLogprob
from fiberserve.engine.service import CompletionOutput, completion_of
from fiberserve.model.tokenizer import Tokenizer
from fiberserve.runtime.allocator import heap_figures
from fiberserve.server.errors import ApiError, failure_body, from_engine
from fiberserve.server.protocol import GenerateRequest
from fiberserve.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.fiberserve


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    if state.service is None:
        status = "failed" if state.load_error else "loading"
        return JSONResponse({"status": status}, status_code=503)
    quarantined = state.service.pages.quarantined
    if quarantined:  # calls that timed out and have not returned: their pages are out of use until they do
        return JSONResponse({"status": "ok", "quarantined_kv_pages": quarantined})
    return JSONResponse({"status": "ok"})


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> dict:
    state = _state(request)
    service = state.ready_service()
    return {
        "model_path": service.model_path,
        "tokenizer_path": service.model_path,
        "served_model_name": state.model_name,
        "is_generation": True,
        "max_context_length": service.max_context,
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> dict:
    state = _state(request)
    service = state.ready_service()
    cfg = service.config
    pool = service.pool.stats() if service.pool else None
    return {
        "version": __version__,
        # which process answered: behind Ray Serve, one of several replicas
        "replica": {"host": socket.gethostname(), "pid": os.getpid()},
        "model_path": service.model_path,
        "served_model_name": state.model_name,
        "device": cfg.device,
        "dtype": str(service.model.dtype).removeprefix("torch."),
        "quantization": service.model.quantization,
        "fibers": cfg.fibers,
        "isolation": cfg.isolation,
        "page_size": cfg.page_size,
        "kv_cache_dtype": str(service.kv_cache.format.storage).removeprefix("torch."),
        "max_total_num_tokens": service.pages.num_pages * service.pages.page_size,
        "max_running_requests": cfg.max_running,
        "max_batch_tokens": cfg.max_batch_tokens,
        "decode_steps": cfg.decode_steps,
        "speculative_tokens": cfg.speculative_tokens,
        "spec_decode": {
            "draft_tokens": service.scheduler.speculation.draft_tokens,
            "accepted_tokens": service.scheduler.speculation.accepted_tokens,
            "measured": service.scheduler.speculation.switch.describe(),
        },
        "max_queue": cfg.max_queue,
        "context_length": service.max_context,
        "kv_pages": {
            "total": service.pages.num_pages,
            "free": service.pages.free_pages,
            "used": service.pages.used_pages,
            "cached": service.pages.cached_pages,
            "quarantined": service.pages.quarantined,
        },
        "pool": pool.__dict__ if pool else None,
        "active_requests": len(state.active),
        "running_sequences": len(service.scheduler.running),
        "waiting_sequences": len(service.scheduler.waiting),
        "asyncio_tasks": len(asyncio.all_tasks()),
        "heap_bytes": heap_figures(),
        "heap_trimmed": service.heap_trimmed,
        "flights_run": service.flights_run,
        "flights_failed": service.flights_failed,
        "program_instances_built": service.program.instances_built,
    }


@router.post("/flush_cache")
async def flush_cache(request: Request) -> dict:
    dropped = await _state(request).ready_service().flush_cache()
    return {"success": True, "flushed_pages": dropped}


@router.post("/concate_and_append_request")
async def concatenate_and_append(request: Request) -> Response:
    """The frontend's ``fork(...).join("concate_and_append")`` asks for this; SGLang's server dropped it."""
    raise ApiError(
        404,
        "concate_and_append_request: SGLang's server no longer serves it, nor does this one; join forks with "
        'join() ("gather_variable"), or set sgl.global_config.enable_parallel_encoding = False to append the text',
        "concate_and_append_request",
        kind="not_found_error",
    )


@router.api_route("/start_profile", methods=["GET", "POST"])
@router.api_route("/stop_profile", methods=["GET", "POST"])
async def profile(request: Request) -> Response:
    """SGLang's profiler switches: not served (profile a fiberserve process from outside, e.g. with py-spy)."""
    name = request.url.path.lstrip("/")
    raise ApiError(400, f"{name}: profiling is not served by fiberserve; run py-spy on the process", name)


@router.post("/debug/faults", include_in_schema=False)
async def set_faults(request: Request) -> dict:
    """Retune fault injection; exists only on a server started with --fault-rate (testing).  ``"release": true``
    also ends every hang under way."""
    state = _state(request)
    service = state.ready_service()
    if not state.config.engine.fault_rate:
        raise ApiError(404, "not found", kind="not_found_error")
    try:
        body = await request.json()
        rate, hang = float(body.get("rate", 0.0)), float(body.get("hang_seconds", 0.0))
        point, release = FaultPoint(body.get("point", "start")), body.get("release", False)
        if not isinstance(release, bool):
            raise TypeError("release")
    except (ValueError, TypeError, AttributeError):
        raise ApiError(
            400,
            'body: expected {"rate": float, "hang_seconds": float, "point": "start" | "layers", "release": bool}',
            "body",
        ) from None
    if not (0.0 <= rate <= 1.0 and 0.0 <= hang <= 60.0):
        raise ApiError(400, "rate must be in [0, 1] and hang_seconds in [0, 60]", "rate")
    service.faults.rate, service.faults.hang_seconds, service.faults.point = rate, hang, point
    if release:
        service.faults.release_hangs()
    return {"rate": rate, "hang_seconds": hang, "point": point.value, "injected": service.faults.injected}


def finish_reason(comp: CompletionOutput | Sequence) -> dict | None:
    comp = completion_of(comp) if isinstance(comp, Sequence) else comp
    reason = comp.finish_reason
    if reason is FinishReason.STOP:
        return {"type": "stop", "matched": comp.matched_stop}
    if reason is FinishReason.LENGTH:
        return {"type": "length", "length": len(comp.token_ids)}
    if reason in (FinishReason.ABORT, FinishReason.ERROR):
        return {"type": reason.value, "message": comp.error or reason.value}
    return None


@dataclass(frozen=True)
class LogprobAsk:
    """What a /generate answer carries of the logprobs: the output's, the input's from a position on, and each
    entry's token text (``return_text_in_logprobs``)."""

    output: bool = False
    input_from: int | None = None
    token_texts: Callable[[list[int]], list[str]] | None = None
    #: Token id -> its text, decoded once per request: a stream sends every entry so far with each event.
    texts: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, body: GenerateRequest, tokenizer: Tokenizer) -> LogprobAsk:
        texts = tokenizer.token_texts if body.return_text_in_logprobs else None
        return cls(bool(body.return_logprob), body.input_logprobs_from(), texts)

    def entries(self, logprobs: list[TokenLogprob | None], token_ids: list[int]) -> tuple[list, list]:
        """SGLang's ``[logprob, token_id, text]`` entries of ``token_ids`` and their top alternatives (None where a
        token has no logprob: the prompt's first); text is None unless asked for."""
        tops = [[] if lp is None else lp.top for lp in logprobs]
        if self.token_texts is not None:
            new = list(dict.fromkeys(t for t in token_ids + [t for top in tops for t, _ in top] if t not in self.texts))
            self.texts.update(zip(new, self.token_texts(new), strict=True))
        text = self.texts.get
        chosen = [[lp and lp.logprob, t, text(t)] for lp, t in zip(logprobs, token_ids, strict=True)]
        top_entries = [lp and [[v, t, text(t)] for t, v in top] for lp, top in zip(logprobs, tops, strict=True)]
        return chosen, top_entries


def _meta(req: EngineRequest, comp: CompletionOutput, logprob: LogprobAsk, started: float) -> dict:
    meta: dict[str, object] = {
        "id": req.id if len(req.seqs) == 1 else f"{req.id}-{comp.index}",
        "finish_reason": finish_reason(comp),
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(comp.token_ids),
        "cached_tokens": max(s.cached_tokens for s in req.seqs),
        "e2e_latency": time.monotonic() - started,
    }
    if logprob.output:
        chosen, top = logprob.entries(list(comp.logprobs), [lp.token_id for lp in comp.logprobs])
        meta["output_token_logprobs"], meta["output_top_logprobs"] = chosen, top
        meta["input_token_logprobs"], meta["input_top_logprobs"] = [], []
    if logprob.input_from is not None and comp.prompt_logprobs is not None:
        # As the frontend reads them (its token healing drops the first entry where it is the prompt's own):
        # from logprob_start_len + 1 on, and from 0 on (the first token's logprob None) where it is 0.
        first = logprob.input_from + 1 if logprob.input_from else 0
        chosen, top = logprob.entries(comp.prompt_logprobs[first:], req.prompt_ids[first:])
        meta["input_token_logprobs"], meta["input_top_logprobs"] = chosen, top
    return meta


def _result(req: EngineRequest, comp: CompletionOutput, logprob: LogprobAsk, started: float) -> dict:
    return {"text": comp.text, "output_ids": comp.token_ids, "meta_info": _meta(req, comp, logprob, started)}


def _prompts(state: ServerState, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """Token ids of every prompt, and whether the input was a list (so the answer is one)."""
    if body.image_data is not None:
        raise ApiError(400, "image_data: the model served reads text only", "image_data")
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", "text")
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        if not texts:
            raise ApiError(400, "text: the list is empty", "text")
        return [state.encode(t, "text") for t in texts], isinstance(body.text, list)
    ids = body.input_ids or []
    batched = bool(ids) and isinstance(ids[0], list)
    prompts: list[list[int]] = ids if batched else [ids]  # type: ignore[assignment,list-item]
    if not prompts or any(not p for p in prompts):
        raise ApiError(400, "input_ids: must not be empty", "input_ids")
    return prompts, batched


def _adapters(state: ServerState, lora_path: str | list[str | None] | None, prompts: int) -> list[str | None]:
    """Each prompt's LoRA adapter from SGLang's ``lora_path``: a served adapter's name, one for every prompt or
    a list with one per prompt (None or the base model's name: the base model)."""
    names = lora_path if isinstance(lora_path, list) else [lora_path] * prompts
    if len(names) != prompts:
        message = f"lora_path: {len(names)} adapters for {prompts} prompts (give one per prompt)"
        raise ApiError(400, message, "lora_path")
    loaded = state.ready_service().adapters.loaded
    for name in names:
        if name is not None and name != state.model_name and name not in loaded:
            served = ", ".join(map(repr, loaded)) or "none"
            raise ApiError(400, f"lora_path: no LoRA adapter {name!r} is loaded (loaded: {served})", "lora_path")
    return [None if name == state.model_name else name for name in names]


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    state = _state(request)
    started = time.monotonic()
    prompts, batched = _prompts(state, body)
    try:
        params = body.params()
    except InvalidParameter as exc:
        raise from_engine(exc) from None
    rids = None
    if body.rid is not None:
        rids = body.rid if isinstance(body.rid, list) else [body.rid]
        if len(rids) != len(prompts) or any(len(r) > 128 or not r for r in rids):
            raise ApiError(400, "rid: one non-empty id (at most 128 characters) per prompt", "rid")
    start = body.input_logprobs_from()
    if start is not None and any(start > len(p) for p in prompts):
        raise ApiError(
            400, f"logprob_start_len: {start} is past the prompt's {min(map(len, prompts))} tokens", "logprob_start_len"
        )
    requests = state.submit(request, prompts, params, rids, None, _adapters(state, body.lora_path, len(prompts)))
    logprob = LogprobAsk.of(body, state.ready_service().tokenizer)
    many = batched or params.n > 1
    if body.stream:
        stream = _stream(state, request, requests, logprob, started, many)
        return StreamingResponse(stream, media_type="text/event-stream")
    outputs = await state.collect(request, requests)
    if outputs is None:
        return Response(status_code=499)  # the client left; nobody reads this
    results = [_result(r, c, logprob, started) for r, o in zip(requests, outputs, strict=True) for c in o.outputs]
    return JSONResponse(results if many else results[0])


async def _stream(
    state: ServerState, http: Request, requests: list[EngineRequest], logprob: LogprobAsk, started: float, many: bool
) -> AsyncIterator[str]:
    """SGLang's stream: ``data: {json}`` events with the cumulative text, then ``data: [DONE]``."""
    index_of = {}
    n = len(requests[0].seqs)
    for i, r in enumerate(requests):
        for s in r.seqs:
            index_of[s.uid] = (r, i * n + s.index)
    async for batch in state.merged_events(requests, http):
        events = []  # every event of the batch in one write
        for seq, event in batch:
            req, index = index_of[seq.uid]
            if event.finished and seq.finish_reason is FinishReason.ERROR:
                body = failure_body(req.id, seq)
                events.append(f"data: {json.dumps(body)}\n\n")
                continue
            if not event.delta and not event.finished:
                continue
            payload = _result(req, completion_of(seq), logprob, started)
            if many:
                payload["index"] = index
            events.append(f"data: {json.dumps(payload)}\n\n")
        if events:
            yield "".join(events)
    yield "data: [DONE]\n\n"
