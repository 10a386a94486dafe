"""Attention over the paged KV cache, behind one interface.

A backend is built once per forward pass from the batch's spans (every layer shares it) and called per layer:
``backend(q [T, H, D], k_cache, v_cache [slots, KVH, row], window) -> [T, H * D]`` (rows in the cache's
format, :mod:`.kv_format`), each row attending causally
to its own sequence's keys only (the last ``window`` of them on a sliding-window layer).

* :class:`PagedKernelAttention` (CPU): :func:`.kernels.paged_attention` reads each sequence's pages in place
  through its page table: no gathered key copies, no padding, no masks, and a row's bits do not depend on the
  rows beside it.
* :class:`SdpaAttention` (any device; CUDA): keys gathered a page at a time into buffers padded to a multiple
  of :data:`KEY_BUCKET`, then ``scaled_dot_product_attention``.  Decode rows are grouped by that padded length,
  so a row's reductions have the same shape alone or in a batch; padded keys get exactly zero weight and are
  only ever *read* (from page 0).  In float32 query matrices are padded to at least :data:`MIN_QUERY_ROWS`
  rows.  GQA costs no key duplication: the ``G`` query heads that share a kv head are the rows of one problem.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from fiberserve import kernels
from fiberserve.model.batch import ForwardBatch, SequenceSpan
from fiberserve.model.kv_format import dequantize
from fiberserve.model.small_tensors import tensor_of

#: Key buffers are padded to a multiple of this many positions (see the module docstring).
KEY_BUCKET = 64
#: In float32, attention never runs with fewer query rows per problem than this: thin float32 products take a
#: different (differently rounding) path, so a decode row would not match the same row computed inside a
#: prefill.  bf16 rows match at any count.
MIN_QUERY_ROWS = {torch.float32: 8}


class AttentionBackend(Protocol):
    """One forward pass's attention: called once per layer with that layer's queries and cache."""

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None
    ) -> torch.Tensor: ...


@dataclass
class PagedKernelAttention:
    """The inputs of :func:`.kernels.paged_attention` for one forward pass."""

    pages: torch.Tensor  #: int32 [spans, max pages]: each span's page table, padded with page 0
    row_span: torch.Tensor  #: int32 [rows]: the span of each row; -1 for a padding row
    row_keys: torch.Tensor  #: int32 [rows]: how many keys each row sees (its position + 1)
    page_size: int
    scale: float
    softcap: float | None = None  #: scores capped to ``softcap * tanh(s / softcap)`` (Gemma 2)

    @classmethod
    def build(
        cls, batch: ForwardBatch, page_size: int, rows: int, scale: float, softcap: float | None = None
    ) -> PagedKernelAttention:
        """Tables for ``rows`` rows: the batch's, then padding rows (which attend to nothing)."""
        row_span, row_keys, tables = [-1] * rows, [0] * rows, []
        for index, span in enumerate(batch.spans):
            end, first = span.start + span.length, span.context - span.length
            row_span[span.start : end] = [index] * span.length
            row_keys[span.start : end] = range(first + 1, span.context + 1)
            tables.append(span.page_list(page_size))
        width = max(map(len, tables), default=1)
        padded = [page for table in tables for page in table + [0] * (width - len(table))] or [0]
        pages = tensor_of(padded, torch.int32).view(-1, width)
        return cls(pages, tensor_of(row_span, torch.int32), tensor_of(row_keys, torch.int32), page_size, scale, softcap)

    @property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float]:
        """What :func:`.kernels.decoder_layers` takes for its attention."""
        return self.pages, self.row_span, self.row_keys, self.page_size, self.scale

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None = None
    ) -> torch.Tensor:
        return kernels.paged_attention(q, k_cache, v_cache, *self.tables, window, self.softcap)


def _page_table(span: SequenceSpan, page_size: int, padded: int) -> torch.Tensor:
    """The pages holding the span's keys, padded with page 0 (read, masked) to cover ``padded`` keys."""
    pages = torch.zeros(padded // page_size, dtype=torch.long)
    used = span.page_list(page_size)
    pages[: len(used)] = torch.tensor(used, dtype=torch.long)
    return pages


def _rows(starts: list[int], device) -> slice | torch.Tensor:
    """Row indices as a slice when they are consecutive (decodes usually are), which indexes without a copy."""
    if starts == list(range(starts[0], starts[0] + len(starts))):
        return slice(starts[0], starts[0] + len(starts))
    return torch.tensor(starts, dtype=torch.long, device=device)


def _additive(mask: torch.Tensor, dtype, device) -> torch.Tensor:
    """A boolean keep-mask as the additive mask attention adds to its scores."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf")).to(device)


@dataclass
class _SdpaPlan:
    """Index tensors and masks for one window size, shared by every layer of that window.

    Keys are gathered a page at a time: a page is one contiguous row of ``page_size * kv_heads * head_dim``
    values, so a gather moves whole rows with 16x fewer indices than a slot-at-a-time gather.
    """

    decode_groups: list[tuple[slice | torch.Tensor, torch.Tensor, torch.Tensor]]  # rows, pages [B*P], mask
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # start, length, pages [P], mask [Q, L]

    @classmethod
    def build(
        cls, batch: ForwardBatch, page_size: int, min_query_rows: int, dtype, device, window: int | None = None
    ) -> _SdpaPlan:
        """Group decode rows by padded key length; give each prefill chunk its causal mask (and, for layers with
        a sliding ``window``, one that hides the keys before each row's last ``window``).

        Key buffers are padded to a multiple of both :data:`KEY_BUCKET` and the page size.  A chunk with fewer
        than ``min_query_rows`` rows gets extra mask rows (for the zero query rows :meth:`SdpaAttention._pad_rows`
        adds) that see key 0 only.  Masks are additive (0 or -inf, in ``dtype``), built once here rather than by
        every layer's attention call.
        """
        unit = math.lcm(KEY_BUCKET, page_size)
        by_bucket: dict[int, list[SequenceSpan]] = {}
        prefills = []
        for span in batch.spans:
            padded = -(-span.context // unit) * unit
            if span.length == 1:
                by_bucket.setdefault(padded, []).append(span)
                continue
            first = span.context - span.length
            query_pos = torch.arange(first, span.context).unsqueeze(1)
            keys = torch.arange(padded).unsqueeze(0)
            mask = keys <= query_pos  # causal; also hides padding
            if window is not None:
                mask &= keys > query_pos - window
            if span.length < min_query_rows:
                mask = torch.cat([mask, torch.arange(padded).eq(0).expand(min_query_rows - span.length, -1)])
            pages = _page_table(span, page_size, padded)
            prefills.append((span.start, span.length, pages.to(device), _additive(mask, dtype, device)))
        groups = []
        for padded, spans in by_bucket.items():
            rows = _rows([s.start for s in spans], device)
            pages = torch.cat([_page_table(s, page_size, padded) for s in spans])
            mask = torch.zeros(len(spans), padded, dtype=torch.bool)
            for i, s in enumerate(spans):
                mask[i, max(0, s.context - window) if window else 0 : s.context] = True
            groups.append((rows, pages.to(device), _additive(mask.view(len(spans), 1, 1, padded), dtype, device)))
        return cls(groups, prefills)


class SdpaAttention:
    """``scaled_dot_product_attention`` over keys gathered from the pages (see the module docstring)."""

    def __init__(
        self,
        batch: ForwardBatch,
        page_size: int,
        windows: set[int | None],
        scale: float,
        dtype: torch.dtype,
        device: torch.device,
        softcap: float | None = None,
    ) -> None:
        """Plans for each of the model's layer ``windows`` (None: full attention)."""
        self.page_size, self.scale, self.softcap = page_size, scale, softcap
        self.min_query_rows = MIN_QUERY_ROWS.get(dtype, 1)
        self.plans = {w: _SdpaPlan.build(batch, page_size, self.min_query_rows, dtype, device, w) for w in windows}

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None = None
    ) -> torch.Tensor:
        """A decode group of B sequences is one attention call with batch ``(B, KVH)`` and the G query heads of
        each kv head as its rows; a prefill chunk is one call over its own keys."""
        plan, page_size = self.plans[window], self.page_size
        T, H, D = q.shape
        KVH = k_cache.shape[1]
        G = H // KVH
        out = torch.zeros(T, H * D, dtype=q.dtype, device=q.device)  # rows of no span (padding) stay zero
        page_width = page_size * k_cache[0].numel()  # a page's rows, one contiguous run
        k_pages, v_pages = k_cache.view(-1, page_width), v_cache.view(-1, page_width)

        def gather(cache_pages: torch.Tensor, pages: torch.Tensor, batch: int) -> torch.Tensor:
            """The pages' rows as [batch, KVH, L, D] in the queries' dtype (dequantized from a quantized cache)."""
            rows = cache_pages.index_select(0, pages).view(batch, -1, KVH, k_cache.shape[-1])
            return dequantize(rows, D, q.dtype).transpose(1, 2)

        for rows, pages, mask in plan.decode_groups:
            B = mask.shape[0]
            kk, vv = gather(k_pages, pages, B), gather(v_pages, pages, B)  # [B, KVH, L, D]
            qq = self._pad_rows(q[rows].view(B, KVH, G, D))  # [B, KVH, >=G, D]
            o = self._sdpa(qq, kk, vv, mask)
            out[rows] = o[:, :, :G].reshape(B, H * D)
        for start, length, pages, mask in plan.prefills:
            kk, vv = gather(k_pages, pages, 1), gather(v_pages, pages, 1)  # [1, KVH, L, D]
            qq = self._pad_rows(q[start : start + length].transpose(0, 1).unsqueeze(0))  # [1, H, >=Q, D]
            o = self._sdpa(qq, kk, vv, mask)
            out[start : start + length] = o[0, :, :length].transpose(0, 1).reshape(length, H * D)
        return out

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of q [B, H, Q, D] over k, v [B, KVH, L, D] (H a multiple of KVH) with an additive ``mask``;
        with a ``softcap``, the scores are capped before the mask, as transformers does."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        cap = self.softcap
        scores = torch.tanh(q.float() @ k.float().transpose(-1, -2) * self.scale / cap) * cap + mask
        return (scores.softmax(-1) @ v.float()).to(q.dtype)

    def _pad_rows(self, q: torch.Tensor) -> torch.Tensor:
        """Pad the query rows (dim -2) with zeros up to :attr:`min_query_rows` (float32 only)."""
        rows = q.shape[-2]
        if rows >= self.min_query_rows:
            return q
        pad = q.new_zeros(*q.shape[:-2], self.min_query_rows - rows, q.shape[-1])
        return torch.cat([q, pad], dim=-2)
