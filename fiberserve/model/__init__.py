"""Weights and math: config, loaders, the Llama-family decoder, the tokenizer, the default model.

The names below are imported on first use (as the package's top level does), so that a torch-free submodule such
as :mod:`fiberserve.model.config`, which the load generator reads a model's size with, imports no PyTorch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fiberserve.model.batch import ForwardBatch, KVCache, SequenceSpan
    from fiberserve.model.config import ModelConfig, UnsupportedModelError
    from fiberserve.model.llama import LlamaModel
    from fiberserve.model.loader import Checkpoint, load_checkpoint
    from fiberserve.model.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

__all__ = [
    "Checkpoint",
    "ForwardBatch",
    "IncrementalDetokenizer",
    "KVCache",
    "LlamaModel",
    "ModelConfig",
    "SequenceSpan",
    "Tokenizer",
    "UnsupportedModelError",
    "load_checkpoint",
    "load_tokenizer",
]
_HOMES = {
    "Checkpoint": "loader",
    "ForwardBatch": "batch",
    "IncrementalDetokenizer": "tokenizer",
    "KVCache": "batch",
    "LlamaModel": "llama",
    "ModelConfig": "config",
    "SequenceSpan": "batch",
    "Tokenizer": "tokenizer",
    "UnsupportedModelError": "config",
    "load_checkpoint": "loader",
    "load_tokenizer": "tokenizer",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'fiberserve.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fiberserve.model.{_HOMES[name]}"), name)
