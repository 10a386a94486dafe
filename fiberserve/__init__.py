"""fiberserve: an LLM inference server whose batches run on a pool of fibers."""

from fiberserve.config import EngineConfig
from fiberserve.engine import SamplingParams
from fiberserve.offline import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "EngineConfig", "SamplingParams"]
