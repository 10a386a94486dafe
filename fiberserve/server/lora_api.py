"""Loading and unloading LoRA adapters while serving: vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (SGLang's paths without ``/v1`` too), behind ``--api-key`` like every route."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fiberserve.engine.adapters import AdapterInUse, AdapterNotFound
from fiberserve.engine.sampling_params import InvalidParameter
from fiberserve.server.errors import ApiError, from_engine
from fiberserve.server.protocol import LoadLoraRequest, UnloadLoraRequest
from fiberserve.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.fiberserve


@router.post("/v1/load_lora_adapter")
@router.post("/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> dict:
    """Serve the adapter at ``lora_path`` as ``lora_name``: 400 naming the field where the name is taken or the
    file does not fit the model."""
    state = _state(request)
    service = state.ready_service()
    try:
        body.refuse_unhonoured()
        await service.load_adapter(body.lora_name, body.lora_path, frozenset({state.model_name}))
    except InvalidParameter as exc:
        raise from_engine(exc) from None
    adapter = service.adapters.get(body.lora_name)
    return {"object": "lora_adapter", "name": adapter.name, "path": adapter.path, "rank": adapter.rank}


@router.post("/v1/unload_lora_adapter")
@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> dict:
    """Stop serving ``lora_name``: 404 if no such adapter is loaded, 409 while requests still run under it."""
    state = _state(request)
    try:
        state.ready_service().unload_adapter(body.lora_name)
    except AdapterNotFound:
        message = f"lora_name: no LoRA adapter {body.lora_name!r} is loaded"
        raise ApiError(404, message, "lora_name", kind="not_found_error") from None
    except AdapterInUse as exc:
        raise ApiError(409, f"lora_name: {exc}", "lora_name", kind="conflict") from None
    return {"object": "lora_adapter", "name": body.lora_name, "unloaded": True}
