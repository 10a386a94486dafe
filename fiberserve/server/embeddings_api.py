"""``POST /v1/embeddings`` and ``POST /v1/rerank`` (also ``/rerank``, ``/v2/rerank``): prompts pooled through the
same engine, batched with the generations and with each other.

An embedding is the prompt's final hidden states (after the last norm) pooled by ``--pooling``, L2-normalized.  A
reranker (a file with a score head, as llama.cpp's converter writes Qwen3-Reranker) scores a query-document prompt
by its head over the last token: a one-label head's sigmoid, else the first label's softmax probability (its
"yes").  Any other model ranks the documents by their embeddings' cosine similarity to the query's (vLLM's score
for embedding models).
"""

from __future__ import annotations

import base64
import time
import uuid

import torch
import torch.nn.functional as F
from fastapi import APIRouter, Request

from fiberserve.engine import InvalidParameter, LlmService, SamplingParams
from fiberserve.server.embeddings_protocol import EmbeddingRequest, RerankRequest
from fiberserve.server.errors import ApiError, from_engine
from fiberserve.server.state import ServerState

router = APIRouter()

#: The engine's refusals of a prompt, named as these APIs name it.
_RENAME = {"prompt": "input", "input_ids": "input", "max_new_tokens": "input"}


def _state(request: Request) -> ServerState:
    return request.app.state.fiberserve


def _pooling(state: ServerState, service: LlmService) -> str:
    """``--pooling``, or under ``auto`` the file's where it is one an embedding takes (else ``last``)."""
    if state.config.pooling != "auto":
        return state.config.pooling
    return service.model.config.pooling if service.model.config.pooling in ("last", "mean") else "last"


async def _pool(
    http: Request, state: ServerState, prompts: list[list[int]], pooling: str, adapter: str | None
) -> list[torch.Tensor] | None:
    """Each prompt's pooled final hidden state (not normalized) under ``adapter`` (None: the base model), all
    submitted at once; None if the client left."""
    params = SamplingParams(max_new_tokens=0, pooling=pooling)
    requests = state.submit(http, prompts, params, None, _RENAME, adapter)
    if await state.collect(http, requests) is None:
        return None
    return [r.seqs[0].output.pooled() for r in requests]


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, http: Request) -> dict | None:
    state = _state(http)
    service = state.ready_service()
    adapter = state.check_model(body.model)
    hidden = service.model.config.hidden_size
    try:
        body.refuse_unhonoured()
        texts, prompts = body.prompts()
    except InvalidParameter as exc:
        raise from_engine(exc) from None
    if body.dimensions is not None and body.dimensions != hidden:
        raise ApiError(
            400, f"dimensions: this model's embeddings have {hidden} dimensions and cannot be shortened", "dimensions"
        )
    if texts is not None:
        if any(not text for text in texts):
            raise ApiError(400, "input: a text must not be empty", "input")
        prompts = [service.tokenizer.encode(text, add_special_tokens=body.add_special_tokens) for text in texts]
    assert prompts is not None
    vectors = await _pool(http, state, prompts, _pooling(state, service), adapter)
    if vectors is None:
        return None
    data = []
    for index, vector in enumerate(vectors):
        if body.normalize:
            vector = F.normalize(vector, dim=0)
        encoded = (
            base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
            if body.encoding_format == "base64"
            else vector.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = sum(len(p) for p in prompts)
    return {
        "object": "list",
        "data": data,
        "model": state.name_of(adapter),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _rerank_prompt(service: LlmService, query: str, document: str) -> list[int]:
    """A reranker's prompt for one pair: the file's rerank template filled in, else llama.cpp's default
    ``BOS query EOS SEP document EOS`` (SEP: the tokenizer's, else EOS)."""
    tokenizer, config = service.tokenizer, service.model.config
    if config.rerank_template is not None:
        text = config.rerank_template.replace("{query}", query).replace("{document}", document)
        return tokenizer.encode(text, add_special_tokens=False)
    eos, sep = getattr(tokenizer.hf, "eos_token_id", None), getattr(tokenizer.hf, "sep_token_id", None)
    sep = eos if sep is None else sep
    pieces: list[list[int | None]] = [[config.bos_token_id], [*tokenizer.encode(query, add_special_tokens=False)]]
    pieces += [[eos, sep], [*tokenizer.encode(document, add_special_tokens=False)], [eos]]
    return [token for piece in pieces for token in piece if token is not None]


def _relevance(service: LlmService, pooled: torch.Tensor) -> float:
    """A reranker's score of one pair from its last token's final hidden state."""
    scores = service.model.label_scores(pooled[None])[0]
    return float(torch.sigmoid(scores[0]) if scores.numel() == 1 else torch.softmax(scores, dim=0)[0])


async def _relevances(
    http: Request, state: ServerState, body: RerankRequest, adapter: str | None
) -> list[float] | None:
    service = state.ready_service()
    if service.model.score_head is not None:
        prompts = [_rerank_prompt(service, body.query, document) for document in body.documents]
        pooled = await _pool(http, state, prompts, "last", adapter)
        return None if pooled is None else [_relevance(service, p) for p in pooled]
    texts = [body.query, *body.documents]
    if any(not text for text in texts):
        raise ApiError(400, "query: the query and the documents must not be empty", "query")
    prompts = [service.tokenizer.encode(text) for text in texts]
    vectors = await _pool(http, state, prompts, _pooling(state, service), adapter)
    if vectors is None:
        return None
    query = F.normalize(vectors[0], dim=0)
    return [float(query @ F.normalize(v, dim=0)) for v in vectors[1:]]


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, http: Request) -> dict | None:
    state = _state(http)
    state.ready_service()
    adapter = state.check_model(body.model)
    try:
        body.refuse_unhonoured()
    except InvalidParameter as exc:
        raise from_engine(exc) from None
    scores = await _relevances(http, state, body, adapter)
    if scores is None:
        return None
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
    results = []
    for i in order:
        result: dict = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": body.documents[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": state.name_of(adapter),
        "created": int(time.time()),
        "usage": {"total_tokens": http.state.prompt_tokens},
        "results": results,
    }
