"""vLLM's ``/tokenize`` and ``/detokenize``: the token ids the server would feed the model, and back.

Clients use them to count a prompt's tokens against the context length before sending it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from fiberserve.server.errors import ApiError
from fiberserve.server.protocol import DetokenizeRequest, TokenizeRequest
from fiberserve.server.state import ServerState
from fiberserve.server.tools import template_tools

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.fiberserve


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """``{"count", "max_model_len", "tokens"}`` for ``prompt`` or llama.cpp's ``content`` (as ``/v1/completions``
    encodes it) or for ``messages`` (as ``/v1/chat/completions`` renders and encodes them)."""
    state = _state(request)
    service = state.ready_service()
    state.check_model(body.model)
    prompt, add_special = (
        (body.prompt, body.add_special_tokens) if body.content is None else (body.content, body.add_special)
    )
    if sum(given is not None for given in (body.prompt, body.content, body.messages)) != 1:
        raise ApiError(400, "prompt: give one of prompt, content (llama.cpp's name) or messages", "prompt")
    if prompt is not None:
        tokens = service.tokenizer.encode(prompt, add_special_tokens=add_special)
    elif body.messages is not None:
        tokens = state.encode_chat(body.messages, body.add_generation_prompt, template_tools(body.tools))
    return {"count": len(tokens), "max_model_len": service.max_context, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    """``{"prompt"}``: the text of ``tokens``, special tokens included."""
    state = _state(request)
    service = state.ready_service()
    state.check_model(body.model)
    vocab = service.tokenizer.vocab_size
    if not all(0 <= t < vocab for t in body.tokens):
        raise ApiError(400, f"tokens: ids must be in [0, {vocab})", "tokens")
    return {"prompt": service.tokenizer.decode(body.tokens, skip_special_tokens=False)}
