"""The serving engine: KV pages, the scheduler, the sampler and the service that joins them."""

from fiberserve.engine.sampling_params import InvalidParameter, SamplingParams
from fiberserve.engine.sequence_output import EventsTaken
from fiberserve.engine.service import CompletionOutput, LlmService, QueueFull, Request, RequestFailed, RequestOutput

__all__ = [
    "CompletionOutput",
    "EventsTaken",
    "InvalidParameter",
    "LlmService",
    "QueueFull",
    "Request",
    "RequestFailed",
    "RequestOutput",
    "SamplingParams",
]
