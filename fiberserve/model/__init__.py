"""Weights and math: config, loaders, the Llama-family decoder, the tokenizer, the default model."""

from fiberserve.model.config import ModelConfig, UnsupportedModelError
from fiberserve.model.llama import ForwardBatch, KVCache, LlamaModel, SequenceSpan
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
