"""A Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) over a paged KV cache.

One :meth:`LlamaModel.forward` runs a *flat* batch: the new tokens of every
sequence laid end to end (no padding rows), each with its position and the
KV-cache slot it writes.  Prefill chunks and single decode tokens share the
call.  Attention reads each sequence's keys through its own page table only.

Batch invariance (same logits for a row alone or inside any batch) is a
design goal, and it shapes the attention code:

* linear layers are row-wise; bf16 ``F.linear`` is bit-identical for a row
  whatever the rows around it once there are at least two (see
  :data:`MIN_LINEAR_ROWS`);
* attention runs in float32 over keys gathered into a buffer padded to a
  multiple of :data:`KEY_BUCKET`, and decode rows are grouped by that padded
  length, so a row's reductions have the same shape alone or in a batch; the
  padded keys are masked to exactly zero weight and are only ever *read*
  (from slot 0 of the cache), never written;
* query matrices are padded to at least :data:`MIN_QUERY_ROWS` rows, so a
  prompt token computed as a one-token chunk (or a decode token) rounds
  exactly as it does inside a long prefill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fiberserve.model.config import ModelConfig
from fiberserve.model.loader import Checkpoint

#: Key buffers are padded to a multiple of this many positions (see module docstring).
KEY_BUCKET = 64
#: Attention products never run with fewer query rows per matrix than this: BLAS
#: takes a different (differently rounding) path for very thin matrices (measured:
#: 1 to 3 rows differ from 4+ in float32 on this CPU), so a decode row would not
#: match the same row computed inside a prefill.
MIN_QUERY_ROWS = 8
#: Linear layers never run on fewer rows than this, for the same reason: a
#: one-row bf16 product (a matrix-vector kernel) rounds differently from the
#: same row inside a larger product (measured on the 1536-wide down projection).
MIN_LINEAR_ROWS = 2
#: How many of the top bf16 logits of a row are recomputed exactly (see ``_refine_top``).
REFINED_LOGITS = 16


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that computes a row the same way whatever the number of rows around it."""
    rows = x.shape[0]
    if rows >= MIN_LINEAR_ROWS:
        return F.linear(x, weight, bias)
    padded = torch.cat([x, x.new_zeros(MIN_LINEAR_ROWS - rows, x.shape[1])])
    return F.linear(padded, weight, bias)[:rows]


@dataclass
class SequenceSpan:
    """One sequence's part of a flat batch."""

    start: int  #: first row of this sequence's new tokens in the flat batch
    length: int  #: number of new tokens (1 for decode)
    context: int  #: keys visible after this step (cached + new)
    slots: torch.Tensor  #: LongTensor [context]: the KV slot of every position 0..context-1


@dataclass
class ForwardBatch:
    tokens: torch.Tensor  #: LongTensor [T]
    positions: torch.Tensor  #: LongTensor [T]
    write_slots: torch.Tensor  #: LongTensor [T]: where each new token's K/V goes
    spans: list[SequenceSpan]
    logit_rows: torch.Tensor  #: LongTensor [R]: rows whose logits are returned

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


class KVCache:
    """Keys and values of every layer, addressed by flat slot = page * page_size + offset."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype, device) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (config.num_layers, num_pages * page_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_page(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * element


def _bucket(n: int) -> int:
    return -(-n // KEY_BUCKET) * KEY_BUCKET


@dataclass
class _AttentionPlan:
    """Index tensors shared by every layer of one forward call."""

    decode_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # rows, key slots, key mask
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # start, length, key slots, mask

    @classmethod
    def build(cls, batch: ForwardBatch, device) -> _AttentionPlan:
        by_bucket: dict[int, list[SequenceSpan]] = {}
        prefills = []
        for span in batch.spans:
            padded = _bucket(span.context)
            keys = torch.zeros(padded, dtype=torch.long)
            keys[: span.context] = span.slots[: span.context]
            if span.length == 1:
                by_bucket.setdefault(padded, []).append(span)
                continue
            first = span.context - span.length
            query_pos = torch.arange(first, span.context).unsqueeze(1)
            mask = torch.arange(padded).unsqueeze(0) <= query_pos  # causal; also hides padding
            prefills.append((span.start, span.length, keys.to(device), mask.to(device)))
        groups = []
        for padded, spans in by_bucket.items():
            rows = torch.tensor([s.start for s in spans], dtype=torch.long)
            keys = torch.zeros(len(spans), padded, dtype=torch.long)
            mask = torch.zeros(len(spans), padded, dtype=torch.bool)
            for i, s in enumerate(spans):
                keys[i, : s.context] = s.slots[: s.context]
                mask[i, : s.context] = True
            groups.append((rows.to(device), keys.to(device), mask.to(device)))
        return cls(groups, prefills)


def _rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.double()
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.float()


class _Layer:
    def __init__(self, w: dict[str, torch.Tensor], i: int, config: ModelConfig, dtype, device) -> None:
        p = f"model.layers.{i}."

        def get(name: str) -> torch.Tensor:
            return w[p + name].to(device=device, dtype=dtype).contiguous()

        self.attn_norm = w[p + "input_layernorm.weight"].to(device=device, dtype=dtype)
        self.mlp_norm = w[p + "post_attention_layernorm.weight"].to(device=device, dtype=dtype)
        self.qkv = torch.cat([get(f"self_attn.{x}_proj.weight") for x in "qkv"]).contiguous()
        self.qkv_bias = None
        if config.attention_bias:
            self.qkv_bias = torch.cat([get(f"self_attn.{x}_proj.bias") for x in "qkv"])
        self.o = get("self_attn.o_proj.weight")
        self.gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]).contiguous()
        self.down = get("mlp.down_proj.weight")


class LlamaModel:
    """Weights plus the forward pass; stateless between calls (the KV cache is passed in)."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        config = checkpoint.config
        w = checkpoint.weights
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.embed = w["model.embed_tokens.weight"].to(device=self.device, dtype=dtype)
        head = w.get("lm_head.weight")
        self.lm_head = self.embed if head is None or config.tie_word_embeddings else head.to(self.device, dtype)
        self.norm = w["model.norm.weight"].to(device=self.device, dtype=dtype)
        self.layers = [_Layer(w, i, config, dtype, self.device) for i in range(config.num_layers)]
        inv_freq = _rope_inv_freq(config, checkpoint.rope_freq_factors).to(self.device)
        positions = torch.arange(config.max_position_embeddings, device=self.device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq).repeat(1, 2)
        self.cos, self.sin = angles.cos(), angles.sin()
        self.scale = 1.0 / math.sqrt(config.head_dim)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE in float32; x: [T, heads, D], cos/sin: [T, 1, D] (each half repeated)."""
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return xf * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run the flat batch, write its K/V into ``cache``, return float32 logits [R, vocab]."""
        cfg = self.config
        T = batch.num_tokens
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        plan = _AttentionPlan.build(batch, self.device)
        tokens = batch.tokens.to(self.device)
        positions = batch.positions.to(self.device)
        write_slots = batch.write_slots.to(self.device)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        h = self.embed[tokens]
        for index, layer in enumerate(self.layers):
            x = F.rms_norm(h, (cfg.hidden_size,), layer.attn_norm, eps)
            qkv = _linear(x, layer.qkv, layer.qkv_bias)
            qk = self._rope(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
            cache.k[index].index_copy_(0, write_slots, k.to(cache.k.dtype))
            cache.v[index].index_copy_(0, write_slots, qkv[:, (H + KVH) * D :].view(T, KVH, D).to(cache.v.dtype))
            attn = self._attention(q, cache.k[index], cache.v[index], plan)
            h = h + _linear(attn.to(self.dtype), layer.o)
            x = F.rms_norm(h, (cfg.hidden_size,), layer.mlp_norm, eps)
            gate, up = _linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + _linear(F.silu(gate) * up, layer.down)
        h = F.rms_norm(h[batch.logit_rows.to(self.device)], (cfg.hidden_size,), self.norm, eps)
        logits = _linear(h, self.lm_head).float()
        if self.dtype != torch.float32:
            self._refine_top(logits, h)
        return logits

    def _refine_top(self, logits: torch.Tensor, h: torch.Tensor) -> None:
        """Recompute the leading candidates' logits in float32, in place.

        bf16 logits are coarse (steps of 0.125 near 20), so the top tokens often
        tie and greedy decoding would pick by token id.  The exact float32 dot
        products of the top :data:`REFINED_LOGITS` break those ties as the
        float32 model would; the work is elementwise per row, so batch invariant.
        """
        top = logits.topk(min(REFINED_LOGITS, logits.shape[-1]), dim=-1).indices  # [R, k]
        exact = (h.float().unsqueeze(1) * self.lm_head[top].float()).sum(-1)
        logits.scatter_(1, top, exact)

    def _attention(self, q: torch.Tensor, k_cache, v_cache, plan: _AttentionPlan) -> torch.Tensor:
        """q: [T, H, D] float32 -> [T, H*D] float32, each row attending to its own sequence only.

        Keys and values are gathered (read only) from the sequence's slots into
        float32 buffers laid out [.., KVH, L, D], so that one batched matmul per
        product covers every (sequence, kv head) pair; GQA groups share their kv head.
        """
        T, H, D = q.shape
        KVH = self.config.num_kv_heads
        G = H // KVH
        out = torch.empty(T, H * D, dtype=torch.float32, device=q.device)
        for rows, keys, mask in plan.decode_groups:
            B, L = keys.shape
            kk, vv = self._gather(k_cache, keys), self._gather(v_cache, keys)  # [B, KVH, L, D]
            R = max(G, MIN_QUERY_ROWS)
            qq = q.new_zeros(B * KVH, R, D)
            qq[:, :G] = q[rows].view(B * KVH, G, D)
            scores = torch.bmm(qq, kk.view(B * KVH, L, D).transpose(1, 2)).view(B, KVH, R, L)
            scores.mul_(self.scale).masked_fill_(~mask.view(B, 1, 1, L), float("-inf"))
            probs = scores.softmax(-1).view(B * KVH, R, L)
            out[rows] = torch.bmm(probs, vv.view(B * KVH, L, D))[:, :G].reshape(B, H * D)
        for start, length, keys, mask in plan.prefills:
            L = keys.shape[0]
            kk, vv = self._gather(k_cache, keys[None])[0], self._gather(v_cache, keys[None])[0]  # [KVH, L, D]
            qq = q[start : start + length].view(length, KVH, G, D).permute(1, 2, 0, 3).reshape(KVH, G * length, D)
            pad = max(0, MIN_QUERY_ROWS - G * length)
            if pad:  # rows of zeros, sliced off below
                qq = torch.cat([qq, qq.new_zeros(KVH, pad, D)], dim=1)
            scores = torch.bmm(qq, kk.transpose(1, 2))  # [KVH, G*Q + pad, L]
            scores.mul_(self.scale)
            scores[:, : G * length].view(KVH, G, length, L).masked_fill_(~mask, float("-inf"))
            o = torch.bmm(scores.softmax(-1), vv)[:, : G * length]  # [KVH, G*Q, D]
            out[start : start + length] = o.reshape(KVH, G, length, D).permute(2, 0, 1, 3).reshape(length, H * D)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """cache [slots, KVH, D], keys [B, L] -> float32 [B, KVH, L, D] (one gather, one copy)."""
        B, L = keys.shape
        rows = cache.index_select(0, keys.flatten()).view(B, L, cache.shape[1], cache.shape[2])
        buffer = torch.empty(B, cache.shape[1], L, cache.shape[2], dtype=torch.float32, device=cache.device)
        return buffer.copy_(rows.transpose(1, 2))
