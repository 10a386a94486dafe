"""What a forward pass takes: a flat batch of every sequence's new tokens (:class:`ForwardBatch`, a
:class:`SequenceSpan` per sequence), and the paged K/V it reads and writes (:class:`KVCache`)."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch

from fiberserve.model.config import ModelConfig
from fiberserve.model.kv_format import KvFormat
from fiberserve.model.lora import LoraRows


@dataclass
class SequenceSpan:
    """One sequence's part of a flat batch."""

    start: int  #: first row of this sequence's new tokens in the flat batch
    length: int  #: number of new tokens (1 for decode)
    context: int  #: keys visible after this step (cached + new)
    #: LongTensor [context]: the KV slot of every position 0..context-1 (page-aligned), or None with ``pages``
    slots: torch.Tensor | None = None
    pages: tuple[int, ...] | None = None  #: the pages holding those slots, in order (derived from slots if None)

    def page_list(self, page_size: int) -> list[int]:
        """The pages that hold positions ``0..context-1``."""
        used = -(-self.context // page_size)
        if self.pages is not None:
            return list(self.pages[:used])
        assert self.slots is not None, "a span needs its slots or its pages"
        return (self.slots[: self.context : page_size] // page_size).tolist()


@dataclass
class ForwardBatch:
    tokens: torch.Tensor  #: LongTensor [T]
    positions: torch.Tensor  #: LongTensor [T]
    write_slots: torch.Tensor  #: LongTensor [T]: where each new token's K/V goes
    spans: list[SequenceSpan]
    logit_rows: torch.Tensor  #: LongTensor [R]: rows whose logits are returned
    lora: LoraRows = field(default_factory=LoraRows)  #: the rows each LoRA adapter runs (none: the base model)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


class KVCache:
    """Keys and values of every layer, ``[layer, slot, kv_head, row]``; slot = page * page_size + offset, a row
    one head's ``head_dim`` values in the cache's :class:`.KvFormat` (the model's dtype, or quantized).

    Zero-filled; on CPU the zeros are the operating system's (a fresh anonymous mapping), so a cache sized for
    a model's whole context takes memory only as its pages are first written, but for the first ``resident_pages``
    (default: all), written at once: the pages the pool hands out first (``PagePool`` takes the lowest free page),
    whose first writes would otherwise slow the first requests and the pass times the scheduler learns from."""

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        format: KvFormat | torch.dtype,
        device,
        resident_pages: int | None = None,
    ) -> None:
        """``format``: how rows are stored; a dtype stores them unquantized in it."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.format = format = _as_format(format)
        width = format.row_width(config.head_dim)
        shape = (config.num_layers, num_pages * page_size, config.num_kv_heads, width)
        self.k, self.v = _zeros(shape, format.storage, device), _zeros(shape, format.storage, device)
        resident = num_pages if resident_pages is None else min(resident_pages, num_pages)
        for cache in (self.k, self.v):
            cache[:, : resident * page_size].view(torch.uint8).zero_()

    def store(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write new tokens' keys and values [n, kv_heads, head_dim] (model dtype) into ``layer``'s ``slots``."""
        for cache, rows in ((self.k, keys), (self.v, values)):  # as bytes: index_copy_ takes no float8
            cache[layer].view(torch.uint8).index_copy_(0, slots, self.format.quantize(rows).view(torch.uint8))

    @staticmethod
    def bytes_per_page(config: ModelConfig, page_size: int, format: KvFormat | torch.dtype) -> int:
        row = _as_format(format).row_bytes(config.head_dim)
        return 2 * config.num_layers * page_size * config.num_kv_heads * row


def _as_format(format: KvFormat | torch.dtype) -> KvFormat:
    return format if isinstance(format, KvFormat) else KvFormat("auto", format)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros``, on CPU in an anonymous mapping of its own (page-aligned; the OS maps its zero pages in as
    they are first touched, where ``torch.zeros`` writes every byte at once and malloc may hand back used heap)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]  # the array keeps the mapping
    return torch.from_numpy(pages).view(dtype).view(shape)
